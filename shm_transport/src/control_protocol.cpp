#include "kvrelay/shm_transport/control_protocol.h"

#include <fmt/format.h>

#include "kvrelay/shm_transport/byte_io.h"

namespace kvrelay::shm {

namespace {

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
  if (!request_id) return fail(ErrorCode::kTruncated, fmt::format("frame of {} bytes is shorter than its header", datagram.size()));
  if (*magic != kControlMagic) return fail(ErrorCode::kBadMagic, fmt::format("bad frame magic 0x{:08x}", *magic));
  if (*version != kControlVersion) return fail(ErrorCode::kBadVersion, fmt::format("unsupported protocol version {}", *version));
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

std::vector<std::byte> encode_stats(const ServerStats& stats) {
  ByteWriter writer;
  writer.put(stats.connections).put(stats.pending_regions).put(stats.pending_bytes).put(stats.entries);
  writer.put(stats.entry_bytes).put(stats.commits).put(stats.rejected_messages).put(stats.refused_connections);
  writer.put(stats.open_rings);
  return writer.take();
}

Result<ServerStats> decode_stats(std::span<const std::byte> payload) {
  ByteReader reader(payload);
  ServerStats stats;
  for (std::uint64_t* field : {&stats.connections, &stats.pending_regions, &stats.pending_bytes, &stats.entries,
                               &stats.entry_bytes, &stats.commits, &stats.rejected_messages,
                               &stats.refused_connections, &stats.open_rings}) {
    const auto value = reader.get<std::uint64_t>();
    if (!value) return fail(ErrorCode::kTruncated, "stats reply truncated");
    *field = *value;
  }
  if (reader.remaining() != 0) return fail(ErrorCode::kProtocol, "trailing bytes in stats reply");
  return stats;
}

}  // namespace kvrelay::shm
