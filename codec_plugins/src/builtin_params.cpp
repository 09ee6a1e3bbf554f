#include "kvrelay/codec_plugins/builtin_params.h"

#include <fmt/format.h>

#include <cstring>

namespace kvrelay::codec {

std::array<std::uint8_t, BuiltinParams::kWireSize> BuiltinParams::serialize() const {
  std::array<std::uint8_t, kWireSize> bytes{};
  std::memcpy(bytes.data() + 0, &sink_tokens, 4);
  std::memcpy(bytes.data() + 4, &recent_tokens, 4);
  std::memcpy(bytes.data() + 8, &group_size, 4);
  // A fraction that does not fit its 16 bits is written as a field parse() refuses, never aliased.
  const std::uint32_t keep =
      keep_permille > kKeepPermilleMask ? ~std::uint32_t{0} : keep_permille | (per_position ? 0U : kSparsePerHeadBit);
  std::memcpy(bytes.data() + 12, &keep, 4);
  std::memcpy(bytes.data() + 16, &zstd_level, 4);
  return bytes;
}

Result<BuiltinParams> BuiltinParams::parse(const void* data, std::size_t size) {
  if (size != kWireSize || data == nullptr) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("built-in codec params are {} bytes, got {}", kWireSize, size));
  }
  BuiltinParams params;
  const auto* bytes = static_cast<const std::uint8_t*>(data);
  std::memcpy(&params.sink_tokens, bytes + 0, 4);
  std::memcpy(&params.recent_tokens, bytes + 4, 4);
  std::memcpy(&params.group_size, bytes + 8, 4);
  std::uint32_t keep = 0;
  std::memcpy(&keep, bytes + 12, 4);
  std::memcpy(&params.zstd_level, bytes + 16, 4);
  if ((keep & ~(kKeepPermilleMask | kSparsePerHeadBit)) != 0) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("keep field {:#x}: bits 17-31 set", keep));
  }
  params.keep_permille = keep & kKeepPermilleMask;
  params.per_position = (keep & kSparsePerHeadBit) == 0;
  if (params.group_size < 2 || params.group_size > kMaxGroupSize || params.group_size % 2 != 0) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("group size {} not even in 2..{}", params.group_size, kMaxGroupSize));
  }
  if (params.keep_permille > 1000) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("keep fraction {} per mille above 1000", params.keep_permille));
  }
  if (params.zstd_level < -7 || params.zstd_level > 19) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("zstd level {} outside -7..19", params.zstd_level));
  }
  return params;
}

}  // namespace kvrelay::codec
