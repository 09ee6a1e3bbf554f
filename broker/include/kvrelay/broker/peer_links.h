#pragma once

// The daemon's connections to its peers for the KV path: one client per peer and purpose (fetch,
// push, probe) so a long push never delays a lookup's fetch; a background prober that pings
// each peer (RTT) and asks which KV chains it holds (summaries); and the view /admin/peers shows.
// A same_host peer's KV comes over shared memory, through its sidecar's data plane, when its
// hello offers one; over TCP (and the fetch says why) when not.

#include <nlohmann/json.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kvrelay/broker/policy_source.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/metrics.h"
#include "kvrelay/core/warm_buffers.h"
#include "kvrelay/peer/link_estimator.h"
#include "kvrelay/peer/peer_client.h"
#include "kvrelay/shm_transport/client.h"

namespace kvrelay::broker {

class PeerLinks {
 public:
  PeerLinks(std::shared_ptr<PolicySource> policy, metrics::Registry& registry);
  ~PeerLinks();
  PeerLinks(const PeerLinks&) = delete;
  PeerLinks& operator=(const PeerLinks&) = delete;

  // Called with (peer id, RTT seconds) after each probe; set before start().
  void set_rtt_observer(std::function<void(const std::string&, double)> observer) { on_rtt_ = std::move(observer); }
  // Called with (peer id, bytes, seconds) after each bandwidth probe; set before start().
  void set_probe_observer(std::function<void(const std::string&, std::uint64_t, double)> observer) {
    on_probe_ = std::move(observer);
  }
  // TLS for every peer connection (issue #25; the policy's peer_tls); set before start().
  void set_tls(std::shared_ptr<peer::PeerTls> tls) { tls_ = std::move(tls); }
  // The codec fidelity factors pushes are stamped with (issue #27); set before start().
  void set_codec_factor(peer::CodecFactor factor) { codec_factor_ = std::move(factor); }
  // The link scheduler pushes ask before each chunk (issue #27); set before start().
  void set_gate(std::shared_ptr<peer::LinkGate> gate) { gate_ = std::move(gate); }
  // The UCP context for peers whose policy entry says transport "ucx" (issue #29); set before
  // start(). Without it such a peer's connects fail, naming why.
  void set_ucx(std::shared_ptr<peer::UcxContext> ucx) { ucx_ = std::move(ucx); }
  // Counts a connection or request the peer server refused (PeerServerOptions::on_refused).
  void note_refused(std::string_view reason) { refused_.with({std::string(reason)}).inc(); }
  // Starts the prober (every limits.peer_summary_interval_ms; 0: no background probing).
  void start();
  void stop();

  // Peer ids to ask for a chain, those whose last summary lists one of `hashes` first.
  [[nodiscard]] std::vector<std::string> candidates(std::uint64_t model_id, std::span<const std::uint64_t> hashes);
  // The longest prefix of the chain `request` names that the peer holds, as a frame of
  // request.codec (nullopt: none), all of it (connect, hello, every read, the encode of a
  // shared-memory fetch) by `deadline`; past it a kTimeout names the stage. Each wait is also
  // bounded by limits.read_timeout. `codecs` encode what a same-host peer hands over.
  [[nodiscard]] Result<std::optional<peer::PeerClient::FetchedFrame>> fetch(const std::string& peer_id,
                                                                            const peer::FetchRequest& request,
                                                                            peer::Deadline deadline,
                                                                            std::uint64_t max_frame_bytes,
                                                                            const codec::CodecRegistry& codecs);
  // `route`: the route it is pushed on, which the peer authorizes; `chain`: the frame's token
  // ids, which the peer checks against `key`.
  [[nodiscard]] Status push(const std::string& peer_id, std::string_view route, std::uint64_t transfer_id,
                            const kv_store::EntryKey& key, const kv_store::EntryChain& chain,
                            std::span<const std::uint8_t> frame, std::chrono::milliseconds timeout);
  // The same with a purpose, a delta and the pushed entry's fidelity and codec, from which the
  // push's fidelity product is stamped (peer::PushOptions).
  [[nodiscard]] Status push(const std::string& peer_id, const peer::PushOptions& options, std::uint64_t transfer_id,
                            const kv_store::EntryKey& key, const kv_store::EntryChain& chain,
                            std::span<const std::uint8_t> frame, std::chrono::milliseconds timeout);
  // Asks every peer now (what the prober does each interval).
  void probe_all();

  [[nodiscard]] std::optional<peer::LinkEstimate> estimate(const std::string& peer_id) const;
  // How many leading blocks of a chain the peer holds as an entry, by its last summary: the
  // largest i such that the key of block i - 1 (`keys`, first block first) is listed; 0 for none.
  [[nodiscard]] std::size_t held_prefix_blocks(const std::string& peer_id, std::uint64_t model_id,
                                               std::span<const std::uint64_t> keys) const;
  // The longest chain prefix of `hashes` (block 0 first) any peer's last summary lists, with that
  // entry's effective fidelity product (the most exact peer's at that length); nullopt for none.
  struct HeldElsewhere {
    std::size_t blocks = 0;
    double product = 1.0;
    std::string peer;
  };
  [[nodiscard]] std::optional<HeldElsewhere> longest_held(std::uint64_t model_id,
                                                          std::span<const std::uint64_t> hashes) const;
  // What the peer said of its resources in its last summary (summary v2); nullopt before one.
  [[nodiscard]] std::optional<peer::NodeState> node_state(const std::string& peer_id) const;
  // Where fetched frames land, and what the KV path decodes and joins them in: kept warm between
  // fetches (at most kWarmBuffers buffers, limits.peer_buffer_bytes bytes as of construction).
  static constexpr std::size_t kWarmBuffers = 4;
  [[nodiscard]] WarmBufferPool& buffers() { return *buffers_; }
  [[nodiscard]] nlohmann::json describe() const;

 private:
  enum Purpose : std::size_t { kFetch = 0, kPush = 1, kProbe = 2, kPurposes = 3 };
  struct Slot {
    std::mutex mutex;
    std::optional<peer::PeerClient> client;
    std::string address;  // where and how `client` is connected: a reload that changes either drops it
  };
  // Fetches from one peer over TCP run on up to this many connections at once, so an urgent
  // lookup does not queue behind a bulk one here: the peer's link scheduler orders their replies.
  static constexpr std::size_t kFetchLanes = 4;
  struct PeerState {
    std::array<Slot, kPurposes> slots;              // slots[kFetch] is fetch lane 0
    std::array<Slot, kFetchLanes - 1> fetch_lanes;  // fetch lanes 1..
    std::atomic<std::size_t> next_lane{0};          // where a fetch waits when every lane is busy
    // A same-host peer's data plane, for fetches, and its socket: guarded by slots[kFetch].mutex
    // (same-host fetches use lane 0 only).
    std::optional<shm::ShmClient> data_plane;
    std::string data_plane_socket;
    // Guarded by PeerLinks::mutex_.
    bool reachable = false;
    std::string last_error;
    std::string remote_node;
    std::vector<std::string> ucx_lanes;  // UCX's lanes on the last connection made (transport "ucx")
    std::chrono::system_clock::time_point certificate_not_after{};  // TLS: the peer's, as last seen
    // The keys its last summary listed, with the effective fidelity product of each entry.
    std::unordered_map<kv_store::EntryKey, double, kv_store::EntryKeyHash> held;
    std::optional<peer::NodeState> node_state;  // from the same summary as `held`
    std::chrono::steady_clock::time_point summary_time{};
    std::uint64_t fetches = 0;
    std::uint64_t pushes = 0;
    std::uint64_t failures = 0;
    // The bandwidth probe: when it last ran or a transfer was last measured, and the transfers
    // counted then.
    std::chrono::steady_clock::time_point measured_at{};
    std::uint64_t transfers_at_measure = 0;
  };
  // The longest prefix of `keys` (block 0 first) the peer's last summary lists: blocks, product.
  [[nodiscard]] static std::optional<std::pair<std::size_t, double>> listed_prefix(const PeerState& state,
                                                                                   std::uint64_t model_id,
                                                                                   std::span<const std::uint64_t> keys);
  // Probes the link when it carried no measured transfer for limits.peer_bandwidth_probe_interval_ms.
  void maybe_probe_bandwidth(const std::string& peer_id, std::chrono::milliseconds interval);

  PeerState& state_of(const std::string& peer_id);
  // The slot a call for `purpose` runs on, locked: fetches take a free lane (any_fetch_lane), or
  // wait on one in turn; other purposes, and same-host fetches, their one slot.
  static Slot& acquire_slot(PeerState& state, Purpose purpose, bool any_fetch_lane, std::unique_lock<std::mutex>& lock);
  // Runs `call` on the peer's client for `purpose`, connecting first when needed (each wait up to
  // `timeout`, all of the connect by `deadline`); a failure drops the client (its stream
  // position is unknown) and is recorded.
  template <class Call>
  auto with_client(const std::string& peer_id, Purpose purpose, std::chrono::milliseconds timeout,
                   peer::Deadline deadline, Call call) -> decltype(call(std::declval<peer::PeerClient&>()));
  // A same_host peer's fetch on its connected `client`: over the data plane its hello names,
  // else (none offered, or it failed in time) over TCP with a note saying why. Under the fetch
  // slot's lock.
  [[nodiscard]] Result<std::optional<peer::PeerClient::FetchedFrame>> fetch_same_host(
      PeerState& state, peer::PeerClient& client, const peer::FetchRequest& request, peer::Deadline deadline,
      std::uint64_t max_frame_bytes, const codec::CodecRegistry& codecs, std::chrono::milliseconds timeout);
  void note_result(const std::string& peer_id, const Error* error);
  void run_prober();
  // kvrelay_peer_tls_certificate_expiry_seconds, for this node's certificate and each peer's seen.
  void refresh_certificate_expiry();

  std::shared_ptr<PolicySource> policy_;
  std::shared_ptr<peer::LinkEstimator> estimator_ = std::make_shared<peer::LinkEstimator>();
  std::shared_ptr<WarmBufferPool> buffers_;
  std::function<void(const std::string&, double)> on_rtt_;
  std::function<void(const std::string&, std::uint64_t, double)> on_probe_;
  mutable std::mutex mutex_;
  std::map<std::string, std::unique_ptr<PeerState>, std::less<>> peers_;
  metrics::Family<metrics::Gauge>& up_;
  metrics::Family<metrics::Gauge>& rtt_;
  metrics::Family<metrics::Gauge>& throughput_;
  metrics::Family<metrics::Gauge>& certificate_expiry_;
  metrics::Family<metrics::Counter>& refused_;
  metrics::Family<metrics::Counter>& probes_;  // {peer, result}
  std::shared_ptr<peer::PeerTls> tls_;
  peer::CodecFactor codec_factor_;
  std::shared_ptr<peer::LinkGate> gate_;
  std::shared_ptr<peer::UcxContext> ucx_;
  std::mutex stop_mutex_;
  std::condition_variable stop_wake_;
  bool stopping_ = false;
  std::thread prober_;
};

}  // namespace kvrelay::broker
