#pragma once

// Framing of the worker <-> sidecar control protocol (one SOCK_SEQPACKET datagram per frame;
// byte layout in docs/wire-format.md, "Control protocol (Unix socket)").

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/core/byte_io.h"
#include "kvrelay/core/fidelity.h"
#include "kvrelay/core/kv_tokens.h"
#include "kvrelay/core/result.h"
#include "kvrelay/kv_store/entry.h"
#include "kvrelay/shm_transport/chain_transfer.h"

namespace kvrelay::shm {

inline constexpr std::uint32_t kControlMagic = 0x4352564BU;  // "KVRC" in little-endian byte order
inline constexpr std::uint16_t kControlVersion = 1;
inline constexpr std::size_t kControlHeaderBytes = 16;
// Data-plane protocol version exchanged in Hello/HelloOk (the frame header's version stays 1:
// version 2 only adds message types, which a version-1 sidecar refuses as unknown). Version 3
// adds the arena: regions and entries that are blocks of one long-lived, sidecar-owned memfd.
// A sidecar answers lookups with arena replies only to clients that said version 3. Version 4
// adds fidelity: a CommitContext may end with the KV's Fidelity, and a Resolved reply to a
// version-4 client ends with the served prefix's. Version 5 adds token ids (chain_transfer.h): a
// CommitContext may carry the entry's chain, and an Entry reply ends with whether a chain (for a
// same-host peer's lookup) is attached. Version 6 adds reservations: a Resolve carries flags, and
// a reserving one keeps its answer in the sidecar (Reserved) for a Claim from any worker
// connection, once, or a Release. Version 7 (issue #28) adds spans: a chain header carries where
// the publisher's prompt ends, a Resolve may say the client imports KV that does not start at
// position 0 (kResolveSpan) or keeps only some positions (kResolveSparse), and a Resolved reply
// ends with where its KV starts and which positions it keeps.
inline constexpr std::uint32_t kDataPlaneVersion = 7;
inline constexpr std::uint32_t kArenaDataPlaneVersion = 3;
inline constexpr std::uint32_t kFidelityDataPlaneVersion = 4;
inline constexpr std::uint32_t kChainDataPlaneVersion = 5;
inline constexpr std::uint32_t kReservationDataPlaneVersion = 6;
inline constexpr std::uint32_t kSpanDataPlaneVersion = 7;
// ResolveRequest::flags bit 0: keep the answer under a reservation, send no fd.
inline constexpr std::uint32_t kResolveReserve = 0x1;
// Version 7. Bit 1: the client can prefill the tokens before a span and import the span's KV
// after them (audit span "generated"). Bit 2: it can attend over position-sparse KV (kv_sparse).
inline constexpr std::uint32_t kResolveSpan = 0x2;
inline constexpr std::uint32_t kResolveSparse = 0x4;
// The flags a connection of `version` may send.
[[nodiscard]] constexpr std::uint32_t known_resolve_flags(std::uint32_t version) noexcept {
  if (version >= kSpanDataPlaneVersion) return kResolveReserve | kResolveSpan | kResolveSparse;
  return version >= kReservationDataPlaneVersion ? kResolveReserve : 0U;
}
// The most runs of kept positions one Resolved reply names.
inline constexpr std::size_t kMaxKeptRuns = 4096;

enum class MessageType : std::uint16_t {
  kHello = 0x01,
  kAllocRegion = 0x02,
  kAttachRegion = 0x03,
  kCommit = 0x04,
  kAbort = 0x05,
  kLookup = 0x06,
  kStats = 0x07,
  kOpenRing = 0x08,
  kPing = 0x09,
  // Version 2: requests that carry the request's context (kv_transfer_params.kvrelay).
  kResolve = 0x0A,
  kCommitContext = 0x0B,
  kPrefillReport = 0x0C,
  // Version 3: arena regions, and giving back the leases arena replies hand out.
  kAllocArenaRegion = 0x0D,
  kReleaseLeases = 0x0E,
  // One-way (no reply): "the first N bytes of this arena region are written", so the sidecar
  // can verify them while the client writes the rest.
  kRegionProgress = 0x0F,
  // Version 6: the entry a reserving Resolve kept, and dropping one unclaimed.
  kClaim = 0x10,
  kRelease = 0x11,
  // Replies: request type | 0x80, or kError.
  kHelloOk = 0x81,
  kRegion = 0x82,
  kRegionAttached = 0x83,
  kCommitted = 0x84,
  kAborted = 0x85,
  kEntry = 0x86,
  kStatsReply = 0x87,
  kRingOpened = 0x88,
  kPong = 0x89,
  kResolved = 0x8A,
  kContextCommitted = 0x8B,
  kPrefillNoted = 0x8C,
  kArenaRegion = 0x8D,
  kLeasesReleased = 0x8E,
  // Alternative replies to kLookup / kResolve (version-3 clients) for entries held in the arena.
  kArenaEntry = 0x90,
  kArenaResolved = 0x91,
  // Version 6: the answer to a reserving kResolve (meta and reservation id, no fd).
  kReserved = 0x92,
  kReleased = 0x93,
  kError = 0xFF,
};

struct ControlFrame {
  MessageType type{};
  std::uint32_t request_id = 0;
  std::span<const std::byte> payload;  // views the received bytes
};

[[nodiscard]] std::vector<std::byte> encode_frame(MessageType type, std::uint32_t request_id,
                                                  std::span<const std::byte> payload);
// Checks magic, version, a known type and that the length field matches the datagram exactly.
[[nodiscard]] Result<ControlFrame> decode_frame(std::span<const std::byte> datagram);

// Error replies: u16 code, u16 length, message bytes.
[[nodiscard]] std::vector<std::byte> encode_error(std::uint32_t request_id, const Error& error);
[[nodiscard]] Error decode_error(std::span<const std::byte> payload);

// Counters the sidecar reports for a kStats request (also what tests use to prove that
// memory returns to its baseline).
struct ServerStats {
  std::uint64_t connections = 0;
  std::uint64_t pending_regions = 0;  // allocated or attached, not yet committed
  std::uint64_t pending_bytes = 0;
  std::uint64_t entries = 0;
  std::uint64_t entry_bytes = 0;
  std::uint64_t commits = 0;
  std::uint64_t rejected_messages = 0;
  std::uint64_t refused_connections = 0;
  std::uint64_t open_rings = 0;
  // Version 3 (zero from older sidecars).
  std::uint64_t arena_bytes = 0;         // capacity; 0 without an arena
  std::uint64_t arena_bytes_in_use = 0;  // blocks held by entries, pending regions and leases
  std::uint64_t leases = 0;              // arena entries handed to clients and not yet given back
};
// Resolve: "which leading blocks of this prompt can you supply, for this request?" The sidecar
// picks the medium (and may fetch from a peer) and answers Resolved with the KV of the longest
// prefix it supplies, or Error(not_found) with the reason for a miss.
struct ResolveRequest {
  std::uint64_t model_id = 0;
  std::uint32_t block_tokens = 0;
  std::uint64_t prompt_tokens = 0;
  std::vector<std::uint64_t> block_hashes;  // the prompt's chained block hashes, first block first
  std::string params_json;                  // kv_transfer_params.kvrelay, "" when absent
  // Not on the wire: the data-plane version of the asking connection, set by the sidecar (a
  // client older than version 4 cannot carry lossy KV's fidelity, so it is served exact KV only).
  std::uint32_t client_version = kDataPlaneVersion;
  std::uint32_t flags = 0;  // kResolveReserve; on the wire from version 6 only
};
// `version`: the data-plane version both ends speak (from 6 a u32 flags field ends the request).
[[nodiscard]] std::vector<std::byte> encode_resolve(const ResolveRequest& request,
                                                    std::uint32_t version = kDataPlaneVersion);
[[nodiscard]] Result<ResolveRequest> decode_resolve(std::span<const std::byte> payload,
                                                    std::uint32_t version = kDataPlaneVersion);

// The prefix a Resolved reply covers: `blocks` leading blocks, moved with `medium`, as faithful
// to the source's KV as `fidelity` says (what the worker then tells the sidecar when it publishes
// KV computed over this prefix).
// From version 7 the KV may start at block `first_block` (a span: the client prefills the
// blocks before it first) and may keep only the positions `kept` names (kv_sparse: absolute
// positions inside the blocks it covers; the entry then holds run_tokens(kept) tokens).
struct ResolvedMeta {
  std::uint32_t blocks = 0;
  std::string medium;
  Fidelity fidelity;
  std::uint32_t first_block = 0;
  std::vector<TokenRun> kept;  // empty: every position of the blocks
  // Whether a client older than version 7 could read this meta (a plain leading prefix).
  [[nodiscard]] bool is_prefix() const noexcept { return first_block == 0 && kept.empty(); }
};
// Version 7's end of a Resolved/Reserved reply: u32 first_block, u16 run count, runs (u32 start,
// u32 length). Decoding checks that the runs are ascending and disjoint; whether they fit the
// prompt is the client's check (it knows its block size).
void encode_resolved_span(ByteWriter& writer, const ResolvedMeta& meta);
[[nodiscard]] Status decode_resolved_span(ByteReader& reader, ResolvedMeta& meta);

// Fidelity on the wire: u64 exact_tokens, u16-length codec spec ("" = exact). Decoding refuses
// a spec longer than kMaxFidelityCodecBytes and a nonzero exact_tokens without a codec.
inline constexpr std::size_t kMaxFidelityCodecBytes = 64;
void encode_fidelity(ByteWriter& writer, const Fidelity& fidelity);
[[nodiscard]] Result<Fidelity> decode_fidelity(ByteReader& reader);

// Commit (and CommitContext, which adds the request's params, from version 4 the KV's fidelity
// and from version 5 the entry's chain): "region `region_id` holds `bytes` bytes of `layout`
// with this checksum; file it under `key`".
struct CommitRequest {
  std::uint64_t region_id = 0;
  kv_store::EntryKey key;
  KvLayout layout;
  std::uint64_t bytes = 0;
  std::uint64_t checksum = 0;
  std::string params_json;  // CommitContext only
  Fidelity fidelity;        // CommitContext only; sent only when lossy
  // CommitContext from version 5 only: the chain's token ids travel in the frame's one fd.
  std::optional<ChainHeader> chain;
};
// `version`: the data-plane version both ends speak (from 5 a CommitContext has a flags byte).
[[nodiscard]] std::vector<std::byte> encode_commit(const CommitRequest& commit, bool with_context,
                                                   std::uint32_t version);
// Structural checks only (sizes against the region and the layout are the server's).
[[nodiscard]] Result<CommitRequest> decode_commit(std::span<const std::byte> payload, bool with_context,
                                                  std::uint32_t version);

// One prefill a worker ran: tokens computed, context length, wall time, and the request's params.
struct PrefillReport {
  std::uint64_t model_id = 0;
  std::uint64_t computed_tokens = 0;
  std::uint64_t context_tokens = 0;
  double seconds = 0.0;
  std::string params_json;
};
[[nodiscard]] std::vector<std::byte> encode_prefill_report(const PrefillReport& report);
[[nodiscard]] Result<PrefillReport> decode_prefill_report(std::span<const std::byte> payload);

// A u32-length-prefixed string (params JSON can exceed a u16 string).
void put_long_string(ByteWriter& writer, std::string_view text);
[[nodiscard]] std::optional<std::string> get_long_string(ByteReader& reader);

[[nodiscard]] std::vector<std::byte> encode_stats(const ServerStats& stats);
[[nodiscard]] Result<ServerStats> decode_stats(std::span<const std::byte> payload);

}  // namespace kvrelay::shm
