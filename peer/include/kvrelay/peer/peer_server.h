#pragma once

// Serving end of the TCP peer plane: accepts sidecar connections, answers hellos, pings, stats
// and summaries, serves fetches as chunk streams, and receives pushed KV frames. A pushed frame
// is decoded and filed in the entry store only after every chunk's running checksum verified,
// so the store never holds part of one.

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"
#include "kvrelay/kv_store/entry_store.h"
#include "kvrelay/peer/fidelity_product.h"
#include "kvrelay/peer/link_gate.h"
#include "kvrelay/peer/peer_protocol.h"
#include "kvrelay/peer/peer_tls.h"
#include "kvrelay/peer/ucx_transport.h"

namespace kvrelay::peer {

struct KvBytesEvent {
  std::string_view direction;  // "served" (a fetch answered) or "received" (a push filed)
  std::string_view codec;      // codec spec, e.g. "int4+zstd"
  std::uint64_t frame_bytes = 0;
  std::uint64_t raw_bytes = 0;
  DType dtype = DType::kFloat16;
  // This sidecar's encode ("served") or decode ("received") time, for the decision engine.
  double codec_seconds = 0.0;
};

struct PeerServerOptions {
  std::string node_id;
  std::string shm_socket;  // advertised to same-host peers when set
  std::chrono::milliseconds handshake_timeout{5'000};
  std::chrono::milliseconds read_timeout{5'000};   // inside a frame or a transfer
  std::chrono::milliseconds idle_timeout{60'000};  // between frames outside transfers
  std::uint64_t max_entry_bytes = 64ULL << 30;     // larger transfers are refused up front
  // Buffers that fetches are read and encoded into (and pushed frames received into) are kept
  // for the next one up to this many bytes in all (at most 4 buffers): fresh ones cost a
  // first-touch page fault per 4 KiB on hosts with lazily built page tables.
  std::uint64_t warm_buffer_bytes = 192ULL << 20;
  // Where received entries go when it has room (the shm server's arena); else sealed memfds.
  std::shared_ptr<kv_store::ShmArena> arena;
  // Fetch replies: chunk size (at most what the asker's hello allows), chunks in flight, and
  // whether each chunk is staged through a reused buffer (see "staged chunks" in peer_io.h).
  std::uint32_t chunk_bytes = 1U << 20;
  std::uint32_t window_chunks = 8;
  bool stage_chunks = true;
  // Encodes fetched entries and decodes pushed ones; without it Fetch and PushEncoded are refused.
  std::shared_ptr<const codec::CodecRegistry> codecs;
  // Encoded KV that left ("served") or arrived ("received"), with what its codec cost here.
  std::function<void(const KvBytesEvent& event)> on_kv_bytes;
  // Issue #25. Set: every session is TLS, its handshake (within handshake_timeout) before any
  // frame is read, and the client's certificate must name a policy peer's identity.
  std::shared_ptr<PeerTls> tls;
  // The live policy, which says who may connect, push and fetch (peer_authorization.h). Unset:
  // no authorization (protocol tests without a policy).
  std::function<std::shared_ptr<const Policy>()> policy;
  // Each refusal: "handshake" (TLS failed), "identity" (a certificate or hello the policy does
  // not know), "push", "spill" or "fetch" (not authorized), "ucx" (UCX asked for off loopback
  // without ucx.trusted_network), "ucx_token" (an active message from a UCX endpoint that
  // presented no valid token). Connections refused at the handshake or
  // identity were closed before any frame was read.
  std::function<void(std::string_view reason)> on_refused;
  // Issue #27. The fidelity factor of the codec a fetch reply is encoded with: the reply carries
  // effective(entry) x factor (fidelity_product.h), and a Fetch whose min_fidelity_product is
  // above that is answered "not found". Lossless codecs count 1 whatever it says. Unset: 1.
  CodecFactor codec_factor;
  // Summaries' NodeState: the store's budget (limits.kv_store_bytes; 0: unknown); its use, the
  // arena's, the transfers in progress and the asker's spill room (its accept_spill_bytes less
  // its spills held here) are read here. `node_state` may then fill in what only the daemon
  // knows, per asking peer (its link rates).
  std::uint64_t store_budget_bytes = 0;
  std::function<void(std::string_view peer_id, NodeState& state)> node_state;
  // Issue #27: the link scheduler every fetch reply asks before each chunk (link_gate.h), tagged
  // with the asker's node id, the route and deadline it names. Unset: replies are not scheduled.
  std::shared_ptr<LinkGate> gate;
  // Issue #29. Set: UCX is offered (kCapUcx) and a session that asks (UcxOpen) moves its chunk
  // streams over it, on one of `ucx_workers` workers (one per I/O thread), each progressed on a
  // strand of the io_context. UCX carries KV in plaintext: it is offered to a connection from a
  // loopback address only, unless `ucx_trusted_network`.
  std::shared_ptr<UcxContext> ucx;
  unsigned ucx_workers = 1;
  bool ucx_trusted_network = false;
};

class PeerServer {
 public:
  PeerServer(boost::asio::io_context& io, PeerServerOptions options, std::shared_ptr<kv_store::EntryStore> store);
  ~PeerServer();
  PeerServer(const PeerServer&) = delete;
  PeerServer& operator=(const PeerServer&) = delete;

  [[nodiscard]] Status listen(const HostPort& address);
  [[nodiscard]] boost::asio::ip::tcp::endpoint local_endpoint() const;
  // Stops accepting and closes every session (their transfers fail, nothing partial is kept).
  void stop();
  [[nodiscard]] PeerServerStats stats() const;
  // Active messages refused on the UCX workers: endpoints that presented no valid token first.
  [[nodiscard]] std::uint64_t ucx_refused_endpoints() const;

  struct Shared;  // state shared with sessions, which may outlive this object briefly

 private:
  boost::asio::io_context& io_;
  std::shared_ptr<Shared> shared_;
};

}  // namespace kvrelay::peer
