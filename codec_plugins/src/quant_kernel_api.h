#pragma once

// The boundary between quant_codec.cpp (payload layout, sinks, recent window) and the per
// instruction set builds of the inner loops (quant_kernels.h): plain structs and function
// pointers working on the quantized middle of one layer's K or V.

#include <cstddef>
#include <cstdint>

namespace kvrelay::codec::detail {

struct QuantTensorDims {
  std::size_t middle = 0;  // quantized tokens
  std::size_t kv_heads = 0;
  std::size_t head_dim = 0;
  std::size_t row_elements = 0;  // kv_heads * head_dim
  std::size_t group = 0;         // key groups: tokens
  std::size_t value_group = 0;   // value groups: channels, <= head_dim
  std::size_t code_row_bytes = 0;
  float max_code = 0;
  bool int4 = false;
  // Scratch owned by the caller: 9 * row_elements floats, 2 * row_elements halves,
  // row_elements + 1 codes.
  float* scratch_floats = nullptr;
  std::uint16_t* scratch_halves = nullptr;
  std::uint8_t* scratch_codes = nullptr;
};

struct QuantEncodeArgs : QuantTensorDims {
  const std::uint8_t* rows = nullptr;  // the middle rows of the tensor
  std::uint8_t* meta = nullptr;
  std::uint8_t* codes = nullptr;
};

struct QuantDecodeArgs : QuantTensorDims {
  const std::uint8_t* meta = nullptr;
  const std::uint8_t* codes = nullptr;
  std::uint8_t* rows = nullptr;
};

using QuantEncodeFn = void (*)(const QuantEncodeArgs&);
using QuantDecodeFn = void (*)(const QuantDecodeArgs&);

// The loops for one source dtype.
struct QuantKernelSet {
  QuantEncodeFn encode_keys;
  QuantDecodeFn decode_keys;
  QuantEncodeFn encode_values;
  QuantDecodeFn decode_values;
  QuantEncodeFn encode_fp8;
  QuantDecodeFn decode_fp8;
};

// Indexed by the dtype: fp32, fp16, bf16.
struct QuantKernelTable {
  QuantKernelSet fp32;
  QuantKernelSet fp16;
  QuantKernelSet bf16;
};

const QuantKernelTable& baseline_quant_kernels() noexcept;
const QuantKernelTable& avx2_quant_kernels() noexcept;
const QuantKernelTable& avx512_quant_kernels() noexcept;

}  // namespace kvrelay::codec::detail
