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

// One stratum's trials (both readings share the strata; only the grouping differs).
struct StratumData {
  StratumReport report;  // name, bucket, model pair, trials; effects filled per reading
  std::vector<const Trial*> trials;
};

// One stratum's contribution to a combined (overall) effect.
struct Part {
  const Arms* arms;
  const Effect* effect;
  double weight;
};

// Stratum effects combined with the parts' weights (post-stratification): the standard error
// combined with the same weights and Welch-Satterthwaite degrees of freedom; the bootstrap
// resamples within each stratum and combines with the weights.
Effect combine_effects(const std::string& treatment, const std::string& baseline, std::vector<Part> parts,
                       const BootstrapOptions& bootstrap) {
  Effect effect;
  effect.treatment = treatment;
  effect.baseline = baseline;
  double total = 0.0;
  for (const auto& part : parts)
    total += part.weight;
  if (parts.empty() || !(total > 0.0)) return effect;
  effect.paired = true;
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
    pooled_treatment.insert(pooled_treatment.end(), part.arms->treatment.begin(), part.arms->treatment.end());
    pooled_baseline.insert(pooled_baseline.end(), part.arms->baseline.begin(), part.arms->baseline.end());
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
        const auto draw = draw_difference(part.arms->treatment, part.arms->baseline, part.arms->paired, generator);
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

using Grouping = const std::string& (*)(const Trial&);

const std::string& assigned_treatment_of(const Trial& trial) noexcept {
  return trial.treatment;
}

struct EffectSet {
  std::vector<StratumReport> strata;
  std::vector<Effect> overall;
};

// Effects per stratum and overall with trials grouped by `group` (assigned: intent-to-treat;
// delivered: as-treated). Overall weights are the strata's sizes.
EffectSet effects_by(const std::vector<StratumData>& strata, Grouping group, const std::string& baseline,
                     const BootstrapOptions& bootstrap) {
  EffectSet out;
  std::set<std::string> treatments;
  std::vector<std::map<std::string, Arms>> arms(strata.size());
  for (std::size_t i = 0; i < strata.size(); ++i) {
    std::map<std::string, std::vector<const Trial*>> by_treatment;
    for (const Trial* trial : strata[i].trials) {
      by_treatment[group(*trial)].push_back(trial);
      treatments.insert(group(*trial));
    }
    StratumReport report = strata[i].report;
    report.effects.clear();
    const auto reference = by_treatment.find(baseline);
    for (const auto& [treatment, arm] : by_treatment) {
      if (treatment == baseline || reference == by_treatment.end()) continue;
      auto compared = arms_of(arm, reference->second);
      report.effects.push_back(effect_of(treatment, baseline, compared, bootstrap));
      arms[i].emplace(treatment, std::move(compared));
    }
    apply_holm(report.effects);
    out.strata.push_back(std::move(report));
  }
  for (const auto& treatment : treatments) {
    if (treatment == baseline) continue;
    std::vector<Part> parts;
    for (std::size_t i = 0; i < strata.size(); ++i) {
      for (const auto& candidate : out.strata[i].effects) {
        if (candidate.treatment != treatment || !candidate.t_test) continue;
        parts.push_back({&arms[i].at(treatment), &candidate, static_cast<double>(out.strata[i].trials)});
      }
    }
    out.overall.push_back(combine_effects(treatment, baseline, std::move(parts), bootstrap));
  }
  apply_holm(out.overall);
  return out;
}

DeliverySummary delivery_of(const std::vector<StratumData>& strata) {
  DeliverySummary summary;
  for (const auto& stratum : strata) {
    for (const Trial* trial : stratum.trials) {
      auto& counts = summary.by_assigned[trial->treatment];
      ++counts.assigned;
      ++counts.delivered[delivered_treatment_of(*trial)];
      if (delivered_as_assigned(*trial)) {
        ++counts.delivered_as_assigned;
      } else {
        ++summary.differing;
        ++counts.reasons[trial->delivery_reason.empty() ? std::string("unspecified") : trial->delivery_reason];
      }
    }
  }
  return summary;
}

// Trials assigned X but delivered Y against trials assigned and delivered Y, per stratum (the
// paired t-test where the pairs hold, else Student's pooled t-test), combined with weights by the
// selected trials per stratum.
SelectionCheck selection_check(const std::vector<StratumData>& strata, const std::string& assigned,
                               const std::string& delivered) {
  SelectionCheck check;
  check.treatment = assigned;
  check.delivered = delivered;
  std::vector<std::pair<Arms, Effect>> computed;
  computed.reserve(strata.size());
  const BootstrapOptions no_bootstrap{0, 1};
  for (const auto& stratum : strata) {
    std::vector<const Trial*> selected;
    std::vector<const Trial*> reference;
    for (const Trial* trial : stratum.trials) {
      if (delivered_treatment_of(*trial) != delivered) continue;
      if (trial->treatment == assigned) selected.push_back(trial);
      if (trial->treatment == delivered) reference.push_back(trial);
    }
    check.n_selected += selected.size();
    check.n_reference += reference.size();
    if (selected.empty() || reference.empty()) continue;
    auto arms = arms_of(selected, reference);
    auto effect = effect_of(assigned, delivered, arms, no_bootstrap);
    // Under the hypothesis checked the two groups are one population, so they share a variance:
    // the pooled test is exact there, where Welch's, estimating the selected group's variance
    // from a handful of trials, rejects too often at the small levels Holm asks of it.
    if (!arms.paired) effect.t_test = student_t_test(arms.treatment, arms.baseline);
    if (!effect.t_test || !std::isfinite(effect.t_test->p_value)) continue;
    computed.emplace_back(std::move(arms), std::move(effect));
  }
  std::vector<Part> parts;
  for (const auto& [arms, effect] : computed) {
    parts.push_back({&arms, &effect, static_cast<double>(effect.n_treatment)});
  }
  if (!parts.empty()) check.test = combine_effects(assigned, delivered, std::move(parts), no_bootstrap).t_test;
  if (check.test && !std::isfinite(check.test->p_value)) check.test.reset();  // e.g. constant outcomes
  return check;
}

std::string p_text(double value) {
  return value < 1e-4 ? fmt::format("{:.1e}", value) : fmt::format("{:.4f}", value);
}

AsTreated as_treated_of(const std::vector<StratumData>& strata, const DeliverySummary& delivery, std::size_t trials,
                        const std::string& baseline, const BootstrapOptions& bootstrap) {
  AsTreated out;
  out.same_as_intent_to_treat = delivery.differing == 0;
  if (out.same_as_intent_to_treat) {
    out.note = "Every trial was delivered as assigned: the as-treated effects are the intent-to-treat effects.";
    return out;
  }
  auto effects = effects_by(strata, &delivered_treatment_of, baseline, bootstrap);
  out.strata = std::move(effects.strata);
  out.overall = std::move(effects.overall);
  for (const auto& [assigned, counts] : delivery.by_assigned) {
    for (const auto& [delivered, count] : counts.delivered) {
      if (delivered != assigned) out.selection.push_back(selection_check(strata, assigned, delivered));
    }
  }
  std::vector<double> p_values;
  std::vector<SelectionCheck*> tested;
  for (auto& check : out.selection) {
    if (!check.test) continue;
    p_values.push_back(check.test->p_value);
    tested.push_back(&check);
  }
  const auto adjusted = holm_adjust(p_values);
  std::vector<std::string> flagged;
  for (std::size_t i = 0; i < tested.size(); ++i) {
    tested[i]->p_holm = adjusted[i];
    tested[i]->biased = adjusted[i] < 0.05;
    if (!tested[i]->biased) continue;
    out.biased = true;
    flagged.push_back(fmt::format("assigned {} but delivered {}: p = {}, Holm {}", tested[i]->treatment,
                                  tested[i]->delivered, p_text(tested[i]->test->p_value), p_text(adjusted[i])));
  }
  const auto share = fmt::format("{} of {} trials were delivered other than assigned", delivery.differing, trials);
  if (out.biased) {
    out.note = fmt::format(
        "{}, and their outcomes differ from those of the trials assigned what they got ({}): non-delivery "
        "depends on the outcome, so the as-treated estimate is likely biased; read the intent-to-treat effects.",
        share, fmt::join(flagged, "; "));
  } else if (tested.empty()) {
    out.note = fmt::format(
        "{}, too few to check whether non-delivery depends on the outcome: the as-treated estimate is unchecked; "
        "read the intent-to-treat effects first.",
        share);
  } else {
    out.note = fmt::format(
        "{}; their outcomes do not differ detectably from those of the trials assigned what they got, so there is "
        "no evidence that the as-treated estimate is biased. Intent-to-treat remains the randomized comparison.",
        share);
  }
  return out;
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
    stratum.trials.push_back(&trial);
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
  std::vector<StratumData> sorted;
  for (auto& [key, stratum] : ordered)
    sorted.push_back(std::move(*stratum));

  // Intent-to-treat: by the randomized assignment.
  auto intent_to_treat = effects_by(sorted, &assigned_treatment_of, options.baseline, options.bootstrap);
  report.strata = std::move(intent_to_treat.strata);
  report.overall = std::move(intent_to_treat.overall);
  report.delivery = delivery_of(sorted);
  report.as_treated = as_treated_of(sorted, report.delivery, report.trials, options.baseline, options.bootstrap);

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
