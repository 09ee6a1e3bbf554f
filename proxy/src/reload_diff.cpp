#include "reload_diff.h"

#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <string_view>
#include <tuple>

namespace kvrelay::proxy {

namespace {

// RFC 6901: '~' and '/' in a key are escaped.
std::string pointer_key(std::string_view key) {
  std::string out;
  for (const char c : key) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}

enum class Applies { kLive, kOnRestart };

class Diff {
 public:
  explicit Diff(PolicyChanges& out) : out_(out) {}

  template <class T>
  void field(Applies applies, const std::string& pointer, const T& before, const T& after) {
    if (!(before == after)) note(applies, pointer);
  }
  void note(Applies applies, const std::string& pointer) {
    (applies == Applies::kLive ? out_.live : out_.restart_required).push_back(pointer);
  }

 private:
  PolicyChanges& out_;
};

void diff_listen(Diff& diff, const ListenPolicy& before, const ListenPolicy& after) {
  constexpr auto kRestart = Applies::kOnRestart;  // the listeners are bound at start
  diff.field(kRestart, "/listen/http", before.http, after.http);
  diff.field(kRestart, "/listen/admin", before.admin, after.admin);
  diff.field(kRestart, "/listen/peer", before.peer, after.peer);
  diff.field(kRestart, "/listen/unix_socket", before.unix_socket, after.unix_socket);
  diff.field(kRestart, "/listen/unix_socket_group", before.unix_socket_group, after.unix_socket_group);
  diff.field(kRestart, "/listen/allowed_uids", before.allowed_uids, after.allowed_uids);
  // Read per request by the agent listener's dispatcher.
  diff.field(Applies::kLive, "/listen/metrics_on_http", before.metrics_on_http, after.metrics_on_http);
}

// Every limit with its class, for both the diff and keep_restart_fields. The HTTP servers, the
// store, the peer buffers and the arena are sized at start; the rest is read per request, per
// lookup or per timer tick.
template <class Visit>
void visit_limits(Visit&& visit) {
  constexpr auto kRestart = Applies::kOnRestart;
  constexpr auto kLive = Applies::kLive;
  visit(kRestart, "/limits/max_header_bytes", &LimitsPolicy::max_header_bytes);
  visit(kRestart, "/limits/max_body_bytes", &LimitsPolicy::max_body_bytes);
  visit(kRestart, "/limits/read_timeout_ms", &LimitsPolicy::read_timeout);
  visit(kLive, "/limits/upstream_timeout_ms", &LimitsPolicy::upstream_timeout);
  visit(kRestart, "/limits/idle_timeout_ms", &LimitsPolicy::idle_timeout);
  visit(kRestart, "/limits/max_connections", &LimitsPolicy::max_connections);
  visit(kRestart, "/limits/max_queued_responses", &LimitsPolicy::max_queued_responses);
  visit(kRestart, "/limits/kv_store_bytes", &LimitsPolicy::kv_store_bytes);
  visit(kRestart, "/limits/peer_buffer_bytes", &LimitsPolicy::peer_buffer_bytes);
  visit(kRestart, "/limits/peer_staging", &LimitsPolicy::peer_staging);
  visit(kRestart, "/limits/shm_arena_bytes", &LimitsPolicy::shm_arena_bytes);
  visit(kRestart, "/limits/memory_strategy", &LimitsPolicy::memory_strategy);
  visit(kLive, "/limits/probe_interval_ms", &LimitsPolicy::probe_interval);
  visit(kLive, "/limits/kv_lookup_timeout_ms", &LimitsPolicy::kv_lookup_timeout);
  visit(kLive, "/limits/peer_summary_interval_ms", &LimitsPolicy::peer_summary_interval);
  visit(kLive, "/limits/peer_bandwidth_probe_interval_ms", &LimitsPolicy::peer_bandwidth_probe_interval);
}

void diff_agent(Diff& diff, const std::string& at, const AgentPolicy& before, const AgentPolicy& after) {
  constexpr auto kLive = Applies::kLive;  // per request, per probe, or the engine (rebuilt on model or node)
  diff.field(kLive, at + "/upstream", before.upstream, after.upstream);
  diff.field(kLive, at + "/model", before.model, after.model);
  diff.field(kLive, at + "/role_priority", before.role_priority, after.role_priority);
  diff.field(kLive, at + "/kv_connector", before.kv_connector, after.kv_connector);
  diff.field(kLive, at + "/node", before.node, after.node);
  diff.field(kLive, at + "/metrics_url", before.metrics_url, after.metrics_url);
  diff.field(kLive, at + "/accepts_sparse_kv", before.accepts_sparse_kv, after.accepts_sparse_kv);
  diff.field(kLive, at + "/accepts_kv_spans", before.accepts_kv_spans, after.accepts_kv_spans);
  diff.field(kLive, at + "/tenant", before.tenant, after.tenant);
}

void diff_route(Diff& diff, const std::string& at, const RoutePolicy& before, const RoutePolicy& after) {
  constexpr auto kLive = Applies::kLive;  // per request, or the engine's live settings
  diff.field(kLive, at + "/from", before.from_agent, after.from_agent);
  diff.field(kLive, at + "/to", before.to_agent, after.to_agent);
  diff.field(kLive, at + "/enabled", before.enabled, after.enabled);
  diff.field(kLive, at + "/allowed_media", before.allowed_media, after.allowed_media);
  diff.field(kLive, at + "/forced_medium", before.forced_medium, after.forced_medium);
  diff.field(kLive, at + "/priority", before.priority, after.priority);
  diff.field(kLive, at + "/deadline_ms", before.deadline, after.deadline);
  // audit_fraction and audit.fraction are one value (the parser sets both).
  diff.field(kLive, at + "/audit_fraction", before.audit.fraction, after.audit.fraction);
  diff.field(kLive, at + "/audit/treatments", before.audit.treatments, after.audit.treatments);
  diff.field(kLive, at + "/audit/trials_file", before.audit.trials_file, after.audit.trials_file);
  diff.field(kLive, at + "/audit/client_treatments", before.audit.client_treatments, after.audit.client_treatments);
  // Read by the KV path at each audited outcome: a refit uses the window and step in force then.
  diff.field(kLive, at + "/audit/calibrate", before.audit.calibrate_live, after.audit.calibrate_live);
  diff.field(kLive, at + "/audit/calibrate_window", before.audit.calibrate_window, after.audit.calibrate_window);
  diff.field(kLive, at + "/audit/calibrate_max_step_s", before.audit.calibrate_max_step_s,
             after.audit.calibrate_max_step_s);
  diff.field(kLive, at + "/hysteresis", before.hysteresis_threshold, after.hysteresis_threshold);
  diff.field(kLive, at + "/quality_floor", before.quality_floor, after.quality_floor);
  diff.field(kLive, at + "/push", before.push, after.push);
  // The link queues read a transfer's route when it opens.
  diff.field(kLive, at + "/critical", before.critical, after.critical);
  diff.field(kLive, at + "/reserved_share", before.reserved_share, after.reserved_share);
  // Read by the front proxy per request (docs/summary.md); the budget reaches the engine live.
  diff.field(kLive, at + "/summary", before.summary, after.summary);
}

void diff_peer(Diff& diff, const std::string& at, const PeerPolicy& before, const PeerPolicy& after) {
  // New connections use the new address (an open one is kept until it fails); same_host moves
  // the engine's link.
  diff.field(Applies::kLive, at + "/address", before.address, after.address);
  diff.field(Applies::kLive, at + "/same_host", before.same_host, after.same_host);
  // The data plane reads it at each connection it accepts.
  diff.field(Applies::kLive, at + "/uid", before.uid, after.uid);
  // Read at each spill received and each victim spilled.
  diff.field(Applies::kLive, at + "/accept_spill_bytes", before.accept_spill_bytes, after.accept_spill_bytes);
  // New connections use it: PeerLinks drops a client whose address or transport changed. A peer
  // moved to "ucx" on a node that started without UCX fails its connects until a restart makes
  // the context; diff_ucx names that as /ucx.
  diff.field(Applies::kLive, at + "/transport", before.transport, after.transport);
}

// The UCP context, the peer server's workers and the arena's registration are made at start from
// the ucx section. A section added or removed, or the first ucx peer added or the last removed,
// turns UCX on or off: named by the section's pointer alone.
void diff_ucx(Diff& diff, const UcxPolicy& before, const UcxPolicy& after) {
  constexpr auto kRestart = Applies::kOnRestart;
  if (before.enabled != after.enabled) {
    diff.note(kRestart, "/ucx");
    return;
  }
  diff.field(kRestart, "/ucx/tls", before.tls, after.tls);
  diff.field(kRestart, "/ucx/net_devices", before.net_devices, after.net_devices);
  diff.field(kRestart, "/ucx/rndv_thresh_bytes", before.rndv_thresh_bytes, after.rndv_thresh_bytes);
  // The peer server reads it at start: whether UCX is offered to connections off loopback.
  diff.field(kRestart, "/ucx/trusted_network", before.trusted_network, after.trusted_network);
}

// Read per request by the admin router. A new token under the same file or variable is named by
// that pointer: the token itself never appears in a report.
void diff_admin(Diff& diff, const AdminPolicy& before, const AdminPolicy& after) {
  constexpr auto kLive = Applies::kLive;
  diff.field(kLive, "/admin/token_file", before.token_file, after.token_file);
  diff.field(kLive, "/admin/token_env", before.token_env, after.token_env);
  diff.field(kLive, "/admin/require_token_for_reads", before.require_token_for_reads, after.require_token_for_reads);
  if (before.token != after.token && before.token_file == after.token_file && before.token_env == after.token_env) {
    diff.note(kLive, after.token_env.empty() ? "/admin/token_file" : "/admin/token_env");
  }
}

// Items of an id-keyed array: each one's fields, an added one by its pointer, removals by the array.
template <class Item, class DiffItem>
void diff_items(Diff& diff, const std::string& array, const std::vector<Item>& before, const std::vector<Item>& after,
                DiffItem diff_item) {
  for (std::size_t index = 0; index < after.size(); ++index) {
    const std::string at = fmt::format("{}/{}", array, index);
    const auto found =
        std::find_if(before.begin(), before.end(), [&](const Item& item) { return item.id == after[index].id; });
    if (found == before.end()) {
      diff.note(Applies::kLive, at);
    } else {
      diff_item(diff, at, *found, after[index]);
    }
  }
  const bool removed = std::any_of(before.begin(), before.end(), [&](const Item& item) {
    return std::none_of(after.begin(), after.end(), [&](const Item& other) { return other.id == item.id; });
  });
  if (removed) diff.note(Applies::kLive, array);
}

// cost_model.agents and .media: keyed objects of optional numbers, all live (the engine's priors).
template <class Model, class DiffModel>
void diff_keyed(Diff& diff, const std::string& object, const std::vector<std::pair<std::string, Model>>& before,
                const std::vector<std::pair<std::string, Model>>& after, DiffModel diff_model) {
  const auto find = [](const auto& entries, const std::string& key) -> const Model* {
    for (const auto& [name, model] : entries)
      if (name == key) return &model;
    return nullptr;
  };
  for (const auto& [key, model] : after) {
    const std::string at = object + "/" + pointer_key(key);
    if (const Model* old = find(before, key)) {
      diff_model(diff, at, *old, model);
    } else {
      diff.note(Applies::kLive, at);
    }
  }
  for (const auto& [key, model] : before) {
    if (find(after, key) == nullptr) diff.note(Applies::kLive, object + "/" + pointer_key(key));
  }
}

void diff_cost_model(Diff& diff, const CostModelPolicy& before, const CostModelPolicy& after) {
  constexpr auto kLive = Applies::kLive;
  diff_keyed(diff, "/cost_model/agents", before.agents, after.agents,
             [](Diff& d, const std::string& at, const AgentCostModel& old, const AgentCostModel& now) {
               d.field(kLive, at + "/prefill_s/a", old.prefill_a_s, now.prefill_a_s);
               d.field(kLive, at + "/prefill_s/b", old.prefill_b_s, now.prefill_b_s);
               d.field(kLive, at + "/prefill_s/c", old.prefill_c_s, now.prefill_c_s);
               d.field(kLive, at + "/decode_s_per_token", old.decode_s_per_token, now.decode_s_per_token);
             });
  diff_keyed(diff, "/cost_model/media", before.media, after.media,
             [](Diff& d, const std::string& at, const MediumCostModel& old, const MediumCostModel& now) {
               d.field(kLive, at + "/fidelity", old.fidelity, now.fidelity);
               d.field(kLive, at + "/extra_decode_fraction", old.extra_decode_fraction, now.extra_decode_fraction);
             });
}

}  // namespace

PolicyChanges diff_policies(const Policy& before, const Policy& after) {
  PolicyChanges changes;
  Diff diff(changes);
  constexpr auto kRestart = Applies::kOnRestart;
  // The peer server announces the node id and the codecs and logging are set up at start.
  diff.field(kRestart, "/node/id", before.node_id, after.node_id);
  diff_listen(diff, before.listen, after.listen);
  diff_admin(diff, before.admin, after.admin);
  diff_items(diff, "/peers", before.peers, after.peers, diff_peer);
  diff_ucx(diff, before.ucx, after.ucx);
  diff_items(diff, "/agents", before.agents, after.agents, diff_agent);
  diff_items(diff, "/routes", before.routes, after.routes, diff_route);
  visit_limits([&](Applies applies, const char* pointer, auto member) {
    diff.field(applies, pointer, before.limits.*member, after.limits.*member);
  });
  // The store is built with its eviction policy at start; that policy reads the tau live.
  diff.field(kRestart, "/kv_store/eviction", before.kv_store.eviction, after.kv_store.eviction);
  diff.field(Applies::kLive, "/kv_store/recency_tau_s", before.kv_store.recency_tau_s, after.kv_store.recency_tau_s);
  // Read at each victim (spill) and each publish (prefetch).
  const auto& old_store = before.kv_store;
  const auto& new_store = after.kv_store;
  diff.field(Applies::kLive, "/kv_store/spill_min_utility", old_store.spill_min_utility, new_store.spill_min_utility);
  diff.field(Applies::kLive, "/kv_store/spill_medium", old_store.spill_medium, new_store.spill_medium);
  diff.field(Applies::kLive, "/kv_store/spill_inflight_bytes", old_store.spill_inflight_bytes,
             new_store.spill_inflight_bytes);
  diff.field(Applies::kLive, "/kv_store/prefetch", old_store.prefetch, new_store.prefetch);
  diff.field(Applies::kLive, "/kv_store/prefetch_max_bytes", old_store.prefetch_max_bytes,
             new_store.prefetch_max_bytes);
  // The link queues are built from the scheduler section at start.
  const auto& old_sched = before.scheduler;
  const auto& new_sched = after.scheduler;
  diff.field(kRestart, "/scheduler/mode", old_sched.mode, new_sched.mode);
  diff.field(kRestart, "/scheduler/time_slice_ms", old_sched.time_slice, new_sched.time_slice);
  diff.field(kRestart, "/scheduler/chunk_bytes", old_sched.chunk_bytes, new_sched.chunk_bytes);
  diff.field(kRestart, "/scheduler/window_chunks", old_sched.window_chunks, new_sched.window_chunks);
  diff.field(kRestart, "/scheduler/base", old_sched.base, new_sched.base);
  diff.field(kRestart, "/scheduler/alpha", old_sched.alpha, new_sched.alpha);
  diff.field(kRestart, "/scheduler/beta", old_sched.beta, new_sched.beta);
  diff.field(kRestart, "/scheduler/preempt_factor", old_sched.preempt_factor, new_sched.preempt_factor);
  diff.field(kRestart, "/scheduler/preempt_max_done", old_sched.preempt_max_done, new_sched.preempt_max_done);
  diff.field(kRestart, "/scheduler/max_reserved_share", old_sched.max_reserved_share, new_sched.max_reserved_share);
  diff.field(kRestart, "/scheduler/link_bytes_per_s", old_sched.link_bytes_per_s, new_sched.link_bytes_per_s);
  diff.field(kRestart, "/scheduler/max_stall_ms", old_sched.max_stall, new_sched.max_stall);
  diff.field(kRestart, "/codecs/plugin_dirs", before.codecs.plugin_dirs, after.codecs.plugin_dirs);
  diff.field(kRestart, "/codecs/device", before.codecs.device, after.codecs.device);
  diff.field(kRestart, "/logging/level", before.logging.level, after.logging.level);
  diff.field(kRestart, "/logging/format", before.logging.format, after.logging.format);
  diff.field(kRestart, "/logging/file", before.logging.file, after.logging.file);
  diff_cost_model(diff, before.cost_model, after.cost_model);
  // Secrets are compared, never shown: a changed file's contents report its pointer only.
  diff_items(diff, "/tenants", before.tenants, after.tenants,
             [](Diff& d, const std::string& at, const TenantPolicy& old, const TenantPolicy& now) {
               d.field(Applies::kLive, at + "/salt_file", std::tie(old.salt_file, old.salt),
                       std::tie(now.salt_file, now.salt));
             });
  diff.field(Applies::kLive, "/signing/node_key_file", std::tie(before.signing.node_key_file, before.signing.node_key),
             std::tie(after.signing.node_key_file, after.signing.node_key));
  return changes;
}

void keep_restart_fields(const Policy& running, Policy& next) {
  next.node_id = running.node_id;
  const bool metrics_on_http = next.listen.metrics_on_http;  // the one live listen field
  next.listen = running.listen;
  next.listen.metrics_on_http = metrics_on_http;
  next.codecs = running.codecs;
  next.logging = running.logging;
  next.kv_store.eviction = running.kv_store.eviction;
  next.scheduler = running.scheduler;
  next.ucx = running.ucx;
  visit_limits([&](Applies applies, const char*, auto member) {
    if (applies == Applies::kOnRestart) next.limits.*member = running.limits.*member;
  });
}

bool same_route(const RoutePolicy& left, const RoutePolicy& right) {
  PolicyChanges changes;
  Diff diff(changes);
  diff_route(diff, "", left, right);
  return left.id == right.id && changes.live.empty() && changes.restart_required.empty();
}

}  // namespace kvrelay::proxy
