#pragma once

// The daemon's KV path behind the worker data plane. For each lookup it reads the request's
// kv_transfer_params.kvrelay (request id, agent, route, audit treatment), picks the route and the
// medium (treatment, else the route's forced medium, else the decision engine), then serves the
// longest prefix it can: from this sidecar's store, or fetched from the peer that holds it,
// encoded with the medium's codec and decoded here. Media that need KV never cross models with
// different fingerprints; "tokens" is a miss (the worker prefills). Every decision is logged
// with its cost breakdown. On publish, routes marked push send the KV ahead to the destination.

#include <nlohmann/json.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/metrics.h"
#include "kvrelay/decision/decision_engine.h"
#include "kvrelay/decision/engine_from_policy.h"
#include "kvrelay/peer/peer_server.h"
#include "kvrelay/broker/policy_source.h"
#include "kvrelay/shm_transport/server.h"

#include "kvrelay/broker/decision_log.h"
#include "kvrelay/broker/handoff_outcomes.h"
#include "kvrelay/broker/peer_links.h"

namespace kvrelay::broker {

// An audit treatment as the front proxy injects it (kv_transfer_params.kvrelay.treatment).
struct Treatment {
  std::string name;                            // "T0", "T1", ...
  std::string medium;                          // "tokens", "kv_raw", "kv_int8", ...; "" keeps the route's choice
  std::string span;                            // "none", "prompt", "generated", "all" ("" = all)
  std::optional<std::uint64_t> prompt_tokens;  // A's prompt length; needed by span "prompt"
};

// kv_transfer_params.kvrelay as the KV path reads it.
struct RequestContext {
  std::string request_id;
  std::string agent;
  std::string route;                // explicit route id, if the caller named one
  std::vector<std::string> routes;  // the front proxy's candidate routes into this agent
  std::optional<Treatment> treatment;
  std::optional<std::uint32_t> max_tokens;  // the request's answer budget, when the client set one
};
// "" parses to an empty context. Every field is type-checked; errors name the field.
[[nodiscard]] Result<RequestContext> parse_request_context(std::string_view params_json);

class KvPath final : public shm::DataPlaneHooks {
 public:
  KvPath(std::shared_ptr<PolicySource> policy, std::shared_ptr<kv_store::EntryStore> store,
         std::shared_ptr<const codec::CodecRegistry> codecs, std::shared_ptr<PeerLinks> peers,
         metrics::Registry& registry);
  ~KvPath() override;
  KvPath(const KvPath&) = delete;
  KvPath& operator=(const KvPath&) = delete;

  [[nodiscard]] Result<shm::ResolvedEntry> resolve(const shm::ResolveRequest& request) override;
  void published(const kv_store::EntryKey& key, const std::shared_ptr<const kv_store::StoredEntry>& entry,
                 std::string_view params_json) override;
  void prefill_observed(const shm::PrefillReport& report) override;

  // Encoded KV the peer server served or received (its on_kv_bytes callback): counted, and its
  // encode (served) or decode (received) time fed to the engine.
  void record_peer_kv(const peer::KvBytesEvent& event);
  // A probe's RTT to `peer`, for the engine's link estimates.
  void observe_peer_rtt(const std::string& peer, double seconds);
  // The agent's engine load from its metrics page (UpstreamProber), for the engine's compute term.
  void observe_load(const std::string& agent, double requests_waiting);
  // The agent's recent time per output token (UpstreamProber), pricing a lossy medium's extra decode.
  void observe_decode(const std::string& agent, double seconds_per_token);
  // Drops every entry of this sidecar's store (DELETE /admin/kv); returns what was dropped.
  kv_store::EntryStoreStats clear_store() { return store_->clear(); }

  [[nodiscard]] const DecisionLog& decisions() const { return log_; }
  [[nodiscard]] PeerLinks& peers() { return *peers_; }
  // Entries this path makes (fetched, joined, sliced, converted) go here when it has room.
  // Set before the data plane starts serving.
  void set_arena(std::shared_ptr<kv_store::ShmArena> arena) { arena_ = std::move(arena); }

 private:
  // What this sidecar's own encode or decode of `codec` (a spec: "int4+zstd") cost, for the
  // engine's codec estimates; nullopt leaves that side out (serving times encodes, fetching and
  // receiving pushes time decodes). Raw KV has no codec cost and is ignored.
  void observe_codec(std::string_view codec, DType dtype, std::uint64_t raw_bytes, std::uint64_t frame_bytes,
                     std::optional<double> encode_s, std::optional<double> decode_s);

  std::shared_ptr<kv_store::ShmArena> arena_;
  struct Choice {
    std::string medium;
    std::string source;  // treatment, forced, engine, default
    std::string reason;
    nlohmann::json cost;  // the engine's breakdown (chosen vs alternatives), null without a route
    // The engine chose tokens for what the receiver lacks: the prefix this node already holds is
    // still served (the engine priced tokens as a prefill of the missing part only).
    bool serve_held_prefix = false;
  };
  struct PushJob {
    std::string route;
    std::string peer;
    std::string medium;
    std::string codec;
    kv_store::EntryKey key;
    std::shared_ptr<const kv_store::StoredEntry> entry;
    nlohmann::json record;
  };
  struct Metrics {
    explicit Metrics(metrics::Registry& registry);
    metrics::Family<metrics::Counter>& decisions;
    metrics::Family<metrics::Histogram>& decision_seconds;
    metrics::Family<metrics::Counter>& lookups;
    metrics::Family<metrics::Counter>& wire_bytes;
    metrics::Family<metrics::Counter>& raw_bytes;
    metrics::Family<metrics::Histogram>& fetch_seconds;
    metrics::Family<metrics::Counter>& pushes;
    metrics::Family<metrics::Counter>& prefill_reports;
  };

  // `held_tokens`: the leading part of the context this node's store already holds.
  [[nodiscard]] Choice choose(const Policy& policy, const RoutePolicy* route, const RequestContext& context,
                              std::uint64_t context_tokens, std::uint64_t held_tokens);
  struct EngineChoice {
    std::string medium;
    std::string reason;
  };
  // The engine's view of `route` for `tokens`; decide() only when the engine's choice is used.
  [[nodiscard]] std::optional<EngineChoice> run_engine(const Policy& policy, const RoutePolicy& route,
                                                       decision::TransferShape shape, bool commit,
                                                       nlohmann::json& cost);
  void ensure_engine_locked(const Policy& policy);
  // Brings the engine up to `policy`: its live settings applied, or a new engine when the
  // topology changed or the settings did not apply (learned estimates reset).
  [[nodiscard]] EngineUpdate refresh_engine_locked(const Policy& policy);
  [[nodiscard]] EngineUpdate update_engine_locked(const Policy& policy);  // refresh's work, unrecorded
  struct Fetched {
    std::shared_ptr<const kv_store::StoredEntry> entry;
    std::size_t blocks = 0;
    std::string peer;
  };
  // Fetches the blocks after the `held_blocks` this sidecar holds (`held`, may be null) and returns
  // the whole prefix: a delta fetch joined to what was held, or a full fetch without a held prefix.
  // Everything, from connecting to decoding, by `deadline` (the lookup's); past it, nullopt.
  [[nodiscard]] std::optional<Fetched> fetch_from_peers(const Policy& policy, const shm::ResolveRequest& request,
                                                        const std::shared_ptr<const kv_store::StoredEntry>& held,
                                                        std::size_t held_blocks, const std::string& codec,
                                                        const std::string& medium, const std::string& route,
                                                        peer::Deadline deadline, nlohmann::json& record);
  void run_pusher();

  std::shared_ptr<PolicySource> policy_;
  std::shared_ptr<kv_store::EntryStore> store_;
  std::shared_ptr<const codec::CodecRegistry> codecs_;
  std::shared_ptr<PeerLinks> peers_;
  Metrics metrics_;
  DecisionLog log_;
  HandoffOutcomes outcomes_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  const double copy_bytes_per_s_;

  std::mutex engine_mutex_;
  std::optional<decision::DecisionEngine> engine_;
  std::string engine_signature_;
  // The snapshot the engine's settings were last applied from (held, so its address stays its own).
  std::shared_ptr<const Policy> engine_policy_;
  EngineUpdate last_engine_update_;                         // what the refresh for engine_policy_ did
  const std::vector<decision::PluginCodec> loaded_codecs_;  // what "codec:<name>" media can use

  std::mutex push_mutex_;
  std::condition_variable push_wake_;
  std::deque<PushJob> push_queue_;
  bool stopping_ = false;
  std::thread pusher_;
};

}  // namespace kvrelay::broker
