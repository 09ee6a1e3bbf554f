#include "kvrelay/shm_transport/control_protocol.h"

#include <fmt/format.h>

#include <cmath>
#include <cstring>

#include "kvrelay/core/byte_io.h"

namespace kvrelay::shm {

namespace {

// A version-5 CommitContext's flags byte: what follows the params.
constexpr std::uint8_t kCommitHasFidelity = 0x01;
constexpr std::uint8_t kCommitHasChain = 0x02;

bool known_type(std::uint16_t type) {
  switch (static_cast<MessageType>(type)) {
    case MessageType::kHello:
    case MessageType::kAllocRegion:
    case MessageType::kAttachRegion:
    case MessageType::kCommit:
    case MessageType::kAbort:
    case MessageType::kLookup:
    case MessageType::kStats:
    case MessageType::kOpenRing:
    case MessageType::kPing:
    case MessageType::kResolve:
    case MessageType::kCommitContext:
    case MessageType::kPrefillReport:
    case MessageType::kAllocArenaRegion:
    case MessageType::kReleaseLeases:
    case MessageType::kRegionProgress:
    case MessageType::kClaim:
    case MessageType::kRelease:
    case MessageType::kReserved:
    case MessageType::kReleased:
    case MessageType::kArenaRegion:
    case MessageType::kLeasesReleased:
    case MessageType::kArenaEntry:
    case MessageType::kArenaResolved:
    case MessageType::kResolved:
    case MessageType::kContextCommitted:
    case MessageType::kPrefillNoted:
    case MessageType::kHelloOk:
    case MessageType::kRegion:
    case MessageType::kRegionAttached:
    case MessageType::kCommitted:
    case MessageType::kAborted:
    case MessageType::kEntry:
    case MessageType::kStatsReply:
    case MessageType::kRingOpened:
    case MessageType::kPong:
    case MessageType::kError:
      return true;
  }
  return false;
}

}  // namespace

std::vector<std::byte> encode_frame(MessageType type, std::uint32_t request_id, std::span<const std::byte> payload) {
  ByteWriter writer;
  writer.put(kControlMagic).put(kControlVersion).put(static_cast<std::uint16_t>(type));
  writer.put(static_cast<std::uint32_t>(payload.size())).put(request_id);
  writer.put_bytes(payload);
  return writer.take();
}

Result<ControlFrame> decode_frame(std::span<const std::byte> datagram) {
  ByteReader reader(datagram);
  const auto magic = reader.get<std::uint32_t>();
  const auto version = reader.get<std::uint16_t>();
  const auto type = reader.get<std::uint16_t>();
  const auto length = reader.get<std::uint32_t>();
  const auto request_id = reader.get<std::uint32_t>();
  if (!request_id)
    return fail(ErrorCode::kTruncated, fmt::format("frame of {} bytes is shorter than its header", datagram.size()));
  if (*magic != kControlMagic) return fail(ErrorCode::kBadMagic, fmt::format("bad frame magic 0x{:08x}", *magic));
  if (*version != kControlVersion)
    return fail(ErrorCode::kBadVersion, fmt::format("unsupported protocol version {}", *version));
  if (!known_type(*type)) return fail(ErrorCode::kProtocol, fmt::format("unknown message type 0x{:02x}", *type));
  if (*length != reader.remaining()) {
    return fail(ErrorCode::kProtocol, fmt::format("length field {} but {} payload bytes", *length, reader.remaining()));
  }
  return ControlFrame{static_cast<MessageType>(*type), *request_id, datagram.subspan(kControlHeaderBytes)};
}

std::vector<std::byte> encode_error(std::uint32_t request_id, const Error& error) {
  ByteWriter writer;
  writer.put(static_cast<std::uint16_t>(error.code));
  const std::string_view text = std::string_view(error.message).substr(0, 4000);
  writer.put_string(text);
  return encode_frame(MessageType::kError, request_id, writer.bytes());
}

Error decode_error(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  const auto code = reader.get<std::uint16_t>();
  auto text = reader.get_string();
  if (!code || !text || reader.remaining() != 0) return Error{ErrorCode::kProtocol, "malformed error reply"};
  return Error{static_cast<ErrorCode>(*code), std::move(*text)};
}

void put_long_string(ByteWriter& writer, std::string_view text) {
  writer.put(static_cast<std::uint32_t>(text.size()));
  writer.put_bytes(std::as_bytes(std::span(text.data(), text.size())));
}

std::optional<std::string> get_long_string(ByteReader& reader) {
  const auto length = reader.get<std::uint32_t>();
  if (!length) return std::nullopt;
  const auto view = reader.get_bytes(*length);
  if (!view) return std::nullopt;
  return std::string(reinterpret_cast<const char*>(view->data()), view->size());
}

void encode_fidelity(ByteWriter& writer, const Fidelity& fidelity) {
  writer.put(fidelity.is_exact() ? std::uint64_t{0} : fidelity.exact_tokens);
  writer.put_string(fidelity.lossy_codec);
}

Result<Fidelity> decode_fidelity(ByteReader& reader) {
  const auto exact_tokens = reader.get<std::uint64_t>();
  auto codec = reader.get_string();
  if (!exact_tokens || !codec) return fail(ErrorCode::kTruncated, "fidelity truncated");
  if (codec->size() > kMaxFidelityCodecBytes) {
    return fail(ErrorCode::kProtocol,
                fmt::format("fidelity codec spec of {} bytes (at most {})", codec->size(), kMaxFidelityCodecBytes));
  }
  if (codec->empty()) {
    if (*exact_tokens != 0) return fail(ErrorCode::kProtocol, "exact fidelity with exact_tokens set");
    return Fidelity::exact();
  }
  return Fidelity::lossy(std::move(*codec), *exact_tokens);
}

std::vector<std::byte> encode_commit(const CommitRequest& commit, bool with_context, std::uint32_t version) {
  ByteWriter writer;
  writer.put(commit.region_id);
  kv_store::encode_key(writer, commit.key);
  kv_store::encode_layout(writer, commit.layout);
  writer.put(commit.bytes).put(commit.checksum);
  if (with_context) {
    put_long_string(writer, commit.params_json);
    if (version >= kChainDataPlaneVersion) {
      const auto flags = static_cast<std::uint8_t>((commit.fidelity.is_exact() ? 0U : kCommitHasFidelity) |
                                                   (commit.chain ? kCommitHasChain : 0U));
      writer.put(flags);
    }
    if (!commit.fidelity.is_exact()) encode_fidelity(writer, commit.fidelity);
    if (commit.chain && version >= kChainDataPlaneVersion) encode_chain_header(writer, *commit.chain, version);
  }
  return writer.take();
}

Result<CommitRequest> decode_commit(std::span<const std::byte> payload, bool with_context, std::uint32_t version) {
  ByteReader reader(payload);
  CommitRequest commit;
  const auto region_id = reader.get<std::uint64_t>();
  const auto key = kv_store::decode_key(reader);
  if (!region_id || !key) return fail(ErrorCode::kTruncated, "commit truncated");
  commit.region_id = *region_id;
  commit.key = *key;
  KVRELAY_TRY(commit.layout, kv_store::decode_layout(reader));
  const auto bytes = reader.get<std::uint64_t>();
  const auto checksum = reader.get<std::uint64_t>();
  if (!bytes || !checksum) return fail(ErrorCode::kProtocol, "malformed commit");
  commit.bytes = *bytes;
  commit.checksum = *checksum;
  if (with_context) {
    auto params = get_long_string(reader);
    if (!params) return fail(ErrorCode::kProtocol, "malformed commit params");
    commit.params_json = std::move(*params);
    // Version 5 says what follows; version 4 has a fidelity when bytes remain (else exact KV).
    std::uint8_t flags = reader.remaining() != 0 ? kCommitHasFidelity : 0;
    if (version >= kChainDataPlaneVersion) {
      const auto read = reader.get<std::uint8_t>();
      if (!read) return fail(ErrorCode::kTruncated, "commit: flags truncated");
      if ((*read & ~(kCommitHasFidelity | kCommitHasChain)) != 0)
        return fail(ErrorCode::kProtocol, fmt::format("commit: unknown flags 0x{:02x}", *read));
      flags = *read;
    }
    if ((flags & kCommitHasFidelity) != 0) {
      auto fidelity = decode_fidelity(reader);
      if (!fidelity) return fail(fidelity.error().code, fmt::format("commit: {}", fidelity.error().message));
      // Exact KV is sent without one: one encoding per meaning.
      if (fidelity.value().is_exact()) return fail(ErrorCode::kProtocol, "commit: an exact fidelity is sent as none");
      commit.fidelity = std::move(fidelity).value();
    }
    if ((flags & kCommitHasChain) != 0) {
      auto chain = decode_chain_header(reader, version);
      if (!chain) return fail(chain.error().code, fmt::format("commit: {}", chain.error().message));
      commit.chain = std::move(chain).value();
    }
  }
  if (reader.remaining() != 0) return fail(ErrorCode::kProtocol, "malformed commit: trailing bytes");
  return commit;
}

std::vector<std::byte> encode_resolve(const ResolveRequest& request, std::uint32_t version) {
  ByteWriter writer;
  writer.put(request.model_id).put(request.block_tokens).put(request.prompt_tokens);
  writer.put(static_cast<std::uint32_t>(request.block_hashes.size()));
  for (const std::uint64_t hash : request.block_hashes)
    writer.put(hash);
  put_long_string(writer, request.params_json);
  if (version >= kReservationDataPlaneVersion) writer.put(request.flags);
  return writer.take();
}

Result<ResolveRequest> decode_resolve(std::span<const std::byte> payload, std::uint32_t version) {
  ByteReader reader(payload);
  ResolveRequest request;
  const auto model = reader.get<std::uint64_t>();
  const auto block_tokens = reader.get<std::uint32_t>();
  const auto prompt_tokens = reader.get<std::uint64_t>();
  const auto count = reader.get<std::uint32_t>();
  if (!count) return fail(ErrorCode::kTruncated, "resolve request truncated");
  if (*block_tokens == 0) return fail(ErrorCode::kInvalidArgument, "resolve request with block_tokens 0");
  if (std::uint64_t{*count} * 8 > reader.remaining()) {
    return fail(ErrorCode::kTruncated,
                fmt::format("resolve request announces {} block hashes, {} bytes left", *count, reader.remaining()));
  }
  if (std::uint64_t{*count} * *block_tokens > *prompt_tokens) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("{} blocks of {} tokens exceed the prompt of {} tokens",
                                                         *count, *block_tokens, *prompt_tokens));
  }
  request.model_id = *model;
  request.block_tokens = *block_tokens;
  request.prompt_tokens = *prompt_tokens;
  request.block_hashes.reserve(*count);
  for (std::uint32_t index = 0; index < *count; ++index)
    request.block_hashes.push_back(*reader.get<std::uint64_t>());
  auto params = get_long_string(reader);
  if (!params) return fail(ErrorCode::kProtocol, "malformed resolve params");
  request.params_json = std::move(*params);
  if (version >= kReservationDataPlaneVersion) {
    const auto flags = reader.get<std::uint32_t>();
    if (!flags) return fail(ErrorCode::kTruncated, "resolve request: flags truncated");
    if ((*flags & ~known_resolve_flags(version)) != 0)
      return fail(ErrorCode::kProtocol,
                  fmt::format("resolve request: unknown flags 0x{:x} for data-plane version {}", *flags, version));
    request.flags = *flags;
  }
  if (reader.remaining() != 0) return fail(ErrorCode::kProtocol, "malformed resolve request: trailing bytes");
  return request;
}

void encode_resolved_span(ByteWriter& writer, const ResolvedMeta& meta) {
  writer.put(meta.first_block).put(static_cast<std::uint16_t>(meta.kept.size()));
  for (const TokenRun& run : meta.kept)
    writer.put(run.start).put(run.length);
}

Status decode_resolved_span(ByteReader& reader, ResolvedMeta& meta) {
  const auto first_block = reader.get<std::uint32_t>();
  const auto runs = reader.get<std::uint16_t>();
  if (!first_block || !runs) return fail(ErrorCode::kProtocol, "resolved reply: span truncated");
  if (*runs > kMaxKeptRuns) {
    return fail(ErrorCode::kProtocol, fmt::format("resolved reply keeps {} runs (at most {})", *runs, kMaxKeptRuns));
  }
  meta.first_block = *first_block;
  meta.kept.clear();
  meta.kept.reserve(*runs);
  for (std::uint16_t i = 0; i < *runs; ++i) {
    const auto start = reader.get<std::uint32_t>();
    const auto length = reader.get<std::uint32_t>();
    if (!start || !length) return fail(ErrorCode::kProtocol, "resolved reply: kept runs truncated");
    meta.kept.push_back({*start, *length});
  }
  if (auto checked = check_token_runs(meta.kept, std::uint64_t{1} << 32); !checked) {
    return fail(ErrorCode::kProtocol, fmt::format("resolved reply: {}", checked.error().message));
  }
  return ok();
}

std::vector<std::byte> encode_prefill_report(const PrefillReport& report) {
  ByteWriter writer;
  std::uint64_t seconds_bits = 0;
  std::memcpy(&seconds_bits, &report.seconds, sizeof(seconds_bits));
  writer.put(report.model_id).put(report.computed_tokens).put(report.context_tokens).put(seconds_bits);
  put_long_string(writer, report.params_json);
  return writer.take();
}

Result<PrefillReport> decode_prefill_report(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  PrefillReport report;
  const auto model = reader.get<std::uint64_t>();
  const auto computed = reader.get<std::uint64_t>();
  const auto context = reader.get<std::uint64_t>();
  const auto seconds_bits = reader.get<std::uint64_t>();
  auto params = get_long_string(reader);
  if (!params || reader.remaining() != 0) return fail(ErrorCode::kProtocol, "malformed prefill report");
  report.model_id = *model;
  report.computed_tokens = *computed;
  report.context_tokens = *context;
  std::memcpy(&report.seconds, &*seconds_bits, sizeof(report.seconds));
  if (!std::isfinite(report.seconds) || report.seconds < 0.0 || report.computed_tokens > report.context_tokens) {
    return fail(ErrorCode::kInvalidArgument,
                "prefill report with a negative time or more computed than context tokens");
  }
  report.params_json = std::move(*params);
  return report;
}

std::vector<std::byte> encode_stats(const ServerStats& stats) {
  ByteWriter writer;
  writer.put(stats.connections).put(stats.pending_regions).put(stats.pending_bytes).put(stats.entries);
  writer.put(stats.entry_bytes).put(stats.commits).put(stats.rejected_messages).put(stats.refused_connections);
  writer.put(stats.open_rings).put(stats.arena_bytes).put(stats.arena_bytes_in_use).put(stats.leases);
  return writer.take();
}

Result<ServerStats> decode_stats(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  ServerStats stats;
  for (std::uint64_t* field :
       {&stats.connections, &stats.pending_regions, &stats.pending_bytes, &stats.entries, &stats.entry_bytes,
        &stats.commits, &stats.rejected_messages, &stats.refused_connections, &stats.open_rings}) {
    const auto value = reader.get<std::uint64_t>();
    if (!value) return fail(ErrorCode::kTruncated, "stats reply truncated");
    *field = *value;
  }
  if (reader.remaining() == 0) return stats;  // a version-2 sidecar: no arena
  for (std::uint64_t* field : {&stats.arena_bytes, &stats.arena_bytes_in_use, &stats.leases}) {
    const auto value = reader.get<std::uint64_t>();
    if (!value) return fail(ErrorCode::kTruncated, "stats reply truncated");
    *field = *value;
  }
  if (reader.remaining() != 0) return fail(ErrorCode::kProtocol, "trailing bytes in stats reply");
  return stats;
}

}  // namespace kvrelay::shm
