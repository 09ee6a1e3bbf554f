#pragma once

// The daemon's KV path behind the worker data plane. For each lookup it reads the request's
// kv_transfer_params.kvrelay (request id, agent, route, audit treatment), picks the route and the
// medium (treatment, else the route's forced medium, else the decision engine), then serves the
// longest prefix it can: from this sidecar's store, or fetched from the peer that holds it,
// encoded with the medium's codec and decoded here. Media that need KV never cross models with
// different fingerprints; "tokens" is a miss (the worker prefills). Every decision is logged
// with its cost breakdown. On publish, routes marked push send the KV ahead to the destination.
// KvPath only orchestrates the four stages (docs/architecture.md, "The broker's stages"):
// plan (src/plan.h), fetch (src/fetcher.h), materialize (src/materialize.h), record (src/record.h).

#include <nlohmann/json.hpp>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>

#include "kvrelay/broker/decision_log.h"
#include "kvrelay/broker/deliveries.h"
#include "kvrelay/broker/engine_advisor.h"
#include "kvrelay/broker/handoff_outcomes.h"
#include "kvrelay/broker/kv_path_metrics.h"
#include "kvrelay/broker/live_calibration.h"
#include "kvrelay/broker/peer_links.h"
#include "kvrelay/broker/policy_source.h"
#include "kvrelay/broker/request_context.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/metrics.h"
#include "kvrelay/decision/decision_engine.h"
#include "kvrelay/decision/engine_from_policy.h"
#include "kvrelay/peer/peer_server.h"
#include "kvrelay/shm_transport/server.h"

namespace kvrelay::broker {

class Fetcher;
struct LookupPlan;

class KvPath final : public shm::DataPlaneHooks, private EngineAdvisor {
 public:
  KvPath(std::shared_ptr<PolicySource> policy, std::shared_ptr<kv_store::EntryStore> store,
         std::shared_ptr<const codec::CodecRegistry> codecs, std::shared_ptr<PeerLinks> peers,
         metrics::Registry& registry);
  ~KvPath() override;
  KvPath(const KvPath&) = delete;
  KvPath& operator=(const KvPath&) = delete;

  // Workers' kvrelay fields are verified first (broker/src/trusted_context.h); in a policy with
  // tenants, lookups read and publishes file only their verified tenant's scope (tenant_chain.h).
  [[nodiscard]] Result<shm::ResolvedEntry> resolve(const shm::ResolveRequest& worker_request) override;
  void published(const kv_store::EntryKey& worker_key, const std::shared_ptr<const kv_store::StoredEntry>& entry,
                 std::string_view params_json) override;
  void prefill_observed(const shm::PrefillReport& report) override;
  // A same-host peer (identified by SO_PEERCRED) gets what its TCP fetch would: entries of the
  // models its agents use (peer::authorize_fetch); anything else is a miss, counted as a refusal.
  [[nodiscard]] Status authorize_peer_lookup(std::string_view peer_id, const kv_store::EntryKey& key,
                                             const kv_store::StoredEntry& entry) override;

  // Encoded KV the peer server served or received (its on_kv_bytes callback): counted, and its
  // encode (served) or decode (received) time fed to the engine.
  void record_peer_kv(const peer::KvBytesEvent& event);
  // A probe's RTT to `peer`, for the engine's link estimates.
  void observe_peer_rtt(const std::string& peer, double seconds);
  // A bandwidth probe's `bytes` from `peer` in `seconds`, for the engine's link estimates.
  void observe_peer_transfer(const std::string& peer, std::uint64_t bytes, double seconds);
  // The agent's engine load from its metrics page (UpstreamProber), for the engine's compute term.
  void observe_load(const std::string& agent, double requests_waiting);
  // The agent's recent time per output token (UpstreamProber), pricing a lossy medium's extra decode.
  void observe_decode(const std::string& agent, double seconds_per_token);
  // Drops every entry of this sidecar's store (DELETE /admin/kv); returns what was dropped.
  kv_store::EntryStoreStats clear_store() { return store_->clear(); }

  // Issue #28, the summary medium (docs/summary.md): what the front proxy asks before B's request
  // leaves, on its io thread (no I/O). The leading tokens of B's prompt that A's published KV
  // covers: whole blocks of kDefaultBlockTokens, hashed from `chain_root` with the fingerprint id
  // the route's from-agent's worker publishes under (the policy's until it has published), scoped
  // to `tenant` in a policy with tenants; this node's store and the peers' last summaries, by the
  // one prefix scan.
  struct HandoffSpan {
    std::uint64_t tokens = 0;
    // Of those, what B could take from this node's store as it is (same model, exact KV): the
    // engine prices the other media for the rest, as a lookup would.
    std::uint64_t receiver_cached = 0;
  };
  [[nodiscard]] HandoffSpan handoff_span(const Policy& policy, const RoutePolicy& route,
                                         std::span<const TokenId> prompt, BlockHash chain_root,
                                         const std::string& tenant);
  // The engine's choice for such a handoff without any state change (predict()); nullopt without
  // an engine. `cost` receives the breakdown.
  [[nodiscard]] std::optional<EngineAdvice> predict_handoff(const Policy& policy, const RoutePolicy& route,
                                                            const decision::TransferShape& shape, nlohmann::json& cost);
  // A summary the front proxy made or tried ({"kind": "summary", ...}): logged, counted by route
  // and outcome (summarised, failed, skipped), and a successful call's time fed to the engine.
  void record_summary(nlohmann::json record, const std::string& route, std::string_view outcome,
                      std::optional<double> summariser_seconds);

  [[nodiscard]] const DecisionLog& decisions() const { return log_; }
  // Issue #27's store traffic this path saw since start (GET /admin/kv; metrics have them by route).
  struct StoreTraffic {
    std::uint64_t prefetches_sent = 0;      // prefetches a peer filed
    std::uint64_t prefetch_hits = 0;        // local lookups served from prefetched KV
    std::uint64_t fetch_backs = 0;          // lookups that fetched a spilled entry back
    std::uint64_t next_agents_ignored = 0;  // next_agents no route of the agent leads to
  };
  [[nodiscard]] StoreTraffic store_traffic() const;
  // Where the link queues log their preemptions and deadline raises ({"kind":"schedule"}).
  [[nodiscard]] DecisionLog& decision_log() { return log_; }
  [[nodiscard]] PeerLinks& peers() { return *peers_; }
  // Entries this path makes (fetched, joined, sliced, converted) go here when it has room.
  // Set before the data plane starts serving.
  void set_arena(std::shared_ptr<kv_store::ShmArena> arena) { arena_ = std::move(arena); }
  // An audited request of `route` ended: its time to first token against what the engine
  // predicted at its lookup. Routes with audit.calibrate "live" refit the engine's audit
  // corrections every calibrate_window outcomes (live_calibration.h; each refit logged).
  void observe_audited_outcome(const std::string& route, const Delivery& delivery, double ttft_s);
  // The refits so far and the outcomes waiting in each route's window (GET /admin/audit/calibration).
  [[nodiscard]] nlohmann::json live_calibration() const { return calibration_.snapshot(); }
  // Where lookups file what they delivered of audited requests' treatments (the front proxy
  // takes it with the outcome). Set before the data plane starts serving.
  void set_deliveries(std::shared_ptr<Deliveries> deliveries) { deliveries_ = std::move(deliveries); }

 private:
  // What this sidecar's own encode or decode of `codec` (a spec: "int4+zstd") cost, for the
  // engine's codec estimates; nullopt leaves that side out (serving times encodes, fetching and
  // receiving pushes time decodes). Raw KV has no codec cost and is ignored.
  void observe_codec(std::string_view codec, DType dtype, std::uint64_t raw_bytes, std::uint64_t frame_bytes,
                     std::optional<double> encode_s, std::optional<double> decode_s);

  std::shared_ptr<kv_store::ShmArena> arena_;
  std::shared_ptr<Deliveries> deliveries_;
  struct PushJob {
    std::string route;
    std::string peer;
    std::string medium;
    std::string codec;
    peer::PushPurpose purpose = peer::PushPurpose::kPush;
    kv_store::EntryKey key;
    std::shared_ptr<const kv_store::StoredEntry> entry;
    nlohmann::json record;
  };
  // The engine's view of `route` for a transfer; decide() only when the engine's choice is used.
  [[nodiscard]] std::optional<EngineAdvice> advise(const Policy& policy, const RoutePolicy& route,
                                                   decision::TransferShape shape, bool commit,
                                                   nlohmann::json& cost) override;
  void ensure_engine_locked(const Policy& policy);
  // Brings the engine up to `policy`: its live settings applied, or a new engine when the
  // topology changed or the settings did not apply (learned estimates reset).
  [[nodiscard]] EngineUpdate refresh_engine_locked(const Policy& policy);
  [[nodiscard]] EngineUpdate update_engine_locked(const Policy& policy);  // refresh's work, unrecorded
  void run_pusher();
  // One queued push or prefetch: only the blocks the destination's summary does not list, the
  // whole entry again if it answers that the prefix is gone; recorded and counted.
  void push_one(PushJob& job);
  // Whether a lookup's fetch attempts show that the stub's peer no longer holds the spilled entry.
  [[nodiscard]] bool stub_gone(const kv_store::Stub& stub, const nlohmann::json& attempts,
                               const LookupPlan& plan) const;
  // Encodes the entry after `skip_tokens` with the job's codec and pushes it; the frame's bytes.
  [[nodiscard]] Result<std::uint64_t> send_push(const PushJob& job, std::uint64_t skip_tokens, const Policy& policy);
  // A publish's entry sent ahead on `route` to `to`'s node: pushed (the route says push) or
  // prefetched at background priority (issue #27); priced and queued for the pusher.
  void send_ahead(const Policy& policy, const RoutePolicy& route, const AgentPolicy& to,
                  const RequestContext& published_context, const kv_store::EntryKey& key,
                  const std::shared_ptr<const kv_store::StoredEntry>& filed, peer::PushPurpose purpose);
  // Whether a publish prefetches on this (non-push) route: named in next_agents (or, naming none,
  // kv_store.prefetch), within prefetch_max_bytes, and the destination's store can hold it.
  [[nodiscard]] bool prefetch_wanted(const Policy& policy, const RoutePolicy& route, const RequestContext& context,
                                     const kv_store::StoredEntry& entry);
  // Where a published entry lives from now on: with tenants, moved from the worker's key to its
  // tenant's scope (tenant_chain.h), its chain naming the tenant; the worker's key otherwise.
  struct Filed {
    kv_store::EntryKey key;
    std::shared_ptr<const kv_store::StoredEntry> entry;
  };
  Filed refile_in_tenant_scope(const Policy& policy, const kv_store::EntryKey& worker_key,
                               const std::shared_ptr<const kv_store::StoredEntry>& entry, const std::string& tenant);
  // A lossy publish of a request whose lookup was served lossy KV carries that KV's fidelity
  // product (its worker attended over it): refiled under `key` with it. Otherwise, or when the
  // refiling fails, `entry` as it is (product 1: unknown, read as its codec's factor).
  std::shared_ptr<const kv_store::StoredEntry> stamp_served_product(
      const kv_store::EntryKey& key, const std::shared_ptr<const kv_store::StoredEntry>& entry,
      const std::string& request_id);

  // The fingerprint id each agent's worker last published under (its KV's model id, which the
  // policy's description of its model need not reproduce): what handoff_span hashes with.
  [[nodiscard]] std::uint64_t published_model_of(const AgentPolicy& agent) const;
  mutable std::mutex published_models_mutex_;
  std::map<std::string, std::uint64_t, std::less<>> published_models_;

  std::shared_ptr<PolicySource> policy_;
  std::shared_ptr<kv_store::EntryStore> store_;
  std::shared_ptr<const codec::CodecRegistry> codecs_;
  std::shared_ptr<PeerLinks> peers_;
  std::unique_ptr<Fetcher> fetcher_;  // the peers, behind the fetch stage's interface
  KvPathMetrics metrics_;
  DecisionLog log_;
  HandoffOutcomes outcomes_;
  LiveCalibration calibration_;
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
  std::deque<PushJob> prefetch_queue_;  // served when push_queue_ is empty
  bool stopping_ = false;
  std::thread pusher_;
};

}  // namespace kvrelay::broker
