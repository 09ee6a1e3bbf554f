#include "codec_common.h"

#include <algorithm>

namespace kvrelay::codec::detail {

int make_shape(const kvrelay_codec_layout* layout, ElementAccess access, Shape& shape) noexcept {
  if (layout == nullptr) return KVRELAY_CODEC_E_INVALID_ARGUMENT;
  const auto dtype = dtype_from_wire(static_cast<std::uint8_t>(layout->dtype > 255 ? 0 : layout->dtype));
  if (!dtype) return KVRELAY_CODEC_E_INVALID_ARGUMENT;
  if (access == ElementAccess::kFloats && dtype_moves_as_bytes(*dtype)) return KVRELAY_CODEC_E_UNSUPPORTED;
  shape.layout = KvLayout{layout->layers, layout->kv_heads, layout->head_dim, *dtype, layout->tokens};
  auto total = shape.layout.total_bytes();
  if (!total) return static_cast<int>(total.error().code);
  auto tensor = shape.layout.tensor_bytes();
  if (!tensor) return static_cast<int>(tensor.error().code);
  if (total.value() > static_cast<std::uint64_t>(PTRDIFF_MAX)) return KVRELAY_CODEC_E_OVERFLOW;
  shape.element_size = dtype_size(*dtype);
  shape.row_elements = static_cast<std::size_t>(layout->kv_heads) * layout->head_dim;
  shape.row_bytes = shape.row_elements * shape.element_size;
  shape.tokens = static_cast<std::size_t>(layout->tokens);
  shape.tensor_bytes = static_cast<std::size_t>(tensor.value());
  shape.total_bytes = static_cast<std::size_t>(total.value());
  return KVRELAY_CODEC_OK;
}

TokenSplit split_tokens(std::size_t tokens, const BuiltinParams& params) noexcept {
  TokenSplit split;
  split.sink = std::min<std::size_t>(params.sink_tokens, tokens);
  split.recent = std::min<std::size_t>(params.recent_tokens, tokens - split.sink);
  split.middle = tokens - split.sink - split.recent;
  return split;
}

int parse_params(const void* data, std::size_t size, BuiltinParams& params) noexcept {
  auto parsed = BuiltinParams::parse(data, size);
  if (!parsed) return static_cast<int>(parsed.error().code);
  params = parsed.value();
  return KVRELAY_CODEC_OK;
}

const char* builtin_error_text(int code) noexcept {
  switch (code) {
    case KVRELAY_CODEC_OK:
      return "ok";
    case KVRELAY_CODEC_E_INVALID_ARGUMENT:
      return "invalid argument (layout, params or buffer size)";
    case KVRELAY_CODEC_E_OVERFLOW:
      return "size overflows";
    case KVRELAY_CODEC_E_TRUNCATED:
      return "payload truncated";
    case KVRELAY_CODEC_E_LAYOUT_MISMATCH:
      return "payload size disagrees with the layout";
    case KVRELAY_CODEC_E_CORRUPT:
      return "payload corrupt";
    case KVRELAY_CODEC_E_RESOURCE_EXHAUSTED:
      return "out of memory";
    case KVRELAY_CODEC_E_UNSUPPORTED:
      return "unsupported";
    default:
      return "internal error";
  }
}

void load_floats(const std::uint8_t* source, DType dtype, std::size_t count, float* destination) noexcept {
  switch (dtype) {
    case DType::kFloat32:
      copy_bytes(destination, source, count * 4);
      return;
    case DType::kFloat16:
      for (std::size_t i = 0; i < count; ++i) {
        std::uint16_t half;
        std::memcpy(&half, source + 2 * i, 2);
        destination[i] = half_to_float(half);
      }
      return;
    case DType::kBFloat16:
      for (std::size_t i = 0; i < count; ++i) {
        std::uint16_t value;
        std::memcpy(&value, source + 2 * i, 2);
        destination[i] = bf16_to_float(value);
      }
      return;
    case DType::kFp8E4M3:
      for (std::size_t i = 0; i < count; ++i) {
        // 0x7F / 0xFF are e4m3fn's NaN, which e4m3_to_float (a quantizer's decoder) never sees.
        const bool is_nan = (source[i] & 0x7FU) == 0x7FU;
        destination[i] = is_nan ? bits_to_float(0x7FC00000U) : e4m3_to_float(source[i]);
      }
      return;
    case DType::kFp8E5M2:
      for (std::size_t i = 0; i < count; ++i)
        destination[i] = e5m2_to_float(source[i]);
      return;
  }
}

void store_floats(const float* source, DType dtype, std::size_t count, std::uint8_t* destination) noexcept {
  switch (dtype) {
    case DType::kFloat32:
      copy_bytes(destination, source, count * 4);
      return;
    case DType::kFloat16:
      for (std::size_t i = 0; i < count; ++i) {
        const std::uint16_t half = float_to_half(source[i]);
        std::memcpy(destination + 2 * i, &half, 2);
      }
      return;
    case DType::kBFloat16:
      for (std::size_t i = 0; i < count; ++i) {
        const std::uint16_t value = float_to_bf16(source[i]);
        std::memcpy(destination + 2 * i, &value, 2);
      }
      return;
    case DType::kFp8E4M3:
      for (std::size_t i = 0; i < count; ++i)
        destination[i] = float_to_e4m3(source[i]);  // saturating at 448, as vLLM's fp8 cache stores
      return;
    case DType::kFp8E5M2:
      for (std::size_t i = 0; i < count; ++i)
        destination[i] = float_to_e5m2(source[i]);
      return;
  }
}

}  // namespace kvrelay::codec::detail
