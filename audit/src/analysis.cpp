#include "kvrelay/audit/analysis.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <set>

namespace kvrelay::audit {

namespace {

// The two arms of one comparison, as the tests consume them: paired vectors align by pair.
struct Arms {
  bool paired = false;
  std::vector<double> treatment;
  std::vector<double> baseline;
  std::size_t n_treatment = 0;
  std::size_t n_baseline = 0;
};

// Paired when every trial of both arms names a pair and at least two pairs have both arms;
// repeats of one treatment within a pair are averaged first. Unmatched trials then drop out.
Arms arms_of(const std::vector<const Trial*>& treatment, const std::vector<const Trial*>& baseline) {
  Arms arms;
  arms.n_treatment = treatment.size();
  arms.n_baseline = baseline.size();
  const auto all_paired = [](const std::vector<const Trial*>& arm) {
    return std::all_of(arm.begin(), arm.end(), [](const Trial* t) { return t->pair_id.has_value(); });
  };
  if (all_paired(treatment) && all_paired(baseline)) {
    std::map<std::string, std::pair<double, std::size_t>> treatment_by_pair;
    std::map<std::string, std::pair<double, std::size_t>> baseline_by_pair;
    for (const Trial* t : treatment) {
      auto& [sum, count] = treatment_by_pair[*t->pair_id];
      sum += t->ttft_ms;
      ++count;
    }
    for (const Trial* t : baseline) {
      auto& [sum, count] = baseline_by_pair[*t->pair_id];
      sum += t->ttft_ms;
      ++count;
    }
    std::vector<double> paired_treatment;
    std::vector<double> paired_baseline;
    for (const auto& [pair, sum_count] : treatment_by_pair) {
      const auto found = baseline_by_pair.find(pair);
      if (found == baseline_by_pair.end()) continue;
      paired_treatment.push_back(sum_count.first / static_cast<double>(sum_count.second));
      paired_baseline.push_back(found->second.first / static_cast<double>(found->second.second));
    }
    if (paired_treatment.size() >= 2) {
      arms.paired = true;
      arms.treatment = std::move(paired_treatment);
      arms.baseline = std::move(paired_baseline);
      return arms;
    }
  }
  for (const Trial* t : treatment)
    arms.treatment.push_back(t->ttft_ms);
  for (const Trial* t : baseline)
    arms.baseline.push_back(t->ttft_ms);
  return arms;
}

Effect effect_of(const std::string& treatment, const std::string& baseline, const Arms& arms,
                 const BootstrapOptions& bootstrap) {
  Effect effect;
  effect.treatment = treatment;
  effect.baseline = baseline;
  effect.paired = arms.paired;
  effect.n_treatment = arms.n_treatment;
  effect.n_baseline = arms.n_baseline;
  effect.n = arms.paired ? arms.treatment.size() : arms.treatment.size() + arms.baseline.size();
  effect.mean_treatment_ms = mean(arms.treatment);
  effect.mean_baseline_ms = mean(arms.baseline);
  effect.t_test =
      arms.paired ? paired_t_test(arms.treatment, arms.baseline) : welch_t_test(arms.treatment, arms.baseline);
  const double difference = effect.mean_treatment_ms - effect.mean_baseline_ms;
  effect.pct_change = percent_change(difference, effect.mean_baseline_ms);
  effect.median_diff_ms = median(arms.treatment) - median(arms.baseline);
  effect.p99_diff_ms = quantile(arms.treatment, 0.99) - quantile(arms.baseline, 0.99);
  effect.bootstrap = arms.paired ? bootstrap_paired(arms.treatment, arms.baseline, bootstrap)
                                 : bootstrap_unpaired(arms.treatment, arms.baseline, bootstrap);
  if (arms.paired) effect.wilcoxon = wilcoxon_signed_rank(arms.treatment, arms.baseline);
  return effect;
}

void apply_holm(std::vector<Effect>& effects) {
  std::vector<double> p_values;
  std::vector<Effect*> tested;
  for (auto& effect : effects) {
    if (!effect.t_test) continue;
    p_values.push_back(effect.t_test->p_value);
    tested.push_back(&effect);
  }
  const auto adjusted = holm_adjust(p_values);
  for (std::size_t i = 0; i < tested.size(); ++i)
    tested[i]->p_holm = adjusted[i];
}

struct StratumData {
  StratumReport report;
  std::map<std::string, std::vector<const Trial*>> by_treatment;
  std::map<std::string, Arms> arms;  // by treatment, for the stratified bootstrap
};

// Overall effect: stratum effects weighted by stratum size (post-stratification), the standard
// error combined accordingly and Welch-Satterthwaite degrees of freedom.
Effect overall_effect(const std::string& treatment, const std::string& baseline, const std::vector<StratumData>& strata,
                      const BootstrapOptions& bootstrap) {
  Effect effect;
  effect.treatment = treatment;
  effect.baseline = baseline;
  effect.paired = true;
  struct Part {
    const StratumData* stratum;
    const Effect* effect;
    double weight;
  };
  std::vector<Part> parts;
  double total = 0.0;
  for (const auto& stratum : strata) {
    for (const auto& candidate : stratum.report.effects) {
      if (candidate.treatment != treatment || !candidate.t_test) continue;
      parts.push_back({&stratum, &candidate, static_cast<double>(stratum.report.trials)});
      total += static_cast<double>(stratum.report.trials);
    }
  }
  if (parts.empty()) {
    effect.paired = false;
    return effect;
  }
  double difference = 0.0;
  double variance = 0.0;
  double df_denominator = 0.0;
  std::vector<double> pooled_treatment;
  std::vector<double> pooled_baseline;
  for (auto& part : parts) {
    part.weight /= total;
    const auto& t = *part.effect->t_test;
    difference += part.weight * t.difference;
    const double share = part.weight * part.weight * t.standard_error * t.standard_error;
    variance += share;
    if (t.degrees_of_freedom > 0.0) df_denominator += share * share / t.degrees_of_freedom;
    effect.mean_treatment_ms += part.weight * part.effect->mean_treatment_ms;
    effect.mean_baseline_ms += part.weight * part.effect->mean_baseline_ms;
    effect.median_diff_ms += part.weight * part.effect->median_diff_ms;
    effect.p99_diff_ms += part.weight * part.effect->p99_diff_ms;
    effect.n += part.effect->n;
    effect.n_treatment += part.effect->n_treatment;
    effect.n_baseline += part.effect->n_baseline;
    effect.paired = effect.paired && part.effect->paired;
    const auto& arms = part.stratum->arms.at(treatment);
    pooled_treatment.insert(pooled_treatment.end(), arms.treatment.begin(), arms.treatment.end());
    pooled_baseline.insert(pooled_baseline.end(), arms.baseline.begin(), arms.baseline.end());
  }
  const double df = df_denominator > 0.0 ? variance * variance / df_denominator : 0.0;
  effect.t_test = t_test_from(difference, std::sqrt(variance), df);
  effect.pct_change = percent_change(difference, effect.mean_baseline_ms);
  // Within-pair differences stay symmetric about 0 under no effect in every stratum, so the
  // signed-rank test on all pairs together is a valid overall test.
  if (effect.paired) effect.wilcoxon = wilcoxon_signed_rank(pooled_treatment, pooled_baseline);
  if (bootstrap.resamples > 0) {
    std::mt19937_64 generator(bootstrap.seed);
    std::vector<double> mean_draws, median_draws, p99_draws;
    for (std::size_t round = 0; round < bootstrap.resamples; ++round) {
      DifferenceDraw combined;
      for (const auto& part : parts) {
        const auto& arms = part.stratum->arms.at(treatment);
        const auto draw = draw_difference(arms.treatment, arms.baseline, arms.paired, generator);
        combined.mean += part.weight * draw.mean;
        combined.median += part.weight * draw.median;
        combined.p99 += part.weight * draw.p99;
      }
      mean_draws.push_back(combined.mean);
      median_draws.push_back(combined.median);
      p99_draws.push_back(combined.p99);
    }
    effect.bootstrap = BootstrapResult{percentile_interval(mean_draws), percentile_interval(median_draws),
                                       percentile_interval(p99_draws), bootstrap.resamples};
  }
  return effect;
}

}  // namespace

std::string length_bucket_of(std::uint64_t tokens, const std::vector<std::uint64_t>& edges) {
  if (edges.empty()) return "all";
  if (tokens < edges.front()) return fmt::format("<{}", edges.front());
  for (std::size_t i = 1; i < edges.size(); ++i) {
    if (tokens < edges[i]) return fmt::format("{}-{}", edges[i - 1], edges[i] - 1);
  }
  return fmt::format(">={}", edges.back());
}

std::string model_pair_of(const Trial& trial) {
  if (trial.sender_model.empty() && trial.receiver_model.empty()) return "any";
  return fmt::format("{}->{}", trial.sender_model.empty() ? "?" : trial.sender_model,
                     trial.receiver_model.empty() ? "?" : trial.receiver_model);
}

Result<AuditReport> analyze(const TrialSet& trials, const AnalysisOptions& options) {
  if (!std::is_sorted(options.bucket_edges.begin(), options.bucket_edges.end()) ||
      std::adjacent_find(options.bucket_edges.begin(), options.bucket_edges.end()) != options.bucket_edges.end() ||
      (!options.bucket_edges.empty() && options.bucket_edges.front() == 0)) {
    return fail(ErrorCode::kInvalidArgument, "length bucket edges must be positive and strictly increasing");
  }
  AuditReport report;
  report.baseline = options.baseline;
  report.bucket_edges = options.bucket_edges;
  report.assignments_without_outcome = trials.assignments_without_outcome;
  report.failed_outcomes = trials.failed_outcomes;
  std::set<std::string> routes;
  std::set<std::string> treatments;
  // Strata in a stable order: by model pair, then by bucket position.
  std::map<std::pair<std::string, std::size_t>, StratumData> strata;
  std::map<std::string, std::map<std::string, std::vector<const Trial*>>> by_model_pair;
  for (const auto& trial : trials.trials) {
    if (!options.route.empty() && trial.route != options.route) continue;
    ++report.trials;
    routes.insert(trial.route);
    treatments.insert(trial.treatment);
    const std::string pair = model_pair_of(trial);
    std::string bucket = length_bucket_of(trial.context_tokens, options.bucket_edges);
    std::size_t bucket_index = static_cast<std::size_t>(
        std::upper_bound(options.bucket_edges.begin(), options.bucket_edges.end(), trial.context_tokens) -
        options.bucket_edges.begin());
    if (!trial.stratum.empty()) {
      bucket = trial.stratum;
      bucket_index = options.bucket_edges.size() + 1;
    }
    auto& stratum = strata[{pair + "\n" + bucket, bucket_index}];
    stratum.report.length_bucket = bucket;
    stratum.report.model_pair = pair;
    stratum.report.name = fmt::format("{} {}", bucket, pair);
    ++stratum.report.trials;
    stratum.by_treatment[trial.treatment].push_back(&trial);
    by_model_pair[pair][trial.treatment].push_back(&trial);
  }
  if (report.trials > 0 && !treatments.contains(options.baseline)) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("no trial has the baseline treatment '{}' (treatments seen: {})", options.baseline,
                            fmt::join(treatments, ", ")));
  }
  report.routes.assign(routes.begin(), routes.end());
  report.treatments.assign(treatments.begin(), treatments.end());

  std::vector<std::pair<std::pair<std::string, std::size_t>, StratumData*>> ordered;
  for (auto& [key, stratum] : strata)
    ordered.emplace_back(key, &stratum);
  std::sort(ordered.begin(), ordered.end(), [](const auto& a, const auto& b) {
    const auto pair_a = a.first.first.substr(0, a.first.first.find('\n'));
    const auto pair_b = b.first.first.substr(0, b.first.first.find('\n'));
    return std::tie(pair_a, a.first.second) < std::tie(pair_b, b.first.second);
  });
  std::vector<StratumData> computed;
  for (auto& [key, stratum] : ordered) {
    const auto baseline = stratum->by_treatment.find(options.baseline);
    for (const auto& [treatment, arm] : stratum->by_treatment) {
      if (treatment == options.baseline || baseline == stratum->by_treatment.end()) continue;
      auto arms = arms_of(arm, baseline->second);
      stratum->report.effects.push_back(effect_of(treatment, options.baseline, arms, options.bootstrap));
      stratum->arms.emplace(treatment, std::move(arms));
    }
    apply_holm(stratum->report.effects);
    computed.push_back(std::move(*stratum));
  }
  for (const auto& treatment : report.treatments) {
    if (treatment == options.baseline) continue;
    report.overall.push_back(overall_effect(treatment, options.baseline, computed, options.bootstrap));
  }
  apply_holm(report.overall);
  for (auto& stratum : computed)
    report.strata.push_back(std::move(stratum.report));

  for (const auto& [pair, arms] : by_model_pair) {
    const auto baseline = arms.find(options.baseline);
    if (baseline == arms.end()) continue;
    for (const auto& [treatment, arm] : arms) {
      if (treatment == options.baseline) continue;
      if (auto estimate = estimate_break_even(arm, baseline->second, options.bootstrap)) {
        estimate->model_pair = pair;
        estimate->treatment = treatment;
        estimate->baseline = options.baseline;
        report.break_even.push_back(std::move(*estimate));
      }
    }
  }
  return report;
}

}  // namespace kvrelay::audit
