#pragma once

// The spread of per-run figures the benchmarks report (paired ratios, per-run rates): a run of a
// sub-millisecond operation on a shared host is one noisy sample, so they give quartiles over
// many runs rather than one best.

#include <nlohmann/json.hpp>

#include <span>

#include "kvrelay/audit/statistics.h"

namespace kvrelay::bench {

// {"runs", "p25", "median", "p75"}; only {"runs": 0} when there are none.
inline nlohmann::json spread_json(std::span<const double> values) {
  if (values.empty()) return {{"runs", 0}};
  return {{"runs", values.size()},
          {"p25", audit::quantile(values, 0.25)},
          {"median", audit::median(values)},
          {"p75", audit::quantile(values, 0.75)}};
}

}  // namespace kvrelay::bench
