#pragma once

// Per-event cost against the number of nodes. Each node decides on its own state only: its
// decision engine (per-node routes), its links' schedulers and its store's utility ledger. The
// bench builds that state for N nodes and times events on one node's structures while the
// others exist: a decision, a scheduler grant, and a put that evicts (the ledger's victim choice).
// Flat medians across N are the point: no event reads another node's state.

#include <nlohmann/json.hpp>

#include <cstddef>
#include <vector>

namespace kvrelay::bench {

struct NodeBenchOptions {
  std::vector<std::size_t> nodes{1, 2, 4, 8};
  std::size_t agents_per_node = 1000;
  std::size_t routes_per_agent = 4;
  std::size_t links_per_node = 7;  // the peers of a node in an 8-node cluster
  std::size_t transfers_per_link = 8;
  std::size_t ledger_entries = 100'000;
  std::size_t events = 200'000;  // timed, per kind and node count
};

[[nodiscard]] nlohmann::json run_node_bench(const NodeBenchOptions& options);

}  // namespace kvrelay::bench
