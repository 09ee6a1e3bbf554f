#pragma once

// Frames of the sidecar <-> sidecar TCP protocol (byte layout in docs/wire-format.md,
// "Peer protocol (TCP)"). Every frame: a 12-byte header (magic, version, type, payload
// length) and a payload whose meaning depends on the type.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/core/result.h"
#include "kvrelay/kv_store/entry.h"

namespace kvrelay::peer {

inline constexpr std::uint32_t kPeerMagic = 0x5052564BU;  // "KVRP" in little-endian byte order
inline constexpr std::uint16_t kPeerVersion = 1;
inline constexpr std::size_t kPeerHeaderBytes = 12;
inline constexpr std::size_t kChunkHeaderBytes = 20;  // transfer id, index, checksum
inline constexpr std::uint32_t kMaxChunkBytes = 16U << 20;
inline constexpr std::uint32_t kMaxControlPayload = 64 * 1024;

// Capability bits announced in the hello.
inline constexpr std::uint64_t kCapChunkedTransfer = 1U << 0;
inline constexpr std::uint64_t kCapSharedMemory = 1U << 1;  // hello carries a Unix socket path
// Accepts kBeginRunning: each chunk carries the running checksum of the transfer so far, so
// both sides hash every byte once, as it goes out or comes in (see Begin::running_checksums).
inline constexpr std::uint64_t kCapRunningChecksums = 1U << 2;
// Announced by a sender: it takes a ChunkAck as acknowledging every chunk up to its index, so a
// receiver may acknowledge every few chunks instead of each one (each ack wakes the sender).
inline constexpr std::uint64_t kCapCumulativeAcks = 1U << 3;
// This sidecar records fidelity: it serves a lossless Fetch exact KV only, and its pushes say by
// their codec what they are. KV from a peer without it cannot be trusted as exact (an older
// sidecar files KV its workers computed over lossy imports as exact).
inline constexpr std::uint64_t kCapFidelity = 1U << 4;
// The fidelity "codec" of KV from a peer without kCapFidelity: lossy, matching no real codec.
inline constexpr std::string_view kUnverifiedFidelity = "unverified-peer";

enum class PeerMessage : std::uint16_t {
  kHello = 1,
  kHelloOk = 2,
  kBegin = 3,
  kBeginOk = 4,
  kChunk = 5,
  kChunkAck = 6,
  kCommitted = 7,
  kError = 8,
  kPing = 9,
  kPong = 10,
  kStats = 11,
  kStatsReply = 12,
  // KV path: fetch a chain's longest held prefix encoded with a codec, push an encoded entry,
  // and ask which chains a peer holds.
  kFetch = 13,
  kFetchReply = 14,
  kPushEncoded = 15,
  kSummary = 16,
  kSummaryReply = 17,
  // A Begin with running chunk checksums (Begin::running_checksums).
  kBeginRunning = 18,
};
inline constexpr PeerMessage kLastPeerMessage = PeerMessage::kBeginRunning;

struct PeerHeader {
  PeerMessage type{};
  std::uint32_t length = 0;
};

// Validates magic, version, type and a length within that type's bound.
[[nodiscard]] Result<PeerHeader> decode_peer_header(std::span<const std::byte, kPeerHeaderBytes> bytes);
[[nodiscard]] std::vector<std::byte> encode_peer_frame(PeerMessage type, std::span<const std::byte> payload);
void encode_peer_header(std::span<std::byte, kPeerHeaderBytes> out, PeerMessage type, std::uint32_t length);

struct Hello {
  std::uint32_t protocol_version = kPeerVersion;
  std::uint64_t capabilities = kCapChunkedTransfer;
  std::string node_id;
  std::uint32_t max_chunk_bytes = kMaxChunkBytes;
  std::string shm_socket;  // only with kCapSharedMemory
};
[[nodiscard]] std::vector<std::byte> encode_hello(PeerMessage type, const Hello& hello);
[[nodiscard]] Result<Hello> decode_hello(std::span<const std::byte> payload);

struct Begin {
  std::uint64_t transfer_id = 0;
  kv_store::EntryKey key;
  kv_store::EntryInfo info;  // layout, total bytes, xxh3 of all bytes (0 with running_checksums)
  std::uint32_t chunk_bytes = 1U << 20;
  // Sent as kBeginRunning: chunk i's checksum is the xxh3 of chunks 0..i, so the last one is
  // the entry's and neither side reads the bytes twice (kBegin: each chunk's own xxh3, and the
  // whole one here up front, which costs the sender a pass before the first chunk).
  bool running_checksums = false;
  // kBeginRunning only: this many chunks follow the Begin before the sender waits for BeginOk
  // (at most the chunk count), saving a round trip per transfer. A receiver that will not take
  // the transfer reads and drops them before it answers, so the stream stays in step.
  std::uint32_t eager_chunks = 0;
  [[nodiscard]] std::uint64_t chunk_count() const {
    return info.bytes == 0 ? 0 : (info.bytes + chunk_bytes - 1) / chunk_bytes;
  }
};
// The chunk size a transfer of `bytes` goes in: `configured`, except that a transfer that would
// be a single chunk of at least kSplitTransferMinBytes goes as two halves (4 KiB multiples), so
// that the sender hashes and stages the second while the first is on the wire and the receiver
// checks the first while the second arrives. Measured on loopback (docs/transports.md): 1 MiB
// transfers 0.97-1.17x a raw socket in halves against 0.80-0.95x whole; transfers of several
// chunks gained nothing from smaller chunks, so they keep `configured`.
inline constexpr std::uint64_t kSplitTransferMinBytes = 256U << 10;
[[nodiscard]] std::uint32_t transfer_chunk_bytes(std::uint32_t configured, std::uint64_t bytes) noexcept;

[[nodiscard]] std::vector<std::byte> encode_begin(const Begin& begin);
// Also validates the entry info and chunk size. `type`: kBegin or kBeginRunning.
[[nodiscard]] Result<Begin> decode_begin(std::span<const std::byte> payload, PeerMessage type = PeerMessage::kBegin);

enum class BeginState : std::uint8_t { kProceed = 0, kAlreadyCommitted = 1 };

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
};
[[nodiscard]] std::vector<std::byte> encode_fetch(const FetchRequest& request);
[[nodiscard]] Result<FetchRequest> decode_fetch(std::span<const std::byte> payload);

// An encoded KV frame that follows as chunks (kChunk frames, index 0.., no acknowledgements;
// TCP's flow control paces them). Used by FetchReply (found) and PushEncoded.
struct EncodedEntryHeader {
  std::uint64_t id = 0;              // request id (fetch) or transfer id (push)
  kv_store::EntryKey key;                 // what the entry is filed under
  std::uint64_t frame_bytes = 0;     // the KV frame (codec_plugins frame format)
  std::uint64_t frame_checksum = 0;  // xxh3_64 of the whole frame
  std::uint32_t chunk_bytes = 1U << 20;
  [[nodiscard]] std::uint64_t chunk_count() const {
    return frame_bytes == 0 ? 0 : (frame_bytes + chunk_bytes - 1) / chunk_bytes;
  }
};
// FetchReply: u64 request id, u8 found, and when found the EncodedEntryHeader fields after the id.
[[nodiscard]] std::vector<std::byte> encode_fetch_reply(std::uint64_t request_id, const EncodedEntryHeader* found);
[[nodiscard]] Result<std::optional<EncodedEntryHeader>> decode_fetch_reply(std::span<const std::byte> payload,
                                                                           std::uint64_t expected_id);
[[nodiscard]] std::vector<std::byte> encode_push_encoded(const EncodedEntryHeader& header);
[[nodiscard]] Result<EncodedEntryHeader> decode_push_encoded(std::span<const std::byte> payload);

// SummaryReply: the keys a peer holds, most recently used first, as many as fit one frame.
inline constexpr std::size_t kMaxSummaryKeys = (kMaxControlPayload - 4) / kv_store::kEncodedKeyBytes;
[[nodiscard]] std::vector<std::byte> encode_summary(std::span<const kv_store::EntryKey> keys);
[[nodiscard]] Result<std::vector<kv_store::EntryKey>> decode_summary(std::span<const std::byte> payload);

// Receiver counters, returned by kStats (tests and `kvrelay peer probe`).
struct PeerServerStats {
  std::uint64_t sessions = 0;
  std::uint64_t active_transfers = 0;
  std::uint64_t committed_transfers = 0;
  std::uint64_t duplicate_transfers = 0;  // retried ids answered "already committed"
  std::uint64_t failed_transfers = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t chunks_received = 0;  // checked and stored; 0 from a peer too old to count them
};
[[nodiscard]] std::vector<std::byte> encode_peer_stats(const PeerServerStats& stats);
[[nodiscard]] Result<PeerServerStats> decode_peer_stats(std::span<const std::byte> payload);

[[nodiscard]] std::vector<std::byte> encode_peer_error(const Error& error);
[[nodiscard]] Error decode_peer_error(std::span<const std::byte> payload);

}  // namespace kvrelay::peer
