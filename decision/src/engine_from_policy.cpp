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

// The agent as the engine sees it: the model's KV shape, and the cost model's priors over the
// engine's defaults.
Result<AgentParams> agent_params(const Policy& policy, const AgentPolicy& agent) {
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
  return params;
}

// Every registered medium's quality: the policy's calibration (cost_model.media) over the
// catalogue's default for that medium.
Status apply_media_quality(DecisionEngine& engine, const Policy& policy) {
  for (std::size_t index = 0; index < engine.media_count(); ++index) {
    const auto id = static_cast<MediumId>(index);
    const MediumSpec& spec = engine.medium(id);
    const BuiltinMedium* builtin = find_builtin_medium(spec.name);
    const CodecProfile defaults =
        builtin != nullptr ? builtin->profile
                           : plugin_medium(plugin_codec_of(spec.name).value_or(spec.name), spec.lossless()).profile;
    double fidelity = defaults.fidelity;
    double extra_decode = defaults.extra_decode_fraction;
    if (const MediumCostModel* model = policy.cost_model.medium(spec.name)) {
      fidelity = model->fidelity.value_or(fidelity);
      extra_decode = model->extra_decode_fraction.value_or(extra_decode);
    }
    if (fidelity != spec.profile.fidelity || extra_decode != spec.profile.extra_decode_fraction) {
      KVRELAY_TRY(engine.update_medium_quality(id, fidelity, extra_decode));
    }
  }
  return ok();
}

Status add_plugin_media(DecisionEngine& engine, const Policy& policy, std::span<const PluginCodec> plugins) {
  for (const std::string& name : plugin_media_named(policy)) {
    const std::string_view codec = *plugin_codec_of(name);
    const auto loaded =
        std::find_if(plugins.begin(), plugins.end(), [&](const PluginCodec& plugin) { return plugin.name == codec; });
    MediumSpec spec = plugin_medium(codec, loaded != plugins.end() && loaded->lossless);
    spec.available = loaded != plugins.end();
    if (auto added = engine.add_medium(std::move(spec)); !added) {
      return fail(added.error().code, "plugin medium '" + name + "': " + added.error().message);
    }
  }
  return ok();
}

}  // namespace

std::vector<std::string> plugin_media_named(const Policy& policy) {
  std::vector<std::string> named;
  const auto note = [&](std::string_view medium) {
    if (plugin_codec_of(medium) && std::find(named.begin(), named.end(), medium) == named.end()) {
      named.emplace_back(medium);
    }
  };
  for (const RoutePolicy& route : policy.routes) {
    for (const std::string& medium : route.allowed_media)
      note(medium);
    if (route.forced_medium) note(*route.forced_medium);
    for (const Treatment& treatment : route.audit.treatments)
      note(treatment.medium);
  }
  for (const auto& [medium, model] : policy.cost_model.media)
    note(medium);
  return named;
}

Policy engine_view(const Policy& policy) {
  Policy view = policy;
  for (RoutePolicy& route : view.routes) {
    route.forced_medium.reset();
    route.enabled = true;
  }
  return view;
}

std::string engine_topology(const Policy& policy) {
  std::string topology = "node:" + policy.node_id;
  for (const AgentPolicy& agent : policy.agents) {
    topology += "|a:" + agent.id + ":" + std::to_string(agent.model.id()) + ":" + agent.node;
  }
  for (const RoutePolicy& route : policy.routes) {
    topology += "|r:" + route.id + ":" + route.from_agent + ":" + route.to_agent;
  }
  for (const PeerPolicy& peer : policy.peers) {
    topology += "|p:" + peer.id + (peer.same_host ? ":same_host" : "");
  }
  for (const std::string& medium : plugin_media_named(policy)) {
    topology += "|m:" + medium;
  }
  return topology;
}

Result<DecisionEngine> engine_from_policy(const Policy& policy, const LinkPriors& priors, EngineConfig config,
                                          std::span<const PluginCodec> plugins) {
  DecisionEngine engine(config);
  KVRELAY_TRY(add_plugin_media(engine, policy, plugins));
  KVRELAY_TRY(engine.add_link(LinkParams{"local", true, priors.shm_bytes_per_s, priors.shm_rtt_s}));
  for (const AgentPolicy& agent : policy.agents) {
    KVRELAY_TRY(const AgentParams params, agent_params(policy, agent));
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
  KVRELAY_TRY(apply_media_quality(engine, policy));
  return engine;
}

Status apply_policy_settings(DecisionEngine& engine, const Policy& policy) {
  for (const AgentPolicy& agent : policy.agents) {
    KVRELAY_TRY(const AgentParams params, agent_params(policy, agent));
    KVRELAY_TRY(engine.update_agent(params));
  }
  for (const RoutePolicy& route : policy.routes) {
    KVRELAY_TRY(engine.update_route(route));
  }
  return apply_media_quality(engine, policy);
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
