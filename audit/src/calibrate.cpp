#include "kvrelay/audit/calibrate.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <map>

#include "kvrelay/audit/regression.h"
#include "kvrelay/audit/statistics.h"

namespace kvrelay::audit {

using nlohmann::json;

namespace {

bool is_baseline(const Trial& trial, const CalibrationOptions& options) {
  return trial.treatment == options.baseline ||
         (trial.medium == "tokens" && (trial.span.empty() || trial.span == "none"));
}

}  // namespace

json calibrate(const TrialSet& trials, const CalibrationOptions& options) {
  json agents = json::object();
  json media = json::object();
  json evidence_agents = json::object();
  json evidence_media = json::object();
  json skipped = json::array();

  std::map<std::string, std::vector<const Trial*>> baseline_by_agent;
  std::map<std::string, std::vector<const Trial*>> by_medium;
  std::size_t without_agent = 0;
  std::size_t not_as_assigned = 0;
  for (const auto& trial : trials.trials) {
    // A trial's medium is its assignment's: one delivered otherwise (a missed lookup, a refresh)
    // would price the wrong medium, so it is left out (issue #28).
    if (trial.delivered_treatment && *trial.delivered_treatment != trial.treatment) {
      ++not_as_assigned;
      continue;
    }
    if (is_baseline(trial, options)) {
      if (trial.receiver_agent.empty()) {
        ++without_agent;
      } else {
        baseline_by_agent[trial.receiver_agent].push_back(&trial);
      }
    } else if (!trial.medium.empty() && trial.medium != "tokens") {
      by_medium[trial.medium].push_back(&trial);
    }
  }
  if (not_as_assigned > 0) {
    skipped.push_back(fmt::format("{} trials were delivered other than assigned and are left out", not_as_assigned));
  }
  if (without_agent > 0) {
    skipped.push_back(fmt::format("{} baseline trials name no receiver_agent; prefill fits need it", without_agent));
  }

  for (const auto& [agent, arm] : baseline_by_agent) {
    if (arm.size() < options.min_trials) {
      skipped.push_back(fmt::format("agent {}: {} baseline trials, {} needed", agent, arm.size(), options.min_trials));
      continue;
    }
    // The cost model's prefill form with nothing cached: t(n) = a + b n + c n^2, in seconds.
    std::vector<double> tokens;
    std::vector<double> seconds;
    std::vector<double> decode_s_per_token;
    for (const Trial* trial : arm) {
      tokens.push_back(static_cast<double>(trial->context_tokens));
      seconds.push_back(trial->ttft_ms / 1000.0);
      if (trial->e2e_ms && trial->output_tokens && *trial->output_tokens > 1 && *trial->e2e_ms >= trial->ttft_ms) {
        decode_s_per_token.push_back((*trial->e2e_ms - trial->ttft_ms) / 1000.0 /
                                     static_cast<double>(*trial->output_tokens - 1));
      }
    }
    const auto fit = fit_non_negative_quadratic(tokens, seconds);
    if (!fit) {
      skipped.push_back(fmt::format("agent {}: prefill fit failed", agent));
      continue;
    }
    json entry{{"prefill_s", {{"a", fit->a}, {"b", fit->b}, {"c", fit->c}}}};
    double squared_relative = 0.0;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const double relative = seconds[i] > 0.0 ? (fit->at(tokens[i]) - seconds[i]) / seconds[i] : 0.0;
      squared_relative += relative * relative;
    }
    json agent_evidence{{"trials", arm.size()},
                        {"min_tokens", *std::min_element(tokens.begin(), tokens.end())},
                        {"max_tokens", *std::max_element(tokens.begin(), tokens.end())},
                        {"rms_relative_error", std::sqrt(squared_relative / static_cast<double>(tokens.size()))}};
    if (decode_s_per_token.size() >= options.min_trials) {
      entry["decode_s_per_token"] = median(decode_s_per_token);
      agent_evidence["decode_trials"] = decode_s_per_token.size();
    }
    agents[agent] = std::move(entry);
    evidence_agents[agent] = std::move(agent_evidence);
  }

  // Output length under the baseline, per context, for the extra-decode comparison.
  std::vector<double> baseline_output;
  for (const auto& trial : trials.trials) {
    if (is_baseline(trial, options) && trial.output_tokens) {
      baseline_output.push_back(static_cast<double>(*trial.output_tokens));
    }
  }
  for (const auto& [medium, arm] : by_medium) {
    std::vector<double> agreement;
    std::vector<double> output;
    std::vector<double> tokens;
    std::vector<double> ttft;
    for (const Trial* trial : arm) {
      if (trial->top1_agreement) agreement.push_back(*trial->top1_agreement);
      if (trial->output_tokens) output.push_back(static_cast<double>(*trial->output_tokens));
      tokens.push_back(static_cast<double>(trial->context_tokens));
      ttft.push_back(trial->ttft_ms);
    }
    json entry = json::object();
    json medium_evidence{{"trials", arm.size()}};
    if (agreement.size() >= options.min_trials) {
      entry["fidelity"] = std::clamp(mean(agreement), 1e-6, 1.0);
      medium_evidence["top1_trials"] = agreement.size();
    }
    if (output.size() >= options.min_trials && baseline_output.size() >= options.min_trials &&
        mean(baseline_output) > 0) {
      entry["extra_decode_fraction"] = std::max(0.0, mean(output) / mean(baseline_output) - 1.0);
      medium_evidence["output_trials"] = output.size();
    }
    if (const auto line = fit_line(tokens, ttft)) {
      // Informational: end-to-end TTFT of this medium against length, for comparison with the
      // engine's predicted C_comm + C_codec (which it measures online from transfers).
      medium_evidence["ttft_fit_ms"] = {{"intercept", line->intercept}, {"per_token", line->slope}};
    }
    evidence_media[medium] = std::move(medium_evidence);
    if (entry.empty()) {
      skipped.push_back(fmt::format("medium {}: no top1_agreement or output_tokens in {} or more trials", medium,
                                    options.min_trials));
      continue;
    }
    media[medium] = std::move(entry);
  }

  return {{"cost_model", {{"agents", std::move(agents)}, {"media", std::move(media)}}},
          {"calibration",
           {{"trials", trials.trials.size()},
            {"baseline", options.baseline},
            {"agents", std::move(evidence_agents)},
            {"media", std::move(evidence_media)},
            {"skipped", std::move(skipped)}}}};
}

}  // namespace kvrelay::audit
