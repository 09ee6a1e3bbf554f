#pragma once

// What an authenticated peer may do under the policy (issue #25). The peer's id is its TLS
// certificate's identity (or, plaintext on loopback, its hello's node id); pushes and fetches
// are allowed only for what the policy says its agents do.

#include <cstdint>
#include <string>
#include <string_view>

#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/kv_store/entry_store.h"

namespace kvrelay::peer {

struct PeerGrant {
  std::string peer_id;  // a policy peer's id, or an unknown hello's node id (which may do nothing)
  // A plaintext hello that names no policy peer: nothing is restricted, as before issue #25
  // (tests, and same-host tools). Plaintext runs only on loopback or a trusted network, where a
  // hello's node id is a claim anyone there can make, so plaintext authorization guards against
  // mistakes, not attackers; TLS identities are what it rests on. Never with TLS. Integrity
  // (entry chains) holds for every grant.
  bool unrestricted = false;
};

// The grant of a session under `policy`: `peer_id` as authenticated.
[[nodiscard]] PeerGrant grant_for(const Policy& policy, std::string_view peer_id, bool tls);

// Models are matched by shape (layers, KV heads, head size, dtype): the KV a worker files is
// keyed by its own fingerprint id (a digest of its weights), which need not be the id of the
// fingerprint the policy declares for its agent, so ids cannot be compared yet. An agent with
// tensor_parallel_size > 1 also owns its ranks' shards (kv_heads shared out, shard_kv_heads).
[[nodiscard]] bool agent_model_shape(const AgentPolicy& agent, const KvLayout& layout) noexcept;

// A push on `route_id`, before any of it is read: the route's `from` agent lives on the peer
// and its `to` agent here. kPermissionDenied says which not.
[[nodiscard]] Status authorize_push(const Policy& policy, const PeerGrant& grant, std::string_view route_id);
// The pushed entry, decoded and not yet filed: KV of the route's `to` agent's model.
[[nodiscard]] Status authorize_pushed_entry(const Policy& policy, const PeerGrant& grant, std::string_view route_id,
                                            const KvLayout& layout);

// The pushed entry, decoded and not yet filed: its chain's tenant is the route's `from` agent's
// (the KV path files and looks up KV in that tenant's scope).
[[nodiscard]] Status authorize_pushed_tenant(const Policy& policy, const PeerGrant& grant, std::string_view route_id,
                                             const kv_store::EntryChain& chain);

// A spill from the peer (issue #27), before any of it is read: the peer's policy entry here has
// accept_spill_bytes. Spills always need that quota: an unrestricted grant has none.
[[nodiscard]] Status authorize_spill(const Policy& policy, const PeerGrant& grant);
// The peer's accept_spill_bytes here (0: none; always 0 for an unrestricted grant).
[[nodiscard]] std::uint64_t spill_quota(const Policy& policy, const PeerGrant& grant);
// The spilled entry, decoded and not yet filed: the peer still has a quota and could fetch it
// back (authorize_fetch). The quota's room is the store's to check, as it files the entry
// (EntryStore::put_spilled).
[[nodiscard]] Status authorize_spilled_entry(const Policy& policy, const PeerGrant& grant,
                                             const kv_store::StoredEntry& entry);

// Whether a fetch (or a summary) may show `entry`: only entries that carry their token ids, of a
// model and a tenant that one of the peer's agents uses.
[[nodiscard]] bool authorize_fetch(const Policy& policy, const PeerGrant& grant, const kv_store::StoredEntry& entry);

}  // namespace kvrelay::peer
