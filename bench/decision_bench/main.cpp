// decision_bench: how much one decision-making event costs. Prints one JSON object.
//
//   decision_bench [--agents N] [--routes N] [--decisions N]
//     one DecisionEngine::decide() on one big engine (route_bench.h)
//   decision_bench --nodes 1,2,4,8 [--agents N] [--events N]
//     a decision, a scheduler grant and an eviction on one node while N nodes' state exists;
//     --agents is then per node (default 1000) (node_bench.h)

#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "node_bench.h"
#include "route_bench.h"

namespace {

constexpr const char* kBenchUsage =
    "usage: decision_bench [--agents N] [--routes N] [--decisions N]\n"
    "       decision_bench --nodes 1,2,4,8 [--agents N] [--events N]\n";

// "1,2,4,8" -> {1, 2, 4, 8}; empty on anything else.
std::vector<std::size_t> parse_node_counts(const std::string& text) {
  std::vector<std::size_t> counts;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const auto value = std::strtoull(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || value == 0) return {};
    counts.push_back(value);
  }
  return counts;
}

}  // namespace

int main(int argc, char** argv) {
  kvrelay::bench::RouteBenchOptions routes;
  kvrelay::bench::NodeBenchOptions nodes;
  bool node_mode = false;
  bool agents_given = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string text = argv[i + 1];
    const auto value = std::strtoull(text.c_str(), nullptr, 10);
    if (flag == "--nodes") {
      node_mode = true;
      nodes.nodes = parse_node_counts(text);
      if (nodes.nodes.empty()) {
        std::cerr << kBenchUsage;
        return 2;
      }
    } else if (flag == "--agents") {
      routes.agents = value;
      nodes.agents_per_node = value;
      agents_given = true;
    } else if (flag == "--routes") {
      routes.routes = value;
    } else if (flag == "--decisions") {
      routes.decisions = value;
    } else if (flag == "--events") {
      nodes.events = value;
    } else {
      std::cerr << kBenchUsage;
      return 2;
    }
  }
  if (argc % 2 == 0 || (agents_given && routes.agents == 0) || nodes.events == 0) {
    std::cerr << kBenchUsage;
    return 2;
  }
  const auto out = node_mode ? kvrelay::bench::run_node_bench(nodes) : kvrelay::bench::run_route_bench(routes);
  std::cout << out.dump(2) << '\n';
  return 0;
}
