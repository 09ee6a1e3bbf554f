#pragma once

// The cost of one DecisionEngine::decide() on one big engine (10,000 agents, 100,000 routes by
// default), with the physical floor measured in the same run: one dependent random cache-line
// read over a working set the size of the engine's route table.

#include <nlohmann/json.hpp>

#include <cstddef>

namespace kvrelay::bench {

struct RouteBenchOptions {
  std::size_t agents = 10'000;
  std::size_t routes = 100'000;
  std::size_t decisions = 2'000'000;
};

[[nodiscard]] nlohmann::json run_route_bench(const RouteBenchOptions& options);

}  // namespace kvrelay::bench
