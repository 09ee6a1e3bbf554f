#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace kvrelay {

// Element type of KV tensors. Values are part of the wire format: never renumber.
enum class DType : std::uint8_t {
  kFloat32 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  // 1-byte KV of engines that run an fp8 kv_cache_dtype (vLLM's "fp8_e4m3" / "fp8_e5m2"). Moved as
  // tagged bytes: stored, sent raw or through a lossless codec, never converted or quantized.
  kFp8E4M3 = 4,
  kFp8E5M2 = 5,
};

[[nodiscard]] constexpr std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::kFloat32:
      return 4U;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2U;
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
      return 1U;
  }
  return 0U;  // not a DType: callers validate with dtype_from_wire first
}

// Whether KV of this dtype may only move as its bytes (raw or lossless): the lossy codecs
// quantize 2- and 4-byte floats, and an fp8 cache is already the engine's own quantization.
[[nodiscard]] constexpr bool dtype_moves_as_bytes(DType dtype) noexcept {
  return dtype == DType::kFp8E4M3 || dtype == DType::kFp8E5M2;
}

// "fp32" / "fp16" / "bf16" / "fp8_e4m3" / "fp8_e5m2".
[[nodiscard]] std::string_view dtype_name(DType dtype) noexcept;
// The names above, and torch's ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2", ...).
[[nodiscard]] std::optional<DType> parse_dtype(std::string_view name) noexcept;
[[nodiscard]] std::optional<DType> dtype_from_wire(std::uint8_t value) noexcept;

}  // namespace kvrelay
