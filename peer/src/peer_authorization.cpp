#include "kvrelay/peer/peer_authorization.h"

#include <fmt/format.h>

#include "kvrelay/core/tensor_parallel.h"

namespace kvrelay::peer {

PeerGrant grant_for(const Policy& policy, std::string_view peer_id, bool tls) {
  return PeerGrant{std::string(peer_id), !tls && policy.find_peer(peer_id) == nullptr};
}

bool agent_model_shape(const AgentPolicy& agent, const KvLayout& layout) noexcept {
  const ModelFingerprint& model = agent.model;
  const bool heads =
      layout.kv_heads == model.kv_heads ||
      (agent.tensor_parallel_size > 1 && layout.kv_heads == shard_kv_heads(model.kv_heads, agent.tensor_parallel_size));
  return model.layers == layout.layers && heads && model.head_dim == layout.head_dim && model.dtype == layout.dtype;
}

Status authorize_push(const Policy& policy, const PeerGrant& grant, std::string_view route_id) {
  if (grant.unrestricted) return ok();
  if (grant.peer_id.empty() || grant.peer_id == policy.node_id) {
    return fail(ErrorCode::kPermissionDenied, "push refused: the peer names no node id but this node's or none");
  }
  const RoutePolicy* route = route_id.empty() ? nullptr : policy.find_route(route_id);
  if (route == nullptr) {
    return fail(ErrorCode::kPermissionDenied,
                fmt::format("push from peer {} refused: route '{}' is not in node {}'s policy", grant.peer_id, route_id,
                            policy.node_id));
  }
  const AgentPolicy* from = policy.find_agent(route->from_agent);
  const AgentPolicy* to = policy.find_agent(route->to_agent);
  if (from == nullptr || from->node != grant.peer_id) {
    return fail(ErrorCode::kPermissionDenied,
                fmt::format("push from peer {} refused: route {}'s from agent {} does not live on that peer",
                            grant.peer_id, route->id, route->from_agent));
  }
  if (to == nullptr || (!to->node.empty() && to->node != policy.node_id)) {
    return fail(ErrorCode::kPermissionDenied,
                fmt::format("push from peer {} refused: route {}'s to agent {} does not live on node {}", grant.peer_id,
                            route->id, route->to_agent, policy.node_id));
  }
  return ok();
}

Status authorize_pushed_entry(const Policy& policy, const PeerGrant& grant, std::string_view route_id,
                              const KvLayout& layout) {
  if (grant.unrestricted) return ok();
  const RoutePolicy* route = policy.find_route(route_id);  // authorize_push found it; a reload may not
  const AgentPolicy* to = route != nullptr ? policy.find_agent(route->to_agent) : nullptr;
  if (to == nullptr || !agent_model_shape(*to, layout)) {
    return fail(ErrorCode::kPermissionDenied,
                fmt::format("push from peer {} refused: its entry is not of route {}'s to agent's model", grant.peer_id,
                            route_id));
  }
  return ok();
}

Status authorize_pushed_tenant(const Policy& policy, const PeerGrant& grant, std::string_view route_id,
                               const kv_store::EntryChain& chain) {
  if (grant.unrestricted) return ok();
  const RoutePolicy* route = policy.find_route(route_id);
  const AgentPolicy* from = route != nullptr ? policy.find_agent(route->from_agent) : nullptr;
  if (from == nullptr || from->tenant != chain.tenant) {
    return fail(ErrorCode::kPermissionDenied,
                fmt::format("push from peer {} refused: its entry is of tenant '{}', not of route {}'s from agent's",
                            grant.peer_id, chain.tenant, route_id));
  }
  return ok();
}

bool authorize_fetch(const Policy& policy, const PeerGrant& grant, const kv_store::StoredEntry& entry) {
  if (entry.chain == nullptr) return false;  // its key cannot be verified there: it stays here
  if (grant.unrestricted) return true;
  if (grant.peer_id.empty() || grant.peer_id == policy.node_id) return false;  // "" is this node's agents
  for (const auto& agent : policy.agents) {
    if (agent.node == grant.peer_id && agent.tenant == entry.chain->tenant &&
        agent_model_shape(agent, entry.info.layout))
      return true;
  }
  return false;
}

std::uint64_t spill_quota(const Policy& policy, const PeerGrant& grant) {
  const PeerPolicy* peer = grant.unrestricted ? nullptr : policy.find_peer(grant.peer_id);
  return peer != nullptr ? peer->accept_spill_bytes : 0;
}

Status authorize_spill(const Policy& policy, const PeerGrant& grant) {
  if (spill_quota(policy, grant) > 0) return ok();
  return fail(ErrorCode::kPermissionDenied,
              fmt::format("spill from peer {} refused: node {}'s policy gives it no accept_spill_bytes", grant.peer_id,
                          policy.node_id));
}

Status authorize_spilled_entry(const Policy& policy, const PeerGrant& grant, const kv_store::StoredEntry& entry) {
  KVRELAY_TRY(authorize_spill(policy, grant));
  if (!authorize_fetch(policy, grant, entry)) {
    return fail(ErrorCode::kPermissionDenied,
                fmt::format("spill from peer {} refused: none of its agents uses this entry's model and tenant",
                            grant.peer_id));
  }
  return ok();
}

}  // namespace kvrelay::peer
