#pragma once

// Builds a DecisionEngine from a parsed policy, as seen from the policy's own node: agents with
// their fingerprints and KV sizes, one link per peer node (shared memory for agents on this
// node or on a same-host peer, TCP otherwise) and every route.

#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"
#include "kvrelay/decision/decision_engine.h"

namespace kvrelay::decision {

struct LinkPriors {
  double shm_bytes_per_s = 10e9;  // replace with a measured copy bandwidth (measure_copy_bandwidth)
  double shm_rtt_s = 2e-5;
  double tcp_bytes_per_s = 1.25e9;
  double tcp_rtt_s = 2e-4;
};

[[nodiscard]] Result<DecisionEngine> engine_from_policy(const Policy& policy, const LinkPriors& priors,
                                                        EngineConfig config = {});

// Id of the link a route to `to_agent` uses: "local" on this node, "peer:<node>" otherwise.
[[nodiscard]] std::string link_id_for(const Policy& policy, const AgentPolicy& to_agent);

// Link a route's KV crosses as seen from this node: to the destination's node when it is remote,
// else from the source's node when that is remote (the receiver fetches), else "local".
[[nodiscard]] std::string route_link_id(const Policy& policy, const RoutePolicy& route);

// Memory copy bandwidth of this host (bytes/s), the prior for shared-memory links.
[[nodiscard]] double measure_copy_bandwidth(std::size_t bytes = 64ULL << 20);

}  // namespace kvrelay::decision
