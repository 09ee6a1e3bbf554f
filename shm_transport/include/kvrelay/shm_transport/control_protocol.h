#pragma once

// Framing of the worker <-> sidecar control protocol (one SOCK_SEQPACKET datagram per frame;
// byte layout in docs/wire-format.md, "Control protocol (Unix socket)").

#include <cstdint>
#include <span>
#include <vector>

#include "kvrelay/core/result.h"

namespace kvrelay::shm {

inline constexpr std::uint32_t kControlMagic = 0x4352564BU;  // "KVRC" in little-endian byte order
inline constexpr std::uint16_t kControlVersion = 1;
inline constexpr std::size_t kControlHeaderBytes = 16;

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
};
[[nodiscard]] std::vector<std::byte> encode_stats(const ServerStats& stats);
[[nodiscard]] Result<ServerStats> decode_stats(std::span<const std::byte> payload);

}  // namespace kvrelay::shm
