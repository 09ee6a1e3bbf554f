#pragma once

// Effects of each treatment against the baseline (T0), per stratum (length bucket x model pair)
// and overall (strata weighted by their size), paired where trials share a pair_id.

#include <cstdint>
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

struct AuditReport {
  std::string baseline;
  std::vector<std::string> routes;
  std::vector<std::string> treatments;
  std::vector<std::uint64_t> bucket_edges;
  std::size_t trials = 0;
  std::size_t assignments_without_outcome = 0;
  std::size_t failed_outcomes = 0;
  std::vector<StratumReport> strata;
  std::vector<Effect> overall;
  std::vector<BreakEven> break_even;
};

[[nodiscard]] std::string length_bucket_of(std::uint64_t tokens, const std::vector<std::uint64_t>& edges);
[[nodiscard]] std::string model_pair_of(const Trial& trial);

// Fails only on options that make no sense (unsorted edges) or when the baseline never occurs.
[[nodiscard]] Result<AuditReport> analyze(const TrialSet& trials, const AnalysisOptions& options);

}  // namespace kvrelay::audit
