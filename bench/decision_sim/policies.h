#pragma once

// The policies compared on one trace. Each returns every transfer's realised latency (the true
// cost of the medium it chose) and how often it switched medium on a route.

#include <cstdint>
#include <string>
#include <vector>

#include "trace.h"

namespace kvrelay::sim {

struct PolicyRun {
  std::string name;
  std::vector<double> latency_s;
  std::uint64_t switches = 0;
  std::vector<int> chosen;
};

[[nodiscard]] PolicyRun run_always(const Workload& w, const std::string& name, std::size_t medium);
[[nodiscard]] PolicyRun run_threshold(const Workload& w, std::uint64_t min_tokens);
[[nodiscard]] PolicyRun run_oracle(const Workload& w);
// kvrelay's engine: the real DecisionEngine, fed only noisy measurements.
[[nodiscard]] PolicyRun run_engine(const Workload& w);

}  // namespace kvrelay::sim
