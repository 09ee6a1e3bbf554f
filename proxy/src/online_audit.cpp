#include "kvrelay/proxy/online_audit.h"

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "kvrelay/audit/render.h"

namespace kvrelay::proxy {

OnlineAudit::OnlineAudit(std::size_t max_trials_in_memory, std::uint64_t seed)
    : max_trials_(max_trials_in_memory), generator_(seed) {}

std::optional<Treatment> OnlineAudit::draw(const RoutePolicy& route) {
  const auto& policy = route.audit;
  if (!(policy.fraction > 0.0) || policy.treatments.empty()) return std::nullopt;
  const std::lock_guard lock(mutex_);
  if (std::uniform_real_distribution<double>(0.0, 1.0)(generator_) >= policy.fraction) return std::nullopt;
  if (pending_.size() >= max_trials_) {
    ++dropped_;  // unfinished requests piling up: stop auditing rather than grow without bound
    return std::nullopt;
  }
  std::uniform_int_distribution<std::size_t> pick(0, policy.treatments.size() - 1);
  return policy.treatments[pick(generator_)];
}

void OnlineAudit::record_assignment(const RoutePolicy& route, const std::string& request_id, const Treatment& treatment,
                                    audit::Trial covariates) {
  const auto& policy = route.audit;
  const std::lock_guard lock(mutex_);
  covariates.route = route.id;
  covariates.request_id = request_id;
  covariates.treatment = treatment.name;
  covariates.medium = treatment.medium;
  covariates.span = std::string(span_name(treatment.span));
  covariates.pair_id.reset();  // online trials are independent requests
  if (!policy.trials_file.empty()) append_line(policy.trials_file, audit::assignment_line(covariates));
  pending_[request_id] = {std::move(covariates), policy.trials_file};
}

void OnlineAudit::record_outcome(const std::string& request_id, const AuditOutcome& outcome) {
  const std::lock_guard lock(mutex_);
  const auto found = pending_.find(request_id);
  if (found == pending_.end()) return;
  auto [trial, trials_file] = std::move(found->second);
  pending_.erase(found);
  trial.delivered_treatment = outcome.delivered_treatment;
  if (trial.delivered_treatment && trial.delivered_treatment->empty()) trial.delivered_treatment.reset();
  trial.delivery_reason = outcome.delivery_reason;
  const bool differing = !audit::delivered_as_assigned(trial);
  // A trial delivered other than assigned always says why, if only that nobody said.
  if (differing && trial.delivery_reason.empty()) trial.delivery_reason = "unspecified";
  if (!trials_file.empty()) {
    append_line(trials_file,
                audit::outcome_line({request_id, outcome.ttft_ms, outcome.e2e_ms, outcome.status, outcome.prompt_tokens,
                                     outcome.cached_tokens, trial.delivered_treatment, trial.delivery_reason}));
  }
  if (outcome.status < 200 || outcome.status >= 300) {
    ++failed_;
    return;
  }
  trial.ttft_ms = outcome.ttft_ms;
  trial.e2e_ms = outcome.e2e_ms;
  trial.status = outcome.status;
  if (trial.context_tokens == 0 && outcome.prompt_tokens) trial.context_tokens = *outcome.prompt_tokens;
  trial.cached_tokens = outcome.cached_tokens;
  if (differing) ++differing_;
  if (finished_.size() >= max_trials_) finished_.erase(finished_.begin());  // keep the newest
  finished_.push_back(std::move(trial));
}

std::size_t OnlineAudit::delivery_differing() const {
  const std::lock_guard lock(mutex_);
  return differing_;
}

audit::TrialSet OnlineAudit::snapshot() const {
  const std::lock_guard lock(mutex_);
  audit::TrialSet set;
  set.trials = finished_;
  set.assignments_without_outcome = pending_.size();
  set.failed_outcomes = failed_;
  return set;
}

nlohmann::json OnlineAudit::report(const audit::AnalysisOptions& options) const {
  const auto trials = snapshot();
  nlohmann::json body;
  if (trials.trials.empty()) {
    body = {{"trials", 0}, {"strata", nlohmann::json::array()}, {"overall", nlohmann::json::array()}};
  } else if (auto analysed = audit::analyze(trials, options)) {
    body = audit::report_to_json(analysed.value());
  } else {
    body = {{"trials", trials.trials.size()}, {"error", analysed.error().message}};
  }
  body["in_flight"] = trials.assignments_without_outcome;
  {
    const std::lock_guard lock(mutex_);
    body["not_audited_backlog"] = dropped_;
    body["delivery_differing_total"] = differing_;
  }
  return body;
}

void OnlineAudit::append_line(const std::string& path, const std::string& line) {
  auto& file = files_[path];
  if (!file) {
    file = std::make_unique<std::ofstream>(path, std::ios::app | std::ios::binary);
    if (!*file) spdlog::warn("audit: cannot open trials file {}; keeping trials in memory only", path);
  }
  if (!*file) return;
  *file << line << '\n';
  file->flush();  // on disk before the request is forwarded
}

std::optional<nlohmann::json> worker_stats_from_tail(std::string_view tail) {
  constexpr std::string_view kKey = "\"kvrelay\":";
  const auto key = tail.rfind(kKey);
  if (key == std::string_view::npos) return std::nullopt;
  const auto open = tail.find('{', key + kKey.size());
  if (open == std::string_view::npos) return std::nullopt;
  const auto close = tail.find('}', open);
  if (close == std::string_view::npos) return std::nullopt;
  auto stats = nlohmann::json::parse(tail.substr(open, close - open + 1), nullptr, /*allow_exceptions=*/false);
  if (stats.is_discarded() || !stats.is_object()) return std::nullopt;
  return stats;
}

}  // namespace kvrelay::proxy
