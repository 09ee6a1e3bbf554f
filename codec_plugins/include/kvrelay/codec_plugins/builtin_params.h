#pragma once

// Parameters of the built-in codecs. On the wire (the frame's params field) they are 20 bytes,
// five little-endian 32-bit fields in this order; each codec validates the fields it uses. The
// fourth field holds keep_permille in bits 0-15 and, in bit 16, sparse's selection mode: set
// selects per layer and kv head (per_position false), clear one set of positions for all of
// them (the default, whose bytes are those of the field before the mode existed); other bits 0.

#include <array>
#include <cstddef>
#include <cstdint>

#include "kvrelay/core/result.h"

namespace kvrelay::codec {

struct BuiltinParams {
  std::uint32_t sink_tokens = 4;      // leading tokens kept exact by lossy codecs
  std::uint32_t recent_tokens = 128;  // trailing tokens kept exact by lossy codecs
  std::uint32_t group_size = 32;      // int8/int4: tokens per key group, channels per value group
  std::uint32_t keep_permille = 250;  // sparse: fraction of the middle tokens kept
  std::int32_t zstd_level = 1;        // lossless: zstd level of each byte plane
  // sparse: one set of kept positions shared by every layer and kv head (sparse_keep_positions,
  // what the kv_sparse medium delivers); false: chosen per layer and kv head.
  bool per_position = true;

  static constexpr std::size_t kWireSize = 20;
  static constexpr std::uint32_t kMaxGroupSize = 1024;
  static constexpr std::uint32_t kKeepPermilleMask = 0xFFFFU;   // wire field 4, bits 0-15
  static constexpr std::uint32_t kSparsePerHeadBit = 1U << 16;  // wire field 4, bit 16

  [[nodiscard]] std::array<std::uint8_t, kWireSize> serialize() const;
  [[nodiscard]] static Result<BuiltinParams> parse(const void* data, std::size_t size);

  friend bool operator==(const BuiltinParams&, const BuiltinParams&) = default;
};

}  // namespace kvrelay::codec
