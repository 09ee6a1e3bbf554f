#include "kvrelay/audit/regression.h"

#include <array>
#include <cmath>
#include <limits>

namespace kvrelay::audit {

namespace {

// Solves the normal equations for the terms selected by `mask` (bit 0: 1, bit 1: x, bit 2: x^2)
// by Gaussian elimination with partial pivoting; x is scaled for conditioning.
std::optional<std::array<double, 3>> solve_subset(std::span<const double> x, std::span<const double> y, unsigned mask,
                                                  double scale) {
  std::array<unsigned, 3> terms{};
  std::size_t count = 0;
  for (unsigned term = 0; term < 3; ++term) {
    if ((mask & (1U << term)) != 0) terms[count++] = term;
  }
  std::array<std::array<double, 4>, 3> system{};
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double u = x[i] / scale;
    const std::array<double, 3> features{1.0, u, u * u};
    for (std::size_t r = 0; r < count; ++r) {
      for (std::size_t c = 0; c < count; ++c)
        system[r][c] += features[terms[r]] * features[terms[c]];
      system[r][3] += features[terms[r]] * y[i];
    }
  }
  for (std::size_t r = 0; r < count; ++r)
    system[r][count] = system[r][3];
  for (std::size_t column = 0; column < count; ++column) {
    std::size_t pivot = column;
    for (std::size_t r = column + 1; r < count; ++r) {
      if (std::fabs(system[r][column]) > std::fabs(system[pivot][column])) pivot = r;
    }
    if (std::fabs(system[pivot][column]) < 1e-12) return std::nullopt;
    std::swap(system[pivot], system[column]);
    for (std::size_t r = 0; r < count; ++r) {
      if (r == column) continue;
      const double factor = system[r][column] / system[column][column];
      for (std::size_t c = column; c <= count; ++c)
        system[r][c] -= factor * system[column][c];
    }
  }
  std::array<double, 3> coefficients{};
  for (std::size_t r = 0; r < count; ++r) {
    const double scaled = system[r][count] / system[r][r];
    coefficients[terms[r]] = scaled / std::pow(scale, static_cast<double>(terms[r]));
  }
  return coefficients;
}

}  // namespace

std::optional<LineFit> fit_line(std::span<const double> x, std::span<const double> y) {
  if (x.size() != y.size() || x.size() < 2) return std::nullopt;
  double mean_x = 0.0;
  double mean_y = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    mean_x += x[i];
    mean_y += y[i];
  }
  mean_x /= static_cast<double>(x.size());
  mean_y /= static_cast<double>(x.size());
  double sxx = 0.0;
  double sxy = 0.0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sxx += (x[i] - mean_x) * (x[i] - mean_x);
    sxy += (x[i] - mean_x) * (y[i] - mean_y);
  }
  if (!(sxx > 0.0)) return std::nullopt;
  const double slope = sxy / sxx;
  return LineFit{mean_y - slope * mean_x, slope};
}

std::optional<QuadraticFit> fit_non_negative_quadratic(std::span<const double> x, std::span<const double> y) {
  if (x.size() != y.size() || x.empty()) return std::nullopt;
  double scale = 0.0;
  for (const double value : x)
    scale = std::max(scale, std::fabs(value));
  if (!(scale > 0.0)) scale = 1.0;
  std::optional<QuadraticFit> best;
  double best_error = std::numeric_limits<double>::infinity();
  for (unsigned mask = 1; mask < 8; ++mask) {
    const auto solved = solve_subset(x, y, mask, scale);
    if (!solved || (*solved)[0] < 0.0 || (*solved)[1] < 0.0 || (*solved)[2] < 0.0) continue;
    const QuadraticFit fit{(*solved)[0], (*solved)[1], (*solved)[2]};
    double error = 0.0;
    for (std::size_t i = 0; i < x.size(); ++i)
      error += (fit.at(x[i]) - y[i]) * (fit.at(x[i]) - y[i]);
    if (error < best_error) {
      best_error = error;
      best = fit;
    }
  }
  return best;
}

}  // namespace kvrelay::audit
