#pragma once

// Order statistics shared by the scheduler and store comparisons.

#include <algorithm>
#include <cstddef>
#include <vector>

namespace kvrelay::sim {

// The nearest-rank quantile q in [0, 1] of `values`; 0 when there are none.
[[nodiscard]] inline double sim_quantile(std::vector<double> values, double q) {
  if (values.empty()) return 0.0;
  const auto index = static_cast<std::size_t>(q * static_cast<double>(values.size() - 1));
  std::nth_element(values.begin(), values.begin() + static_cast<std::ptrdiff_t>(index), values.end());
  return values[index];
}

}  // namespace kvrelay::sim
