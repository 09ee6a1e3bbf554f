#include <nlohmann/json.hpp>

#include <cmath>

#include "kvrelay/audit/render.h"

namespace kvrelay::audit {

using nlohmann::json;

namespace {

json number(double value) {
  return std::isfinite(value) ? json(value) : json();
}

json interval_json(const Interval& value) {
  return json::array({number(value.low), number(value.high)});
}

json break_even_to_json(const BreakEven& estimate) {
  return {{"model_pair", estimate.model_pair},
          {"treatment", estimate.treatment},
          {"baseline", estimate.baseline},
          {"kind", crossing_kind_name(estimate.kind)},
          {"break_even_tokens", estimate.break_even_tokens ? number(*estimate.break_even_tokens) : json()},
          {"ci95", estimate.ci95 ? interval_json(*estimate.ci95) : json()},
          {"bootstrap_agreement", estimate.bootstrap_agreement},
          {"fit_ms",
           {{"treatment",
             {{"intercept", number(estimate.treatment_fit.intercept)},
              {"per_token", number(estimate.treatment_fit.slope)}}},
            {"baseline",
             {{"intercept", number(estimate.baseline_fit.intercept)},
              {"per_token", number(estimate.baseline_fit.slope)}}}}},
          {"n_treatment", estimate.n_treatment},
          {"n_baseline", estimate.n_baseline}};
}

json strata_to_json(const std::vector<StratumReport>& strata);

json delivery_to_json(const DeliverySummary& delivery) {
  json by_assigned = json::object();
  for (const auto& [assigned, counts] : delivery.by_assigned) {
    by_assigned[assigned] = {{"assigned", counts.assigned},
                             {"delivered_as_assigned", counts.delivered_as_assigned},
                             {"delivered", counts.delivered},
                             {"reasons", counts.reasons}};
  }
  return {{"differing", delivery.differing}, {"by_assigned", std::move(by_assigned)}};
}

json selection_to_json(const SelectionCheck& check) {
  const auto& t = check.test;
  return {{"treatment", check.treatment},
          {"delivered", check.delivered},
          {"n_selected", check.n_selected},
          {"n_reference", check.n_reference},
          {"mean_diff_ms", t ? number(t->difference) : json()},
          {"ci95", t ? interval_json(t->ci95) : json()},
          {"selection_p_value", t ? number(t->p_value) : json()},
          {"selection_p_holm", check.p_holm ? number(*check.p_holm) : json()},
          {"biased", check.biased}};
}

json as_treated_to_json(const AsTreated& as_treated) {
  json selection = json::array();
  for (const auto& check : as_treated.selection)
    selection.push_back(selection_to_json(check));
  json out{{"same_as_intent_to_treat", as_treated.same_as_intent_to_treat},
           {"biased", as_treated.biased},
           {"selection", std::move(selection)},
           {"note", as_treated.note}};
  if (!as_treated.same_as_intent_to_treat) {
    json overall = json::array();
    for (const auto& effect : as_treated.overall)
      overall.push_back(effect_to_json(effect));
    out["strata"] = strata_to_json(as_treated.strata);
    out["overall"] = std::move(overall);
  }
  return out;
}

json strata_to_json(const std::vector<StratumReport>& strata) {
  json out = json::array();
  for (const auto& stratum : strata) {
    json effects = json::array();
    for (const auto& effect : stratum.effects) {
      json entry = effect_to_json(effect);
      entry["stratum"] = stratum.name;
      effects.push_back(std::move(entry));
    }
    out.push_back({{"stratum", stratum.name},
                   {"length_bucket", stratum.length_bucket},
                   {"model_pair", stratum.model_pair},
                   {"trials", stratum.trials},
                   {"effects", std::move(effects)}});
  }
  return out;
}

}  // namespace

json effect_to_json(const Effect& effect) {
  const auto& t = effect.t_test;
  json out{{"treatment", effect.treatment},
           {"baseline", effect.baseline},
           {"n", effect.n},
           {"mean_diff_ms", t ? number(t->difference) : json()},
           {"ci95", t ? interval_json(t->ci95) : json()},
           {"pct_change", number(effect.pct_change)},
           {"p_value", t ? number(t->p_value) : json()},
           {"p_holm", effect.p_holm ? number(*effect.p_holm) : json()},
           {"paired", effect.paired},
           {"test", effect.paired ? "paired_t" : "welch_t"},
           {"t", t ? number(t->t) : json()},
           {"df", t ? number(t->degrees_of_freedom) : json()},
           {"n_treatment", effect.n_treatment},
           {"n_baseline", effect.n_baseline},
           {"mean_treatment_ms", number(effect.mean_treatment_ms)},
           {"mean_baseline_ms", number(effect.mean_baseline_ms)},
           {"median_diff_ms", number(effect.median_diff_ms)},
           {"p99_diff_ms", number(effect.p99_diff_ms)},
           {"ci95_bootstrap", effect.bootstrap ? interval_json(effect.bootstrap->mean_difference) : json()},
           {"ci95_median_bootstrap", effect.bootstrap ? interval_json(effect.bootstrap->median_difference) : json()},
           {"ci95_p99_bootstrap", effect.bootstrap ? interval_json(effect.bootstrap->p99_difference) : json()},
           {"bootstrap_resamples", effect.bootstrap ? effect.bootstrap->resamples : 0},
           {"p_wilcoxon", effect.wilcoxon ? number(effect.wilcoxon->p_value) : json()}};
  if (effect.wilcoxon) {
    out["wilcoxon_statistic"] = effect.wilcoxon->statistic;
    out["wilcoxon_exact"] = effect.wilcoxon->exact;
  }
  return out;
}

json report_to_json(const AuditReport& report) {
  json strata = strata_to_json(report.strata);
  json overall = json::array();
  for (const auto& effect : report.overall)
    overall.push_back(effect_to_json(effect));
  json break_even = json::array();
  for (const auto& estimate : report.break_even)
    break_even.push_back(break_even_to_json(estimate));
  return {{"baseline", report.baseline},
          {"routes", report.routes},
          {"treatments", report.treatments},
          {"length_bucket_edges", report.bucket_edges},
          {"trials", report.trials},
          {"assignments_without_outcome", report.assignments_without_outcome},
          {"failed_outcomes", report.failed_outcomes},
          {"strata", std::move(strata)},
          {"overall", std::move(overall)},
          {"break_even", std::move(break_even)},
          {"delivery", delivery_to_json(report.delivery)},
          {"as_treated", as_treated_to_json(report.as_treated)}};
}

}  // namespace kvrelay::audit
