#include "kvrelay/peer/peer_protocol.h"

#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "kvrelay/core/byte_io.h"

namespace kvrelay::peer {

bool known_peer_message(std::uint16_t type) noexcept {
  switch (static_cast<PeerMessage>(type)) {
    case PeerMessage::kHello:
    case PeerMessage::kHelloOk:
    case PeerMessage::kChunk:
    case PeerMessage::kChunkAck:
    case PeerMessage::kCommitted:
    case PeerMessage::kError:
    case PeerMessage::kPing:
    case PeerMessage::kPong:
    case PeerMessage::kStats:
    case PeerMessage::kStatsReply:
    case PeerMessage::kFetch:
    case PeerMessage::kFetchReply:
    case PeerMessage::kPushEncoded:
    case PeerMessage::kSummary:
    case PeerMessage::kSummaryReply:
    case PeerMessage::kProbe:
    case PeerMessage::kProbeReply:
    case PeerMessage::kUcxOpen:
    case PeerMessage::kUcxOpenReply:
      return true;
  }
  return false;
}

std::uint64_t max_payload_bytes(PeerMessage type) noexcept {
  switch (type) {
    case PeerMessage::kChunk:
      return kChunkHeaderBytes + std::uint64_t{kMaxChunkBytes};
    case PeerMessage::kFetchReply:
    case PeerMessage::kPushEncoded:
      return kMaxEntryHeaderPayload;
    default:
      return kMaxControlPayload;
  }
}

namespace {

bool version_stable(PeerMessage type) {
  return type == PeerMessage::kHello || type == PeerMessage::kHelloOk || type == PeerMessage::kError;
}

Result<PeerHeader> decode_header(std::span<const std::byte, kPeerHeaderBytes> bytes, bool any_version_at_hello) {
  ByteReader reader(bytes);
  const auto magic = reader.get<std::uint32_t>().value_or(0);
  const auto version = reader.get<std::uint16_t>().value_or(0);
  const auto type = reader.get<std::uint16_t>().value_or(0);
  const auto length = reader.get<std::uint32_t>().value_or(0);
  if (magic != kPeerMagic) return fail(ErrorCode::kBadMagic, fmt::format("bad peer frame magic 0x{:08x}", magic));
  const auto message = static_cast<PeerMessage>(type);
  const bool other_version_allowed = any_version_at_hello && version_stable(message);
  if (version != kPeerVersion && !other_version_allowed) {
    return fail(ErrorCode::kBadVersion,
                fmt::format("peer frame of wire version {} (this kvrelay speaks {})", version, kPeerVersion));
  }
  if (version == kPeerVersion && !known_peer_message(type)) {
    return fail(ErrorCode::kProtocol, fmt::format("unknown peer message type {}", type));
  }
  const std::uint64_t limit = max_payload_bytes(message);
  if (length > limit)
    return fail(ErrorCode::kProtocol, fmt::format("peer frame of {} bytes exceeds {}", length, limit));
  return PeerHeader{message, length, version};
}

void encode_header_with_version(std::span<std::byte, kPeerHeaderBytes> out, PeerMessage type, std::uint32_t length,
                                std::uint16_t version) {
  const std::uint16_t type_value = static_cast<std::uint16_t>(type);
  std::memcpy(out.data(), &kPeerMagic, 4);
  std::memcpy(out.data() + 4, &version, 2);
  std::memcpy(out.data() + 6, &type_value, 2);
  std::memcpy(out.data() + 8, &length, 4);
}

}  // namespace

Result<PeerHeader> decode_peer_header(std::span<const std::byte, kPeerHeaderBytes> bytes) {
  return decode_header(bytes, false);
}

Result<PeerHeader> decode_hello_header(std::span<const std::byte, kPeerHeaderBytes> bytes) {
  return decode_header(bytes, true);
}

Error wire_version_mismatch(std::uint16_t theirs, std::string_view who) {
  return Error{ErrorCode::kBadVersion,
               fmt::format("{} speaks peer wire version {} and this kvrelay speaks {}: both ends of a peer link "
                           "must run a kvrelay release of the same wire version (docs/wire-format.md, "
                           "\"Wire versions\")",
                           who, theirs, kPeerVersion)};
}

void encode_peer_header(std::span<std::byte, kPeerHeaderBytes> out, PeerMessage type, std::uint32_t length) {
  encode_header_with_version(out, type, length, kPeerVersion);
}

std::vector<std::byte> encode_peer_frame(PeerMessage type, std::span<const std::byte> payload, std::uint16_t version) {
  std::vector<std::byte> frame(kPeerHeaderBytes + payload.size());
  encode_header_with_version(std::span<std::byte, kPeerHeaderBytes>(frame.data(), kPeerHeaderBytes), type,
                             static_cast<std::uint32_t>(payload.size()), version);
  if (!payload.empty()) std::memcpy(frame.data() + kPeerHeaderBytes, payload.data(), payload.size());
  return frame;
}

std::vector<std::byte> encode_hello(PeerMessage type, const Hello& hello) {
  ByteWriter writer;
  writer.put(hello.protocol_version).put(hello.capabilities).put_string(hello.node_id).put(hello.max_chunk_bytes);
  writer.put_string(hello.shm_socket);
  return encode_peer_frame(type, writer.bytes());
}

Result<Hello> decode_hello(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  Hello hello;
  const auto version = reader.get<std::uint32_t>();
  const auto capabilities = reader.get<std::uint64_t>();
  auto node = reader.get_string();
  const auto max_chunk = reader.get<std::uint32_t>();
  auto socket = reader.get_string();
  if (!version || !capabilities || !node || !max_chunk || !socket || reader.remaining() != 0) {
    return fail(ErrorCode::kProtocol, "malformed hello");
  }
  if (*version != kPeerVersion) return wire_version_mismatch(static_cast<std::uint16_t>(*version), "the peer's hello");
  if (*max_chunk == 0 || *max_chunk > kMaxChunkBytes) return fail(ErrorCode::kProtocol, "bad max chunk size");
  hello.protocol_version = *version;
  hello.capabilities = *capabilities;
  hello.node_id = std::move(*node);
  hello.max_chunk_bytes = *max_chunk;
  hello.shm_socket = std::move(*socket);
  return hello;
}

void encode_chunk_header(std::span<std::byte, kChunkHeaderBytes> out, const ChunkHeader& chunk) {
  std::memcpy(out.data(), &chunk.transfer_id, 8);
  std::memcpy(out.data() + 8, &chunk.index, 4);
  std::memcpy(out.data() + 12, &chunk.checksum, 8);
}

ChunkHeader decode_chunk_header(std::span<const std::byte, kChunkHeaderBytes> bytes) {
  ChunkHeader chunk;
  std::memcpy(&chunk.transfer_id, bytes.data(), 8);
  std::memcpy(&chunk.index, bytes.data() + 8, 4);
  std::memcpy(&chunk.checksum, bytes.data() + 12, 8);
  return chunk;
}

std::array<std::byte, kStreamHeaderBytes> stream_header_bytes(const EncodedEntryHeader& header) {
  std::array<std::byte, kStreamHeaderBytes> bytes{};
  std::byte* out = bytes.data();
  const auto put = [&out](const auto& value) {
    std::memcpy(out, &value, sizeof(value));
    out += sizeof(value);
  };
  put(header.id);
  put(header.key.model_id);
  put(header.key.context_hash);
  put(header.frame_bytes);
  put(header.chunk_bytes);
  put(header.window_chunks);
  return bytes;
}

std::uint32_t transfer_chunk_bytes(std::uint32_t configured, std::uint64_t bytes) noexcept {
  if (bytes > configured || bytes < kSplitTransferMinBytes) return configured;
  constexpr std::uint64_t kPage = 4096;
  const std::uint64_t half = (bytes + 1) / 2;
  return static_cast<std::uint32_t>((half + kPage - 1) / kPage * kPage);
}

std::vector<std::byte> encode_chunk_ack(std::uint64_t id, std::uint32_t index) {
  ByteWriter writer;
  writer.put(id).put(index);
  return encode_peer_frame(PeerMessage::kChunkAck, writer.bytes());
}

Result<ChunkAck> decode_chunk_ack(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  const auto id = reader.get<std::uint64_t>();
  const auto index = reader.get<std::uint32_t>();
  if (!id || !index || reader.remaining() != 0) return fail(ErrorCode::kProtocol, "malformed chunk acknowledgement");
  return ChunkAck{*id, *index};
}

std::vector<std::byte> encode_committed(std::uint64_t id) {
  ByteWriter writer;
  writer.put(id);
  return encode_peer_frame(PeerMessage::kCommitted, writer.bytes());
}

Result<std::uint64_t> decode_committed(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  const auto id = reader.get<std::uint64_t>();
  if (!id || reader.remaining() != 0) return fail(ErrorCode::kProtocol, "malformed committed");
  return *id;
}

std::vector<std::byte> encode_peer_stats(const PeerServerStats& stats) {
  ByteWriter writer;
  writer.put(stats.sessions).put(stats.active_transfers).put(stats.committed_transfers);
  writer.put(stats.duplicate_transfers).put(stats.failed_transfers).put(stats.bytes_received);
  writer.put(stats.chunks_received).put(stats.fetches_served);
  return encode_peer_frame(PeerMessage::kStatsReply, writer.bytes());
}

Result<PeerServerStats> decode_peer_stats(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  PeerServerStats stats;
  for (std::uint64_t* field :
       {&stats.sessions, &stats.active_transfers, &stats.committed_transfers, &stats.duplicate_transfers,
        &stats.failed_transfers, &stats.bytes_received, &stats.chunks_received, &stats.fetches_served}) {
    const auto value = reader.get<std::uint64_t>();
    if (!value) return fail(ErrorCode::kTruncated, "peer stats truncated");
    *field = *value;
  }
  if (reader.remaining() != 0) return fail(ErrorCode::kProtocol, "trailing bytes in peer stats");
  return stats;
}

std::vector<std::byte> encode_peer_error_for_version(const Error& error, std::uint16_t version) {
  ByteWriter writer;
  writer.put(static_cast<std::uint16_t>(error.code));
  writer.put_string(std::string_view(error.message).substr(0, 4000));
  return encode_peer_frame(PeerMessage::kError, writer.bytes(), version);
}

std::vector<std::byte> encode_peer_error(const Error& error) {
  return encode_peer_error_for_version(error, kPeerVersion);
}

Error decode_peer_error(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  const auto code = reader.get<std::uint16_t>();
  auto text = reader.get_string();
  if (!code || !text || reader.remaining() != 0) return Error{ErrorCode::kProtocol, "malformed peer error"};
  return Error{static_cast<ErrorCode>(*code), std::move(*text)};
}

namespace {

// Doubles go as their IEEE 754 bits, little-endian like every other field.
void put_f64(ByteWriter& writer, double value) {
  writer.put(std::bit_cast<std::uint64_t>(value));
}

std::optional<double> get_f64(ByteReader& reader) {
  const auto bits = reader.get<std::uint64_t>();
  if (!bits) return std::nullopt;
  return std::bit_cast<double>(*bits);
}

// A product in [0, 1] (`zero_allowed`) or (0, 1]; NaN and -0 are refused, so every accepted
// value encodes back to the same bits.
Status check_product(double value, bool zero_allowed, std::string_view what) {
  const bool in_range = zero_allowed ? value >= 0.0 && value <= 1.0 : value > 0.0 && value <= 1.0;
  if (!in_range || std::signbit(value)) {
    return fail(ErrorCode::kProtocol, fmt::format("{} {} outside {}", what, value, zero_allowed ? "[0, 1]" : "(0, 1]"));
  }
  return ok();
}

Status check_route(const std::string& route, std::string_view what) {
  if (route.size() > kMaxRouteBytes) {
    return fail(ErrorCode::kProtocol,
                fmt::format("{} names a route of {} bytes, more than {}", what, route.size(), kMaxRouteBytes));
  }
  return ok();
}

}  // namespace

std::string_view push_purpose_name(PushPurpose purpose) noexcept {
  switch (purpose) {
    case PushPurpose::kPush:
      return "push";
    case PushPurpose::kPrefetch:
      return "prefetch";
    case PushPurpose::kSpill:
      return "spill";
  }
  return "unknown";
}

std::vector<std::byte> encode_fetch(const FetchRequest& request) {
  ByteWriter writer;
  writer.put(request.request_id).put(request.model_id).put_string(request.codec);
  writer.put(static_cast<std::uint32_t>(request.hashes.size()));
  for (const std::uint64_t hash : request.hashes)
    writer.put(hash);
  writer.put(request.skip_tokens).put_string(request.route).put(request.deadline_ms);
  put_f64(writer, request.min_fidelity_product);
  return encode_peer_frame(PeerMessage::kFetch, writer.bytes());
}

Result<FetchRequest> decode_fetch(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  FetchRequest request;
  const auto id = reader.get<std::uint64_t>();
  const auto model = reader.get<std::uint64_t>();
  auto codec = reader.get_string();
  const auto count = reader.get<std::uint32_t>();
  if (!id || !model || !codec || !count) return fail(ErrorCode::kTruncated, "fetch request truncated");
  // skip_tokens, the route's length, deadline_ms and min_fidelity_product follow the hashes.
  constexpr std::uint64_t kTrailerBytes = 8 + 2 + 4 + 8;
  const std::uint64_t hash_bytes = std::uint64_t{*count} * 8;
  if (hash_bytes + kTrailerBytes > reader.remaining()) {
    return fail(ErrorCode::kProtocol,
                fmt::format("fetch request announces {} hashes but carries {} bytes", *count, reader.remaining()));
  }
  if (codec->empty()) return fail(ErrorCode::kInvalidArgument, "fetch request names no codec");
  request.request_id = *id;
  request.model_id = *model;
  request.codec = std::move(*codec);
  request.hashes.reserve(*count);
  for (std::uint32_t index = 0; index < *count; ++index)
    request.hashes.push_back(*reader.get<std::uint64_t>());
  const auto skip = reader.get<std::uint64_t>();
  auto route = reader.get_string();
  const auto deadline = reader.get<std::uint32_t>();
  const auto min_product = get_f64(reader);
  if (!skip || !route || !deadline || !min_product) return fail(ErrorCode::kTruncated, "fetch request truncated");
  if (reader.remaining() != 0) {
    return fail(ErrorCode::kProtocol, fmt::format("{} trailing bytes in a fetch request", reader.remaining()));
  }
  KVRELAY_TRY(check_route(*route, "fetch request"));
  KVRELAY_TRY(check_product(*min_product, true, "fetch request: min_fidelity_product"));
  request.skip_tokens = *skip;
  request.route = std::move(*route);
  request.deadline_ms = *deadline;
  request.min_fidelity_product = *min_product;
  return request;
}

namespace {

void put_encoded_fields(ByteWriter& writer, const EncodedEntryHeader& header) {
  kv_store::encode_key(writer, header.key);
  writer.put(header.frame_bytes).put(header.chunk_bytes).put(header.window_chunks);
  kv_store::encode_chain(writer, header.chain);
}

// What follows the chain: a fetch reply's product, or a push's route, purpose, delta and product.
enum class EntryHeaderKind { kFetchReply, kPush };

Result<EncodedEntryHeader> get_encoded_fields(ByteReader& reader, std::uint64_t id, EntryHeaderKind kind) {
  EncodedEntryHeader header;
  header.id = id;
  const auto key = kv_store::decode_key(reader);
  const auto frame_bytes = reader.get<std::uint64_t>();
  const auto chunk_bytes = reader.get<std::uint32_t>();
  const auto window_chunks = reader.get<std::uint32_t>();
  if (!key || !frame_bytes || !chunk_bytes || !window_chunks)
    return fail(ErrorCode::kProtocol, "malformed encoded entry header");
  auto chain = kv_store::decode_chain(reader);
  if (!chain) return fail(chain.error().code, "encoded entry header: " + chain.error().message);
  header.chain = std::move(chain).value();
  const bool push = kind == EntryHeaderKind::kPush;
  std::optional<std::string> route;  // a push's: "" names none
  std::optional<std::uint8_t> purpose;
  std::optional<std::uint64_t> skip;
  if (push) {
    route = reader.get_string();
    purpose = reader.get<std::uint8_t>();
    skip = reader.get<std::uint64_t>();
  }
  const auto product = get_f64(reader);
  if (!product || (push && (!route || !purpose || !skip))) {
    return fail(ErrorCode::kTruncated, "encoded entry header truncated after its chain");
  }
  if (reader.remaining() != 0) {
    return fail(ErrorCode::kProtocol, fmt::format("{} trailing bytes in an encoded entry header", reader.remaining()));
  }
  if (push) {
    KVRELAY_TRY(check_route(*route, "push header"));
    if (*purpose > static_cast<std::uint8_t>(PushPurpose::kSpill)) {
      return fail(ErrorCode::kProtocol,
                  fmt::format("push purpose {} unknown (0 push, 1 prefetch, 2 spill)", int{*purpose}));
    }
    header.route = std::move(*route);
    header.purpose = static_cast<PushPurpose>(*purpose);
    header.skip_tokens = *skip;
  }
  KVRELAY_TRY(check_product(*product, false, "encoded entry header: fidelity_product"));
  header.fidelity_product = *product;
  if (*window_chunks == 0 || *window_chunks > kMaxWindowChunks) {
    return fail(ErrorCode::kProtocol,
                fmt::format("window of {} chunks outside 1..{}", *window_chunks, kMaxWindowChunks));
  }
  if (*chunk_bytes == 0 || *chunk_bytes > kMaxChunkBytes) {
    return fail(ErrorCode::kProtocol, fmt::format("chunk size {} outside 1..{}", *chunk_bytes, kMaxChunkBytes));
  }
  if (*frame_bytes == 0) return fail(ErrorCode::kProtocol, "encoded entry of 0 bytes");
  header.key = *key;
  header.frame_bytes = *frame_bytes;
  header.chunk_bytes = *chunk_bytes;
  header.window_chunks = *window_chunks;
  if (header.chunk_count() > UINT32_MAX) return fail(ErrorCode::kOverflow, "too many chunks");
  return header;
}

}  // namespace

std::vector<std::byte> encode_fetch_reply(std::uint64_t request_id, const EncodedEntryHeader* found) {
  ByteWriter writer;
  writer.put(request_id).put(static_cast<std::uint8_t>(found != nullptr ? 1 : 0));
  if (found != nullptr) {
    put_encoded_fields(writer, *found);
    put_f64(writer, found->fidelity_product);
  }
  return encode_peer_frame(PeerMessage::kFetchReply, writer.bytes());
}

Result<std::optional<EncodedEntryHeader>> decode_fetch_reply(std::span<const std::byte> payload,
                                                             std::uint64_t expected_id) {
  ByteReader reader(payload);
  const auto id = reader.get<std::uint64_t>();
  const auto found = reader.get<std::uint8_t>();
  if (!id || !found) return fail(ErrorCode::kTruncated, "fetch reply truncated");
  if (*id != expected_id) return fail(ErrorCode::kProtocol, fmt::format("fetch reply for request {}", *id));
  if (*found == 0) {
    if (reader.remaining() != 0) return fail(ErrorCode::kProtocol, "trailing bytes in a fetch miss");
    return std::optional<EncodedEntryHeader>{};
  }
  if (*found != 1) return fail(ErrorCode::kProtocol, "bad fetch reply flag");
  KVRELAY_TRY(auto header, get_encoded_fields(reader, *id, EntryHeaderKind::kFetchReply));
  return std::optional<EncodedEntryHeader>(header);
}

std::vector<std::byte> encode_push_encoded(const EncodedEntryHeader& header) {
  ByteWriter writer;
  writer.put(header.id);
  put_encoded_fields(writer, header);
  writer.put_string(header.route).put(static_cast<std::uint8_t>(header.purpose)).put(header.skip_tokens);
  put_f64(writer, header.fidelity_product);
  return encode_peer_frame(PeerMessage::kPushEncoded, writer.bytes());
}

Result<EncodedEntryHeader> decode_push_encoded(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  const auto id = reader.get<std::uint64_t>();
  if (!id) return fail(ErrorCode::kTruncated, "push header truncated");
  return get_encoded_fields(reader, *id, EntryHeaderKind::kPush);
}

std::vector<std::byte> encode_summary(std::span<const kv_store::EntryKey> keys, const NodeState& node,
                                      std::span<const double> products) {
  ByteWriter writer;
  writer.put(node.store_budget).put(node.store_used).put(node.arena_capacity).put(node.arena_in_use);
  writer.put(node.queued_transfers).put(node.spill_accept_left).put(node.link_bytes_per_s).put(node.sent_bytes_per_s);
  const auto count = std::min(keys.size(), kMaxSummaryKeys);
  writer.put(static_cast<std::uint32_t>(count));
  for (std::size_t index = 0; index < count; ++index) {
    kv_store::encode_key(writer, keys[index]);
    put_f64(writer, index < products.size() ? products[index] : 1.0);
  }
  return encode_peer_frame(PeerMessage::kSummaryReply, writer.bytes());
}

Result<SummaryReply> decode_summary(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  SummaryReply summary;
  NodeState& node = summary.node;
  for (std::uint64_t* field :
       {&node.store_budget, &node.store_used, &node.arena_capacity, &node.arena_in_use, &node.queued_transfers,
        &node.spill_accept_left, &node.link_bytes_per_s, &node.sent_bytes_per_s}) {
    const auto value = reader.get<std::uint64_t>();
    if (!value) return fail(ErrorCode::kTruncated, "summary truncated in its node state");
    *field = *value;
  }
  const auto count = reader.get<std::uint32_t>();
  if (!count) return fail(ErrorCode::kTruncated, "summary truncated before its key count");
  if (*count > kMaxSummaryKeys) {
    return fail(ErrorCode::kProtocol, fmt::format("summary announces {} keys, more than {}", *count, kMaxSummaryKeys));
  }
  if (std::uint64_t{*count} * kSummaryKeyBytes != reader.remaining()) {
    return fail(ErrorCode::kProtocol,
                fmt::format("summary announces {} keys but carries {} bytes", *count, reader.remaining()));
  }
  summary.keys.reserve(*count);
  summary.products.reserve(*count);
  for (std::uint32_t index = 0; index < *count; ++index) {
    summary.keys.push_back(*kv_store::decode_key(reader));
    const double product = *get_f64(reader);
    KVRELAY_TRY(check_product(product, false, "summary key fidelity_product"));
    summary.products.push_back(product);
  }
  return summary;
}

std::vector<std::byte> encode_probe(std::uint32_t bytes) {
  ByteWriter writer;
  writer.put(bytes);
  return encode_peer_frame(PeerMessage::kProbe, writer.bytes());
}

Result<std::uint32_t> decode_probe(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  const auto bytes = reader.get<std::uint32_t>();
  if (!bytes || reader.remaining() != 0) {
    return fail(ErrorCode::kProtocol, fmt::format("probe payload of {} bytes, not 4", payload.size()));
  }
  if (*bytes == 0 || *bytes > kMaxProbeBytes) {
    return fail(ErrorCode::kProtocol, fmt::format("probe asks for {} bytes, not 1..{}", *bytes, kMaxProbeBytes));
  }
  return *bytes;
}

std::vector<std::byte> encode_ucx_open(std::span<const std::byte> worker_address) {
  ByteWriter writer;
  writer.put(static_cast<std::uint32_t>(worker_address.size()));
  writer.put_bytes(worker_address);
  return encode_peer_frame(PeerMessage::kUcxOpen, writer.bytes());
}

Result<std::vector<std::byte>> decode_ucx_open(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  const auto length = reader.get<std::uint32_t>();
  if (!length || *length == 0 || reader.remaining() != *length) {
    return fail(ErrorCode::kProtocol, fmt::format("UCX open of {} bytes: not a worker address", payload.size()));
  }
  const auto address = reader.get_bytes(*length);
  return std::vector<std::byte>(address->begin(), address->end());
}

std::vector<std::byte> encode_ucx_open_reply(const UcxOpenReply& reply) {
  ByteWriter writer;
  writer.put_bytes(reply.token);
  writer.put(static_cast<std::uint32_t>(reply.worker_address.size()));
  writer.put_bytes(reply.worker_address);
  return encode_peer_frame(PeerMessage::kUcxOpenReply, writer.bytes());
}

Result<UcxOpenReply> decode_ucx_open_reply(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  UcxOpenReply reply;
  const auto token = reader.get_bytes(kUcxTokenBytes);
  const auto length = reader.get<std::uint32_t>();
  if (!token || !length || *length == 0 || reader.remaining() != *length) {
    return fail(ErrorCode::kProtocol,
                fmt::format("UCX open reply of {} bytes: not a token and a worker address", payload.size()));
  }
  std::copy(token->begin(), token->end(), reply.token.begin());
  const auto address = reader.get_bytes(*length);
  reply.worker_address.assign(address->begin(), address->end());
  return reply;
}

}  // namespace kvrelay::peer
