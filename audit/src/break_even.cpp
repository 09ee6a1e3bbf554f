#include "kvrelay/audit/break_even.h"

#include <random>

namespace kvrelay::audit {

namespace {

constexpr std::size_t kMinTrialsPerArm = 3;

struct Crossing {
  CrossingKind kind = CrossingKind::kNeverFaster;
  std::optional<double> tokens;
};

Crossing crossing_of(const LineFit& treatment, const LineFit& baseline) {
  const double intercept_gap = treatment.intercept - baseline.intercept;  // < 0: treatment faster at 0
  const double slope_gap = baseline.slope - treatment.slope;              // > 0: treatment grows slower
  if (slope_gap == 0.0) return {intercept_gap < 0.0 ? CrossingKind::kAlwaysFaster : CrossingKind::kNeverFaster, {}};
  const double tokens = intercept_gap / slope_gap;
  if (tokens <= 0.0) {
    return {slope_gap > 0.0 ? CrossingKind::kAlwaysFaster : CrossingKind::kNeverFaster, {}};
  }
  return {slope_gap > 0.0 ? CrossingKind::kFasterAbove : CrossingKind::kFasterBelow, tokens};
}

std::optional<LineFit> fit_arm(const std::vector<const Trial*>& arm) {
  std::vector<double> x;
  std::vector<double> y;
  for (const Trial* trial : arm) {
    x.push_back(static_cast<double>(trial->context_tokens));
    y.push_back(trial->ttft_ms);
  }
  return fit_line(x, y);
}

std::vector<const Trial*> resample(const std::vector<const Trial*>& arm, std::mt19937_64& generator) {
  std::uniform_int_distribution<std::size_t> pick(0, arm.size() - 1);
  std::vector<const Trial*> drawn(arm.size());
  for (auto& trial : drawn)
    trial = arm[pick(generator)];
  return drawn;
}

}  // namespace

std::string_view crossing_kind_name(CrossingKind kind) noexcept {
  switch (kind) {
    case CrossingKind::kFasterAbove:
      return "faster_above";
    case CrossingKind::kFasterBelow:
      return "faster_below";
    case CrossingKind::kAlwaysFaster:
      return "always_faster";
    case CrossingKind::kNeverFaster:
      return "never_faster";
  }
  return "never_faster";
}

std::optional<BreakEven> estimate_break_even(const std::vector<const Trial*>& treatment,
                                             const std::vector<const Trial*>& baseline,
                                             const BootstrapOptions& bootstrap) {
  if (treatment.size() < kMinTrialsPerArm || baseline.size() < kMinTrialsPerArm) return std::nullopt;
  const auto treatment_fit = fit_arm(treatment);
  const auto baseline_fit = fit_arm(baseline);
  if (!treatment_fit || !baseline_fit) return std::nullopt;
  BreakEven result;
  result.treatment_fit = *treatment_fit;
  result.baseline_fit = *baseline_fit;
  result.n_treatment = treatment.size();
  result.n_baseline = baseline.size();
  const auto crossing = crossing_of(*treatment_fit, *baseline_fit);
  result.kind = crossing.kind;
  result.break_even_tokens = crossing.tokens;
  if (bootstrap.resamples == 0) return result;
  std::mt19937_64 generator(bootstrap.seed);
  std::vector<double> draws;
  std::size_t same_kind = 0;
  for (std::size_t round = 0; round < bootstrap.resamples; ++round) {
    const auto t = fit_arm(resample(treatment, generator));
    const auto b = fit_arm(resample(baseline, generator));
    if (!t || !b) continue;
    const auto drawn = crossing_of(*t, *b);
    if (drawn.kind != crossing.kind) continue;
    ++same_kind;
    if (drawn.tokens) draws.push_back(*drawn.tokens);
  }
  result.bootstrap_agreement = static_cast<double>(same_kind) / static_cast<double>(bootstrap.resamples);
  // A CI only when most resamples agree on the kind of crossing; otherwise the data do not
  // locate a break-even and an interval over the agreeing minority would mislead.
  if (crossing.tokens && result.bootstrap_agreement >= 0.5 && !draws.empty()) {
    result.ci95 = percentile_interval(draws);
  }
  return result;
}

}  // namespace kvrelay::audit
