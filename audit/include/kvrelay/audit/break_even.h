#pragma once

// Break-even length: per model pair, latency is fitted against context length for each
// treatment (least squares, a line) and the length where a treatment's line crosses the
// baseline's is reported, with a bootstrap CI over trials.

#include <optional>
#include <string>
#include <vector>

#include "kvrelay/audit/regression.h"
#include "kvrelay/audit/statistics.h"
#include "kvrelay/audit/trials.h"

namespace kvrelay::audit {

enum class CrossingKind {
  kFasterAbove,   // the treatment wins from break_even_tokens on (KV transfer pays for long contexts)
  kFasterBelow,   // the treatment wins below break_even_tokens
  kAlwaysFaster,  // its line is below the baseline's at every length >= 0
  kNeverFaster,   // its line is above the baseline's at every length >= 0
};
[[nodiscard]] std::string_view crossing_kind_name(CrossingKind kind) noexcept;

struct BreakEven {
  std::string model_pair;
  std::string treatment;
  std::string baseline;
  LineFit treatment_fit;  // ttft_ms against context tokens
  LineFit baseline_fit;
  CrossingKind kind = CrossingKind::kNeverFaster;
  std::optional<double> break_even_tokens;  // where the lines cross (kFasterAbove/kFasterBelow)
  std::optional<Interval> ci95;             // percentile bootstrap over trials
  double bootstrap_agreement = 0.0;         // share of resamples with the same kind of crossing
  std::size_t n_treatment = 0;
  std::size_t n_baseline = 0;
};

// Trials of one model pair; nullopt when either arm has fewer than 3 trials or one length.
[[nodiscard]] std::optional<BreakEven> estimate_break_even(const std::vector<const Trial*>& treatment,
                                                           const std::vector<const Trial*>& baseline,
                                                           const BootstrapOptions& bootstrap);

}  // namespace kvrelay::audit
