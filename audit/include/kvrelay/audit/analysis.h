#pragma once

// Effects of each treatment against the baseline (T0), per stratum (length bucket x model pair)
// and overall (strata weighted by their size), paired where trials share a pair_id.
//
// Two readings of one audit: intent-to-treat (trials grouped by the treatment they were
// randomly assigned; the primary estimate, unbiased for the effect of *assigning* a treatment
// whatever was delivered) and as-treated (grouped by the treatment they were delivered; the
// effect of the treatment itself, but only unbiased when non-delivery is independent of the
// outcome). A selection check compares trials assigned X but delivered Y with trials assigned
// and delivered Y: under randomization and outcome-independent non-delivery they are samples of
// one population, so a difference flags the as-treated estimate as likely biased.

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kvrelay/audit/break_even.h"
#include "kvrelay/audit/statistics.h"
#include "kvrelay/audit/trials.h"

namespace kvrelay::audit {

struct AnalysisOptions {
  // Upper-exclusive bucket edges in tokens: {256, 1024} gives <256, 256-1023, >=1024.
  std::vector<std::uint64_t> bucket_edges{256, 1024};
  std::string baseline = "T0";
  std::string route;           // only this route's trials; "" for all
  BootstrapOptions bootstrap;  // resamples = 0 leaves the bootstrap fields out
};

struct Effect {
  std::string treatment;
  std::string baseline;
  bool paired = false;
  std::size_t n = 0;  // pairs when paired, else trials in both arms
  std::size_t n_treatment = 0;
  std::size_t n_baseline = 0;
  double mean_treatment_ms = 0.0;
  double mean_baseline_ms = 0.0;
  std::optional<TTestResult> t_test;  // paired t or Welch; nullopt with too few trials
  double pct_change = 0.0;
  std::optional<double> p_holm;
  double median_diff_ms = 0.0;
  double p99_diff_ms = 0.0;
  std::optional<BootstrapResult> bootstrap;
  std::optional<WilcoxonResult> wilcoxon;  // paired designs only
};

struct StratumReport {
  std::string name;  // "256-1023 stories->stories"
  std::string length_bucket;
  std::string model_pair;
  std::size_t trials = 0;
  std::vector<Effect> effects;
};

// How the trials assigned one treatment were delivered.
struct DeliveryCounts {
  std::size_t assigned = 0;
  std::size_t delivered_as_assigned = 0;
  std::map<std::string, std::size_t> delivered;  // delivered treatment -> trials (sums to assigned)
  std::map<std::string, std::size_t> reasons;    // reason of the differing ones ("unspecified" if none)
};

struct DeliverySummary {
  std::size_t differing = 0;  // trials delivered other than assigned
  std::map<std::string, DeliveryCounts> by_assigned;
};

// Trials assigned `treatment` but delivered `delivered` against trials assigned and delivered
// `delivered` (selected minus reference), stratified like the effects and combined with weights
// by the selected trials per stratum.
struct SelectionCheck {
  std::string treatment;  // assigned
  std::string delivered;
  std::size_t n_selected = 0;       // assigned treatment, delivered `delivered`
  std::size_t n_reference = 0;      // assigned and delivered `delivered`
  std::optional<TTestResult> test;  // nullopt: too few trials in every stratum
  std::optional<double> p_holm;     // Holm across the report's selection checks
  bool biased = false;              // p_holm < 0.05
};

struct AsTreated {
  // True when every trial was delivered as assigned: the as-treated effects are then the
  // intent-to-treat ones and strata/overall stay empty (the report does not repeat them).
  bool same_as_intent_to_treat = true;
  std::vector<StratumReport> strata;
  std::vector<Effect> overall;
  std::vector<SelectionCheck> selection;
  bool biased = false;  // some selection check has p_holm < 0.05
  std::string note;     // one sentence for people: which estimate to read and why
};

struct AuditReport {
  std::string baseline;
  std::vector<std::string> routes;
  std::vector<std::string> treatments;
  std::vector<std::uint64_t> bucket_edges;
  std::size_t trials = 0;
  std::size_t assignments_without_outcome = 0;
  std::size_t failed_outcomes = 0;
  // Intent-to-treat: by assigned treatment.
  std::vector<StratumReport> strata;
  std::vector<Effect> overall;
  std::vector<BreakEven> break_even;  // by assigned treatment
  DeliverySummary delivery;
  AsTreated as_treated;
};

[[nodiscard]] std::string length_bucket_of(std::uint64_t tokens, const std::vector<std::uint64_t>& edges);
[[nodiscard]] std::string model_pair_of(const Trial& trial);

// Fails only on options that make no sense (unsorted edges) or when the baseline never occurs.
[[nodiscard]] Result<AuditReport> analyze(const TrialSet& trials, const AnalysisOptions& options);

}  // namespace kvrelay::audit
