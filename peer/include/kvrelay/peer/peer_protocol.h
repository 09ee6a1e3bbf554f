#pragma once

// Frames of the sidecar <-> sidecar TCP protocol (byte layout in docs/wire-format.md,
// "Peer protocol (TCP)"). Every frame: a 12-byte header (magic, version, type, payload
// length) and a payload whose meaning depends on the type.

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/core/result.h"
#include "kvrelay/kv_store/entry.h"
#include "kvrelay/kv_store/entry_chain.h"

namespace kvrelay::peer {

inline constexpr std::uint32_t kPeerMagic = 0x5052564BU;  // "KVRP" in little-endian byte order
// The wire version, in every frame header and in the hello. Two sidecars of different versions
// refuse each other at the hello with a kError that the other side can read (see
// "Wire versions" in docs/wire-format.md); 1 was the Begin/Chunk protocol of kvrelay <= 0.1, 2
// moved KV without its token ids, 3 had no route, deadline or fidelity product in a Fetch, no
// purpose, delta or product in a push and no node state in a summary (issue #27), 4 had no
// bandwidth probe and no link rates in a summary's node state, 5 no prompt boundary in an entry's
// chain (issue #28).
inline constexpr std::uint16_t kPeerVersion = 6;
inline constexpr std::size_t kPeerHeaderBytes = 12;
inline constexpr std::size_t kChunkHeaderBytes = 20;  // transfer id, index, running checksum
inline constexpr std::uint32_t kMaxChunkBytes = 16U << 20;
inline constexpr std::uint32_t kMaxControlPayload = 64 * 1024;
inline constexpr std::uint32_t kMaxWindowChunks = 1024;
// A route id on the wire (Fetch, PushEncoded): longer ones are refused by name.
inline constexpr std::size_t kMaxRouteBytes = 256;
// FetchReply and PushEncoded carry the entry's chain of token ids as well.
inline constexpr std::uint32_t kMaxEntryHeaderPayload = kMaxControlPayload + (kv_store::kMaxChainTokens * 4);

// Capability bits announced in the hello.
inline constexpr std::uint64_t kCapSharedMemory = 1U << 1;  // hello carries a Unix socket path
// This sidecar records fidelity: it serves a lossless Fetch exact KV only, and its pushes say by
// their codec what they are. KV from a peer without it cannot be trusted as exact (an older
// sidecar files KV its workers computed over lossy imports as exact).
inline constexpr std::uint64_t kCapFidelity = 1U << 4;
// The fidelity "codec" of KV from a peer without kCapFidelity: lossy, matching no real codec.
inline constexpr std::string_view kUnverifiedFidelity = "unverified-peer";
// This sidecar moves chunk streams over UCX when asked (UcxOpen, issue #29); control frames stay here.
inline constexpr std::uint64_t kCapUcx = 1U << 5;

// Numbers 3, 4 and 18 belonged to version 1's Begin transfers and are never reused. kHello,
// kHelloOk and kError keep their numbers and layouts in every version, so that two versions can
// always tell each other why they refuse.
enum class PeerMessage : std::uint16_t {
  kHello = 1,
  kHelloOk = 2,
  kChunk = 5,
  kChunkAck = 6,   // receiver -> sender of a chunk stream: every chunk up to this index arrived intact
  kCommitted = 7,  // a pushed frame was filed
  kError = 8,
  kPing = 9,
  kPong = 10,
  kStats = 11,
  kStatsReply = 12,
  // The KV path: fetch a chain's longest held prefix encoded with a codec, push an encoded
  // entry, and ask which chains a peer holds.
  kFetch = 13,
  kFetchReply = 14,
  kPushEncoded = 15,
  kSummary = 16,
  kSummaryReply = 17,
  // An active bandwidth probe (issue #27): the asker names how many bytes (1..kMaxProbeBytes),
  // the server answers with that many filler bytes in ProbeReply frames of at most
  // kMaxControlPayload each.
  kProbe = 19,
  kProbeReply = 20,
  // Issue #29, only to a peer that announced kCapUcx: the asker wants this connection's chunk
  // streams over UCX, and sends its UCP worker address. The reply carries a per-connection token
  // and the peer's worker address; each side sends on an endpoint it dials to the other's, and
  // the asker's first active message must present the token.
  kUcxOpen = 21,
  kUcxOpenReply = 22,
};
inline constexpr std::size_t kUcxTokenBytes = 16;
struct UcxOpenReply {
  std::array<std::byte, kUcxTokenBytes> token{};
  std::vector<std::byte> worker_address;
};
// UcxOpen: u32 length, the asker's worker address. UcxOpenReply: the token, then the same.
[[nodiscard]] std::vector<std::byte> encode_ucx_open(std::span<const std::byte> worker_address);
[[nodiscard]] Result<std::vector<std::byte>> decode_ucx_open(std::span<const std::byte> payload);
[[nodiscard]] std::vector<std::byte> encode_ucx_open_reply(const UcxOpenReply& reply);
[[nodiscard]] Result<UcxOpenReply> decode_ucx_open_reply(std::span<const std::byte> payload);
inline constexpr std::uint32_t kMaxProbeBytes = 1U << 20;
[[nodiscard]] std::vector<std::byte> encode_probe(std::uint32_t bytes);
[[nodiscard]] Result<std::uint32_t> decode_probe(std::span<const std::byte> payload);
// A message this version knows (numbers outside it, or retired ones, are protocol errors).
[[nodiscard]] bool known_peer_message(std::uint16_t type) noexcept;
// The longest payload a frame of `type` may have.
[[nodiscard]] std::uint64_t max_payload_bytes(PeerMessage type) noexcept;

struct PeerHeader {
  PeerMessage type{};
  std::uint32_t length = 0;
  std::uint16_t version = kPeerVersion;
};

// Validates magic, version, type and a length within that type's bound.
[[nodiscard]] Result<PeerHeader> decode_peer_header(std::span<const std::byte, kPeerHeaderBytes> bytes);
// The same, except that a header of another wire version is accepted when its type is one that
// every version shares (kHello, kHelloOk, kError): how a hello learns the other side's version.
[[nodiscard]] Result<PeerHeader> decode_hello_header(std::span<const std::byte, kPeerHeaderBytes> bytes);
// A frame stamped with another wire version: the kError that refuses a peer of that version,
// in a header it can decode.
[[nodiscard]] std::vector<std::byte> encode_peer_error_for_version(const Error& error, std::uint16_t version);
// The refusal both sides report when the versions differ.
[[nodiscard]] Error wire_version_mismatch(std::uint16_t theirs, std::string_view who);
// `version`: another wire version only for the kError that refuses a peer of that version.
[[nodiscard]] std::vector<std::byte> encode_peer_frame(PeerMessage type, std::span<const std::byte> payload,
                                                       std::uint16_t version = kPeerVersion);
void encode_peer_header(std::span<std::byte, kPeerHeaderBytes> out, PeerMessage type, std::uint32_t length);

struct Hello {
  std::uint32_t protocol_version = kPeerVersion;
  std::uint64_t capabilities = 0;
  std::string node_id;
  std::uint32_t max_chunk_bytes = kMaxChunkBytes;
  std::string shm_socket;  // only with kCapSharedMemory
};
[[nodiscard]] std::vector<std::byte> encode_hello(PeerMessage type, const Hello& hello);
[[nodiscard]] Result<Hello> decode_hello(std::span<const std::byte> payload);

// The chunk size a stream of `bytes` goes in: `configured`, except that a stream that would be
// a single chunk of at least kSplitTransferMinBytes goes as two halves (4 KiB multiples), so
// that the sender hashes and stages the second while the first is on the wire and the receiver
// checks the first while the second arrives.
inline constexpr std::uint64_t kSplitTransferMinBytes = 256U << 10;
[[nodiscard]] std::uint32_t transfer_chunk_bytes(std::uint32_t configured, std::uint64_t bytes) noexcept;

// A chunk's checksum is the running xxh3_64 of the stream's header (stream_header_bytes, so a
// corrupted key or size fails the first chunk) and of the frame's bytes up to and including
// the chunk: the last chunk's covers everything, and neither side reads a byte twice.
struct ChunkHeader {
  std::uint64_t transfer_id = 0;
  std::uint32_t index = 0;
  std::uint64_t checksum = 0;
};
void encode_chunk_header(std::span<std::byte, kChunkHeaderBytes> out, const ChunkHeader& chunk);
[[nodiscard]] ChunkHeader decode_chunk_header(std::span<const std::byte, kChunkHeaderBytes> bytes);

// "Send me the longest prefix of this chain you hold, encoded with `codec`." `hashes` are the
// chain's block hashes, longest prefix first (hashes[i] names the entry of its own prefix).
// `skip_tokens` > 0: the asker already holds that many leading tokens of the chain; only the
// tokens after them are sent (and a held prefix no longer than that is "not found").
struct FetchRequest {
  std::uint64_t request_id = 0;
  std::uint64_t model_id = 0;
  std::string codec;  // a codec spec of the registry: "raw", "lossless", "int8", "int4+zstd", ...
  std::vector<std::uint64_t> hashes;
  std::uint64_t skip_tokens = 0;
  // The route the asker looks up for ("" names none, at most kMaxRouteBytes): what the source's
  // link scheduler weighs the reply by.
  std::string route{};
  // Milliseconds the asker waits for the whole reply from when it sent this; 0: no deadline.
  std::uint32_t deadline_ms = 0;
  // The least fidelity product (Fidelity::product) the reply may carry, in [0, 1]; 0: any. A
  // source answers "not found" rather than send KV below it.
  double min_fidelity_product = 0.0;
};
[[nodiscard]] std::vector<std::byte> encode_fetch(const FetchRequest& request);
[[nodiscard]] Result<FetchRequest> decode_fetch(std::span<const std::byte> payload);

// An encoded KV frame that follows as a chunk stream: kChunk frames with index 0.. and running
// checksums, at most `window_chunks` of them ahead of the receiver's last kChunkAck. The
// receiver acknowledges every window_chunks / 2 chunks (at least every chunk) and the last one.
// Used by FetchReply (found; the asker acknowledges) and PushEncoded (the peer acknowledges,
// then answers Committed).
// Why a PushEncoded is sent: the receiver authorizes and files each kind by its own rules.
enum class PushPurpose : std::uint8_t {
  kPush = 0,      // a route with push: true sends the entry ahead
  kPrefetch = 1,  // sent ahead while the link is idle, for a route's next hop
  kSpill = 2,     // this node's store is full: the receiver keeps it for this node
};
[[nodiscard]] std::string_view push_purpose_name(PushPurpose purpose) noexcept;
struct EncodedEntryHeader {
  std::uint64_t id = 0;           // request id (fetch) or transfer id (push)
  kv_store::EntryKey key;         // what the entry is filed under
  std::uint64_t frame_bytes = 0;  // the KV frame (codec_plugins frame format)
  std::uint32_t chunk_bytes = 1U << 20;
  std::uint32_t window_chunks = 8;
  // The token ids of the whole prefix `key` names: the receiver recomputes the chain and refuses
  // KV whose ids do not hash to its key (issue #25). A fetch reply sends them all, also where
  // the KV that follows skips the asker's held tokens.
  kv_store::EntryChain chain;
  // PushEncoded only: the route it is pushed on, which the receiver authorizes ("" names none).
  std::string route;
  // PushEncoded only: why it is sent, and how many leading tokens of `chain` the frame leaves out
  // because the receiver holds them (0: the frame carries the whole entry).
  PushPurpose purpose = PushPurpose::kPush;
  std::uint64_t skip_tokens = 0;
  // The fidelity product of the KV the frame carries, in (0, 1]: the sender's
  // effective(entry) x factor(the codec it encoded with); 1 for exact KV.
  double fidelity_product = 1.0;
  [[nodiscard]] std::uint64_t chunk_count() const {
    return frame_bytes == 0 ? 0 : (frame_bytes + chunk_bytes - 1) / chunk_bytes;
  }
  // How often the receiver acknowledges: half a window, so the sender never stalls on a full one.
  [[nodiscard]] std::uint64_t ack_every() const { return window_chunks >= 2 ? window_chunks / 2 : 1; }
};
// What a stream's running checksum starts from: id, key, frame_bytes, chunk_bytes, window_chunks.
inline constexpr std::size_t kStreamHeaderBytes = 8 + 16 + 8 + 4 + 4;
[[nodiscard]] std::array<std::byte, kStreamHeaderBytes> stream_header_bytes(const EncodedEntryHeader& header);
// FetchReply: u64 request id, u8 found, and when found the EncodedEntryHeader fields after the id.
[[nodiscard]] std::vector<std::byte> encode_fetch_reply(std::uint64_t request_id, const EncodedEntryHeader* found);
[[nodiscard]] Result<std::optional<EncodedEntryHeader>> decode_fetch_reply(std::span<const std::byte> payload,
                                                                           std::uint64_t expected_id);
[[nodiscard]] std::vector<std::byte> encode_push_encoded(const EncodedEntryHeader& header);
[[nodiscard]] Result<EncodedEntryHeader> decode_push_encoded(std::span<const std::byte> payload);

// What a peer says of its own resources in every SummaryReply (the global view, issue #27). A
// field the sender cannot know is 0.
struct NodeState {
  std::uint64_t store_budget = 0;       // bytes its KV store may hold
  std::uint64_t store_used = 0;         // bytes its KV store holds
  std::uint64_t arena_capacity = 0;     // bytes of its shared-memory arena
  std::uint64_t arena_in_use = 0;       // of those, reserved by live blocks
  std::uint64_t queued_transfers = 0;   // peer transfers it has in progress (pushes and fetch replies)
  std::uint64_t spill_accept_left = 0;  // bytes it would still take as spills from the asker
  std::uint64_t link_bytes_per_s = 0;   // its links' configured rate (scheduler.link_bytes_per_s; 0: unknown)
  std::uint64_t sent_bytes_per_s = 0;   // what it sent the asker since its previous summary to it, per second
  friend bool operator==(const NodeState&, const NodeState&) = default;
};
inline constexpr std::size_t kNodeStateBytes = 8 * 8;
// SummaryReply: the sender's NodeState, then the keys it holds, most recently used first, as
// many as fit one frame, each with the effective fidelity product of the entry filed there (1:
// exact; version 5), so that an asker's refresh rule sees a peer's lossy chains.
inline constexpr std::size_t kSummaryKeyBytes = kv_store::kEncodedKeyBytes + 8;
inline constexpr std::size_t kMaxSummaryKeys = (kMaxControlPayload - kNodeStateBytes - 4) / kSummaryKeyBytes;
struct SummaryReply {
  NodeState node;
  std::vector<kv_store::EntryKey> keys;
  std::vector<double> products;  // one per key, in (0, 1]
};
// `products`: one per key, or empty for all exact (1).
[[nodiscard]] std::vector<std::byte> encode_summary(std::span<const kv_store::EntryKey> keys, const NodeState& node,
                                                    std::span<const double> products = {});
[[nodiscard]] Result<SummaryReply> decode_summary(std::span<const std::byte> payload);

// ChunkAck: u64 stream id, u32 index of the last chunk received intact.
[[nodiscard]] std::vector<std::byte> encode_chunk_ack(std::uint64_t id, std::uint32_t index);
struct ChunkAck {
  std::uint64_t id = 0;
  std::uint32_t index = 0;
};
[[nodiscard]] Result<ChunkAck> decode_chunk_ack(std::span<const std::byte> payload);
// Committed: u64 push id.
[[nodiscard]] std::vector<std::byte> encode_committed(std::uint64_t id);
[[nodiscard]] Result<std::uint64_t> decode_committed(std::span<const std::byte> payload);

// Receiver counters, returned by kStats (tests and `kvrelay peer probe`). Transfers are pushes.
struct PeerServerStats {
  std::uint64_t sessions = 0;
  std::uint64_t active_transfers = 0;
  std::uint64_t committed_transfers = 0;
  std::uint64_t duplicate_transfers = 0;  // pushes of KV this node already held as exactly
  std::uint64_t failed_transfers = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t chunks_received = 0;  // checked
  std::uint64_t fetches_served = 0;   // fetch replies that carried KV, acknowledged to the end
};
[[nodiscard]] std::vector<std::byte> encode_peer_stats(const PeerServerStats& stats);
[[nodiscard]] Result<PeerServerStats> decode_peer_stats(std::span<const std::byte> payload);

[[nodiscard]] std::vector<std::byte> encode_peer_error(const Error& error);
[[nodiscard]] Error decode_peer_error(std::span<const std::byte> payload);

}  // namespace kvrelay::peer
