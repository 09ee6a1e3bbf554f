// CUDA byte-plane split/merge for the lossless codec (the zstd stage stays on the CPU).
// One thread per element; plane order as byte_planes.h (plane 0 = most significant byte).

#include <cuda_runtime.h>

#include "kernel_api.h"

namespace kvrelay::codec::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void split_kernel(const std::uint8_t* source, std::size_t elements, std::size_t element_size,
                             std::uint8_t* planes) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= elements) return;
  for (std::size_t b = 0; b < element_size; ++b) {
    planes[b * elements + i] = source[i * element_size + (element_size - 1 - b)];
  }
}

__global__ void merge_kernel(const std::uint8_t* planes, std::size_t elements, std::size_t element_size,
                             std::uint8_t* destination) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= elements) return;
  for (std::size_t b = 0; b < element_size; ++b) {
    destination[i * element_size + (element_size - 1 - b)] = planes[b * elements + i];
  }
}

}  // namespace

int kernel_byte_planes(bool split, const void* in, std::size_t elements, std::size_t element_size, void* out) {
  if (elements == 0) return 0;
  const auto blocks = static_cast<unsigned>((elements + kThreads - 1) / kThreads);
  if (split) {
    split_kernel<<<blocks, kThreads>>>(static_cast<const std::uint8_t*>(in), elements, element_size,
                                       static_cast<std::uint8_t*>(out));
  } else {
    merge_kernel<<<blocks, kThreads>>>(static_cast<const std::uint8_t*>(in), elements, element_size,
                                       static_cast<std::uint8_t*>(out));
  }
  cudaError_t error = cudaGetLastError();
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  return static_cast<int>(error);
}

}  // namespace kvrelay::codec::cuda
