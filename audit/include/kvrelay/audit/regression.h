#pragma once

// Ordinary least squares for the audit's latency-versus-length fits.

#include <optional>
#include <span>

namespace kvrelay::audit {

struct LineFit {
  double intercept = 0.0;
  double slope = 0.0;
  [[nodiscard]] double at(double x) const noexcept { return intercept + slope * x; }
};

// y = intercept + slope x; nullopt with fewer than two distinct x.
[[nodiscard]] std::optional<LineFit> fit_line(std::span<const double> x, std::span<const double> y);

struct QuadraticFit {
  double a = 0.0;
  double b = 0.0;
  double c = 0.0;
  [[nodiscard]] double at(double x) const noexcept { return a + b * x + c * x * x; }
};

// y = a + b x + c x^2 with every coefficient >= 0 (the cost model's prefill form): the full fit
// when feasible, else the best feasible fit on a subset of the terms. nullopt without data.
[[nodiscard]] std::optional<QuadraticFit> fit_non_negative_quadratic(std::span<const double> x,
                                                                     std::span<const double> y);

}  // namespace kvrelay::audit
