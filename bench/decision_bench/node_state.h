#pragma once

// One node's decision state, as the daemon keeps it: a decision engine that knows every agent
// of the cluster's policy and decides on the routes that start at this node's agents, a
// scheduler per peer link with transfers queued, and the store's utility ledger under a full
// budget. Built from a seed per node, so node 0 is the same whatever the cluster size.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "kvrelay/decision/decision_engine.h"
#include "kvrelay/decision/kv_store_policy.h"
#include "kvrelay/decision/link_scheduler.h"

#include "node_bench.h"

namespace kvrelay::bench {

struct NodeState {
  std::size_t index = 0;
  decision::DecisionEngine engine;
  std::vector<decision::RouteId> routes;  // those that start at this node's agents
  std::vector<std::unique_ptr<decision::LinkScheduler>> links;
  std::uint64_t next_transfer = 0;
  decision::UtilityLedger ledger{60.0};
  std::uint64_t ledger_budget = 0;  // the bytes filed at build time: every later put must evict
  std::uint64_t ledger_used = 0;
  std::uint64_t next_key = 0;
  double ledger_now_s = 0.0;
};

[[nodiscard]] std::unique_ptr<NodeState> build_node(std::size_t index, std::size_t node_count,
                                                    const NodeBenchOptions& options);

// Queues one more transfer on `link` (sizes and priorities drawn from `seed`).
void queue_transfer(NodeState& node, decision::LinkScheduler& link, std::uint64_t seed);

}  // namespace kvrelay::bench
