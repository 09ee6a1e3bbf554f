#include "kvrelay/decision/engine_from_policy.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

namespace kvrelay::decision {

std::string link_id_for(const Policy& policy, const AgentPolicy& to_agent) {
  if (to_agent.node.empty() || to_agent.node == policy.node_id) {
    return "local";
  }
  return "peer:" + to_agent.node;
}

std::string route_link_id(const Policy& policy, const RoutePolicy& route) {
  const AgentPolicy* to = policy.find_agent(route.to_agent);
  if (to != nullptr) {
    const std::string link = link_id_for(policy, *to);
    if (link != "local") return link;
  }
  const AgentPolicy* from = policy.find_agent(route.from_agent);
  return from != nullptr ? link_id_for(policy, *from) : std::string("local");
}

namespace {

const AgentCostModel* agent_cost_model(const Policy& policy, const std::string& agent_id) {
  for (const auto& [id, model] : policy.cost_model.agents) {
    if (id == agent_id) return &model;
  }
  return nullptr;
}

// Built-in media with the policy's calibrated quality (cost_model.media) applied.
Status add_builtin_media(DecisionEngine& engine, const Policy& policy) {
  for (const std::string_view name : kBuiltinMedia) {
    if (name == "tokens") continue;  // the engine always registers tokens first
    MediumSpec spec = builtin_medium(name);
    for (const auto& [medium, model] : policy.cost_model.media) {
      if (medium != name) continue;
      if (model.fidelity) spec.profile.fidelity = *model.fidelity;
      if (model.extra_decode_fraction) spec.profile.extra_decode_fraction = *model.extra_decode_fraction;
    }
    KVRELAY_TRY(engine.add_medium(std::move(spec)));
  }
  return ok();
}

}  // namespace

Result<DecisionEngine> engine_from_policy(const Policy& policy, const LinkPriors& priors, EngineConfig config) {
  const bool calibrated_media = config.load_builtin_media && !policy.cost_model.media.empty();
  if (calibrated_media) config.load_builtin_media = false;
  DecisionEngine engine(config);
  if (calibrated_media) {
    KVRELAY_TRY(add_builtin_media(engine, policy));
  }
  KVRELAY_TRY(engine.add_link(LinkParams{"local", true, priors.shm_bytes_per_s, priors.shm_rtt_s}));
  for (const AgentPolicy& agent : policy.agents) {
    KVRELAY_TRY(const std::uint64_t bytes_per_token, agent.model.layout(1).bytes_per_token());
    AgentParams params;
    params.id = agent.id;
    params.fingerprint_id = agent.model.id();
    params.kv_bytes_per_token = static_cast<double>(bytes_per_token);
    params.dtype = agent.model.dtype;
    params.accepts_sparse = agent.accepts_sparse_kv;
    params.role_priority = agent.role_priority;
    if (const AgentCostModel* model = agent_cost_model(policy, agent.id)) {
      if (model->prefill_a_s) params.prefill_prior.a = *model->prefill_a_s;
      if (model->prefill_b_s) params.prefill_prior.b = *model->prefill_b_s;
      if (model->prefill_c_s) params.prefill_prior.c = *model->prefill_c_s;
      if (model->decode_s_per_token) params.decode_s_per_token = *model->decode_s_per_token;
    }
    KVRELAY_TRY(engine.add_agent(params));
    const std::string link = link_id_for(policy, agent);
    if (link != "local" && !engine.find_link(link)) {
      const PeerPolicy* peer = policy.find_peer(agent.node);
      const bool shm = peer != nullptr && peer->same_host;
      KVRELAY_TRY(engine.add_link(LinkParams{link, shm, shm ? priors.shm_bytes_per_s : priors.tcp_bytes_per_s,
                                             shm ? priors.shm_rtt_s : priors.tcp_rtt_s}));
    }
  }
  for (const RoutePolicy& route : policy.routes) {
    const AgentPolicy* to = policy.find_agent(route.to_agent);
    if (to == nullptr) {
      return fail(ErrorCode::kNotFound, "route '" + route.id + "': unknown agent '" + route.to_agent + "'");
    }
    KVRELAY_TRY(const LinkId link, engine.find_link(route_link_id(policy, route)));
    KVRELAY_TRY(engine.add_route(route, link));
  }
  return engine;
}

double measure_copy_bandwidth(std::size_t bytes) {
  std::vector<unsigned char> source(bytes, 1);
  std::vector<unsigned char> target(bytes, 0);
  std::memcpy(target.data(), source.data(), bytes);  // fault the pages in first
  double best = 0.0;
  for (int round = 0; round < 3; ++round) {
    const auto start = std::chrono::steady_clock::now();
    std::memcpy(target.data(), source.data(), bytes);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (seconds > 0.0) {
      best = std::max(best, static_cast<double>(bytes) / seconds);
    }
  }
  return best > 0.0 ? best : 1e9;
}

}  // namespace kvrelay::decision
