#pragma once

// Parameters of the built-in codecs. On the wire (the frame's params field) they are 20 bytes,
// five little-endian 32-bit fields in this order; each codec validates the fields it uses.

#include <array>
#include <cstddef>
#include <cstdint>

#include "kvrelay/core/result.h"

namespace kvrelay::codec {

struct BuiltinParams {
  std::uint32_t sink_tokens = 4;      // leading tokens kept exact by lossy codecs
  std::uint32_t recent_tokens = 128;  // trailing tokens kept exact by lossy codecs
  std::uint32_t group_size = 32;      // int8/int4: tokens per key group, channels per value group
  std::uint32_t keep_permille = 250;  // sparse: fraction of the middle tokens kept, per head
  std::int32_t zstd_level = 1;        // lossless: zstd level of each byte plane

  static constexpr std::size_t kWireSize = 20;
  static constexpr std::uint32_t kMaxGroupSize = 1024;

  [[nodiscard]] std::array<std::uint8_t, kWireSize> serialize() const;
  [[nodiscard]] static Result<BuiltinParams> parse(const void* data, std::size_t size);

  friend bool operator==(const BuiltinParams&, const BuiltinParams&) = default;
};

}  // namespace kvrelay::codec
