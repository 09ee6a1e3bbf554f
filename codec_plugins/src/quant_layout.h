#pragma once

// Byte layout of the quantizing codecs' payload, shared by the CPU code and the CUDA kernels.
//
// For each layer, K then V:
//   sink rows, exact (sink * row_bytes), then recent rows, exact (recent * row_bytes), then the
//   quantized middle:
//   fp8:        scales f32 [middle][kv_heads], codes u8 [middle][row_elements]
//   int8/int4 K (per channel, groups of `group` tokens):
//               per token group: scales f16 [row_elements], zeros f16 [row_elements]; then codes
//   int8/int4 V (per token, groups of `group` channels inside each head):
//               per token: (scale f16, zero f16) [kv_heads][ceil(head_dim / group)]; then codes
//   codes are [middle][code_row_bytes]: int8 one byte per element, int4 two elements per byte
//   (even element in the low nibble; an odd row ends with a zero high nibble).

#include <cstddef>
#include <cstdint>

namespace kvrelay::codec::detail {

enum class QuantKind : std::uint8_t { kFp8, kInt8, kInt4 };

struct QuantSection {
  std::size_t meta_bytes = 0;
  std::size_t code_row_bytes = 0;
  std::size_t code_bytes = 0;
  [[nodiscard]] std::size_t total() const { return meta_bytes + code_bytes; }
};

inline std::size_t ceil_div(std::size_t value, std::size_t divisor) {
  return (value + divisor - 1) / divisor;
}

inline QuantSection quant_section(QuantKind kind, bool is_value, std::size_t middle, std::size_t kv_heads,
                                  std::size_t head_dim, std::size_t group) {
  const std::size_t row = kv_heads * head_dim;
  QuantSection section;
  section.code_row_bytes = kind == QuantKind::kInt4 ? ceil_div(row, 2) : row;
  section.code_bytes = middle * section.code_row_bytes;
  if (kind == QuantKind::kFp8) {
    section.meta_bytes = middle * kv_heads * 4;
  } else if (!is_value) {
    section.meta_bytes = ceil_div(middle, group) * row * 4;
  } else {
    const std::size_t value_group = group < head_dim ? group : head_dim;
    section.meta_bytes = middle * kv_heads * ceil_div(head_dim, value_group) * 4;
  }
  return section;
}

}  // namespace kvrelay::codec::detail
