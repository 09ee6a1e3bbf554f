#pragma once

// Sending end of the TCP peer plane, with a blocking API (it runs its own event loop on the
// calling thread) for the CLI, the daemon's transfer workers, tests and benchmarks.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"
#include "kvrelay/core/warm_buffers.h"
#include "kvrelay/peer/fidelity_product.h"
#include "kvrelay/peer/link_estimator.h"
#include "kvrelay/peer/link_gate.h"
#include "kvrelay/peer/peer_protocol.h"
#include "kvrelay/peer/peer_tls.h"
#include "kvrelay/peer/ucx_transport.h"

namespace kvrelay::peer {

// When a whole exchange (a lookup: connect, hello, request, every read) must be over. Each wait
// in it ends at the sooner of its own timeout and this; max(): no bound beyond the timeouts.
using Deadline = std::chrono::steady_clock::time_point;

struct PeerClientOptions {
  std::string node_id = "kvrelay-client";
  std::chrono::milliseconds connect_timeout{3'000};
  std::chrono::milliseconds read_timeout{5'000};
  std::uint32_t chunk_bytes = 1U << 20;
  // Chunks of a push sent but not yet acknowledged (at most kMaxWindowChunks).
  std::uint32_t window_chunks = 8;
  // Each chunk is copied by its checksum pass into one reused buffer that the socket write then
  // reads, rather than written from the caller's memory: see "staged chunks" in
  // docs/transports.md. False writes straight from the caller's memory.
  bool stage_chunks = true;
  // A push that fits one chunk goes as two halves (transfer_chunk_bytes in peer_protocol.h).
  bool split_single_chunk = true;
  std::uint64_t rate_limit_bytes_per_s = 0;  // 0: unlimited, for pushes
  // Called after each acknowledgement of a push with (bytes acknowledged, total bytes), and after
  // each chunk of a fetch reply checked with (bytes received, total bytes).
  std::function<void(std::uint64_t, std::uint64_t)> on_progress;
  // Where RTT and throughput samples go (optional); keyed by the remote node id.
  std::shared_ptr<LinkEstimator> link_estimator;
  // Where fetched frames are received (optional: without it each fetch gets a fresh buffer,
  // which on some hosts costs more in first-touch page faults than the transfer).
  std::shared_ptr<WarmBufferPool> frame_buffers;
  // Issue #25. Set: the connection is TLS (handshake within connect_timeout, before the hello),
  // and the peer's certificate must name `identity` (a DNS or URI SAN) or the connect fails.
  std::shared_ptr<PeerTls> tls;
  std::string identity;
  // Issue #27: the fidelity factor of the codec a push is encoded with (lossless codecs: 1); a
  // push carries effective(entry) x factor (fidelity_product.h). Unset: 1.
  CodecFactor codec_factor;
  // Issue #27: the link scheduler each push asks before every chunk (link_gate.h), tagged with
  // the peer's node id, the route and the push's purpose. Unset: pushes are not scheduled.
  std::shared_ptr<LinkGate> gate;
  // Issue #29. Set: chunk streams (fetch replies, pushes) go over UCX with this context, on a
  // worker of this client's own; the connect fails unless the peer offers UCX (kCapUcx).
  std::shared_ptr<UcxContext> ucx;
};

// How a push is sent (PeerClient::push_encoded).
struct PushOptions {
  std::string route;  // the route it is pushed on, which the peer authorizes ("" names none)
  PushPurpose purpose = PushPurpose::kPush;
  // Leading tokens of the chain the frame leaves out because the peer holds them (0: the whole
  // entry). Today's receivers refuse deltas with kUnsupported.
  std::uint64_t skip_tokens = 0;
  // The pushed entry's fidelity and the codec spec the frame was encoded with: the push carries
  // stamped_product(source, codec) (fidelity_product.h). Defaults: exact KV, product 1.
  Fidelity source{};
  std::string codec{};
  // Set: where a committed push leaves the time the link was busy with it (request to Committed,
  // without waiting for the link scheduler's grants), which is what the link estimate takes.
  std::chrono::microseconds* busy = nullptr;
};

// Client options for talking to `peer` under `policy`: our node id, the policy's read timeout
// and chunk staging.
[[nodiscard]] PeerClientOptions peer_client_options(const Policy& policy);

class PeerClient {
 public:
  ~PeerClient();
  PeerClient(PeerClient&&) noexcept;
  PeerClient& operator=(PeerClient&&) noexcept;

  // Connects and exchanges hellos, all of it by `deadline` (a kTimeout naming the stage if not).
  [[nodiscard]] static Result<PeerClient> connect(const HostPort& address, PeerClientOptions options,
                                                  Deadline deadline = Deadline::max());

  [[nodiscard]] const Hello& remote() const;
  // What the TLS handshake verified of the peer's certificate (empty names: plaintext).
  [[nodiscard]] const PeerCertificate& remote_certificate() const;
  // How this connection's chunk streams travel: "tcp" or "ucx"; and UCX's lanes for them.
  [[nodiscard]] std::string_view transport() const;
  [[nodiscard]] std::vector<std::string> transport_lanes() const;
  [[nodiscard]] Result<std::chrono::microseconds> ping();
  // Asks the peer for `bytes` (1..kMaxProbeBytes) of filler and times them to the last byte,
  // request included; the link estimator gets it as a transfer (issue #27's bandwidth probe).
  [[nodiscard]] Result<std::chrono::microseconds> probe_bandwidth(std::uint32_t bytes);

  // The longest prefix of `request.hashes` the peer holds, as an encoded KV frame filed under
  // `key` (nullopt: the peer holds none). A frame announced larger than `max_frame_bytes` is
  // refused before anything is allocated for it. Request, reply and every chunk by `deadline`:
  // past it the fetch fails with kTimeout naming its stage, and the connection (left
  // mid-frame) is broken, never reused.
  struct FetchedFrame {
    kv_store::EntryKey key;
    // The token ids of the whole prefix the key names, as the source sent them: unverified until
    // the asker recomputes the chain (broker's fetch stage).
    kv_store::EntryChain chain;
    WarmBufferPool::Lease buffer;  // holds the frame (its first frame_bytes); back to frame_buffers when dropped
    std::size_t frame_bytes = 0;
    [[nodiscard]] std::span<const std::uint8_t> frame() const { return buffer.u8().first(frame_bytes); }
    // From sending the request to the reply's header: the peer's lookup, read and encode, plus
    // one round trip. Then the chunks themselves, checksums included.
    std::chrono::microseconds reply_wait{};
    std::chrono::microseconds transfer{};
    // How the KV came: "tcp" or "ucx" (this client), or "shm" where a same-host peer's data plane
    // handed it over (broker::PeerLinks); `transport_note` says why a same-host fetch used TCP.
    std::string transport = "tcp";
    std::string transport_note;
    // The fidelity product the source stamped on the KV (issue #27): 1 for exact KV.
    double fidelity_product = 1.0;
  };
  [[nodiscard]] Result<std::optional<FetchedFrame>> fetch(const FetchRequest& request, std::uint64_t max_frame_bytes,
                                                          Deadline deadline = Deadline::max());
  // Sends an encoded KV frame (codec_plugins frame format) to the peer as a chunk stream; the
  // peer decodes it, checks that `chain` (the token ids of the frame's KV) hashes to `key`, files
  // it there by the frame's codec (lossy KV as lossy) and answers Committed. `frame` must stay
  // valid until this returns. `route`: the route it is pushed on, which the peer authorizes (a
  // peer whose policy lists peers refuses a push that names none).
  [[nodiscard]] Status push_encoded(std::uint64_t transfer_id, const kv_store::EntryKey& key,
                                    const kv_store::EntryChain& chain, std::span<const std::uint8_t> frame,
                                    std::string_view route = {});
  // The same with a purpose, a delta and the entry's fidelity (PushOptions).
  [[nodiscard]] Status push_encoded(std::uint64_t transfer_id, const kv_store::EntryKey& key,
                                    const kv_store::EntryChain& chain, std::span<const std::uint8_t> frame,
                                    const PushOptions& push);
  // The keys the peer holds, most recently used first.
  [[nodiscard]] Result<std::vector<kv_store::EntryKey>> summary();
  // The same with the peer's NodeState (summary v2).
  [[nodiscard]] Result<SummaryReply> summary_reply();
  [[nodiscard]] Result<PeerServerStats> stats();

  struct State;  // defined in peer_client.cpp

 private:
  explicit PeerClient(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace kvrelay::peer
