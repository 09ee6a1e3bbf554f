#pragma once

// Builds a DecisionEngine from a parsed policy, as seen from the policy's own node: agents with
// their fingerprints and KV sizes, one link per peer node (shared memory for agents on this
// node or on a same-host peer, TCP otherwise), every route, and the plugin media the policy
// names. A reload that keeps engine_topology() applies the rest live (apply_policy_settings),
// keeping what the engine has learned; any other change needs a new engine.

#include <span>
#include <string>
#include <vector>

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

// A plugin codec this process has loaded (decision/ does not link codec_plugins/).
struct PluginCodec {
  std::string name;  // the codec's name; its medium is "codec:<name>"
  bool lossless = false;
};

// A plugin medium the policy names without its codec in `plugins` is listed and never chosen
// (Exclusion::kCodecUnavailable), so one missing plugin does not take the engine down.
[[nodiscard]] Result<DecisionEngine> engine_from_policy(const Policy& policy, const LinkPriors& priors,
                                                        EngineConfig config = {},
                                                        std::span<const PluginCodec> plugins = {});

// What an engine is built from: node, agents (id, fingerprint, node), routes (id, from, to),
// peers (id, same_host) and the plugin media the policy names. Equal topologies mean the same
// agents, links, routes and media ids, so learned estimates stay meaningful.
[[nodiscard]] std::string engine_topology(const Policy& policy);

// Applies everything else a policy sets to an engine built for the same engine_topology():
// routes' allowed and forced media, enabled, hysteresis, quality floor and deadline; agents'
// accepts_sparse_kv and role priority; the whole cost_model (prefill and decode priors, media
// quality; an entry removed from it restores the default). Learned estimates are kept.
[[nodiscard]] Status apply_policy_settings(DecisionEngine& engine, const Policy& policy);

// The policy as a sidecar's engine is given it: forced media and disabled routes left out (the
// KV path applies them before the engine), so switching them live never touches the engine.
[[nodiscard]] Policy engine_view(const Policy& policy);

// Plugin media ("codec:<name>") in routes' allowed_media, forced_medium and audit treatments,
// and in cost_model.media, once each, in the order the policy names them.
[[nodiscard]] std::vector<std::string> plugin_media_named(const Policy& policy);

// Id of the link a route to `to_agent` uses: "local" on this node, "peer:<node>" otherwise.
[[nodiscard]] std::string link_id_for(const Policy& policy, const AgentPolicy& to_agent);

// Link a route's KV crosses as seen from this node: to the destination's node when it is remote,
// else from the source's node when that is remote (the receiver fetches), else "local".
[[nodiscard]] std::string route_link_id(const Policy& policy, const RoutePolicy& route);

// Memory copy bandwidth of this host (bytes/s), the prior for shared-memory links.
[[nodiscard]] double measure_copy_bandwidth(std::size_t bytes = 64ULL << 20);

}  // namespace kvrelay::decision
