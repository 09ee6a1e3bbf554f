#pragma once

// The boundary between the C++20 library and the CUDA translation units (compiled as C++17 by
// nvcc): plain structs and integer CUDA error codes only.

#include <cstddef>
#include <cstdint>

namespace kvrelay::codec::cuda {

struct KernelPlan {
  std::uint8_t kind = 0;  // detail::QuantKind
  std::uint32_t dtype = 0;
  std::size_t layers = 0;
  std::size_t heads = 0;
  std::size_t dim = 0;
  std::size_t group = 0;
  std::size_t tokens = 0;
  std::size_t sink = 0;
  std::size_t middle = 0;
  std::size_t recent = 0;
  std::size_t row_bytes = 0;
  std::size_t tensor_bytes = 0;
};

int kernel_device_count();
const char* kernel_error_text(int code);
// encode: device KV -> device payload; decode: device payload -> device KV. Returns a cudaError_t.
int kernel_quant(const KernelPlan& plan, bool encode, const void* device_in, void* device_out);
int kernel_byte_planes(bool split, const void* in, std::size_t elements, std::size_t element_size, void* out);

}  // namespace kvrelay::codec::cuda
