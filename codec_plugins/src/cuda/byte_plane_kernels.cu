// CUDA byte-plane split/merge for the lossless codec (the zstd stage stays on the CPU). Plane
// order as byte_planes.h (plane 0 = most significant byte). The fast kernels move 16 elements per
// thread with byte permutes, so each plane gets one 16-byte store; sizes that are not a multiple
// of 16 elements, or unaligned buffers, take the one-thread-per-element kernels.

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

// Splits four 32-bit words (4 elements of 4 bytes, or 8 of 2) into per-plane words.
__device__ __forceinline__ void split_words(const std::uint32_t (&w)[4], std::size_t element_size,
                                            std::uint32_t (&plane_words)[4]) {
  if (element_size == 2) {
    // Plane 0: high bytes of elements 0-3 (w0, w1), then of 4-7 (w2, w3); plane 1: the low bytes.
    plane_words[0] = __byte_perm(w[0], w[1], 0x7531);
    plane_words[1] = __byte_perm(w[2], w[3], 0x7531);
    plane_words[2] = __byte_perm(w[0], w[1], 0x6420);
    plane_words[3] = __byte_perm(w[2], w[3], 0x6420);
    return;
  }
  const std::uint32_t low01 = __byte_perm(w[0], w[1], 0x5140);   // e0b0 e1b0 e0b1 e1b1
  const std::uint32_t high01 = __byte_perm(w[0], w[1], 0x7362);  // e0b2 e1b2 e0b3 e1b3
  const std::uint32_t low23 = __byte_perm(w[2], w[3], 0x5140);
  const std::uint32_t high23 = __byte_perm(w[2], w[3], 0x7362);
  plane_words[3] = __byte_perm(low01, low23, 0x5410);  // byte 0 of e0..e3
  plane_words[2] = __byte_perm(low01, low23, 0x7632);
  plane_words[1] = __byte_perm(high01, high23, 0x5410);
  plane_words[0] = __byte_perm(high01, high23, 0x7632);  // byte 3 (most significant)
}

// Inverse of split_words.
__device__ __forceinline__ void merge_words(const std::uint32_t (&plane_words)[4], std::size_t element_size,
                                            std::uint32_t (&w)[4]) {
  if (element_size == 2) {
    w[0] = __byte_perm(plane_words[2], plane_words[0], 0x5140);
    w[1] = __byte_perm(plane_words[2], plane_words[0], 0x7362);
    w[2] = __byte_perm(plane_words[3], plane_words[1], 0x5140);
    w[3] = __byte_perm(plane_words[3], plane_words[1], 0x7362);
    return;
  }
  const std::uint32_t low01 = __byte_perm(plane_words[3], plane_words[2], 0x5140);   // e0b0 e0b1 e1b0 e1b1
  const std::uint32_t low23 = __byte_perm(plane_words[3], plane_words[2], 0x7362);   // e2b0 e2b1 e3b0 e3b1
  const std::uint32_t high01 = __byte_perm(plane_words[1], plane_words[0], 0x5140);  // e0b2 e0b3 e1b2 e1b3
  const std::uint32_t high23 = __byte_perm(plane_words[1], plane_words[0], 0x7362);
  w[0] = __byte_perm(low01, high01, 0x5410);
  w[1] = __byte_perm(low01, high01, 0x7632);
  w[2] = __byte_perm(low23, high23, 0x5410);
  w[3] = __byte_perm(low23, high23, 0x7632);
}

// One thread per 16 elements: element_size 16-byte loads in, one 16-byte store per plane out.
template <std::size_t ElementSize>
__global__ void split_vector_kernel(const uint4* source, std::size_t vectors, std::size_t plane_vectors,
                                    uint4* planes) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= vectors) return;
  std::uint32_t out[ElementSize][4];
#pragma unroll
  for (std::size_t part = 0; part < ElementSize; ++part) {
    const uint4 raw = source[i * ElementSize + part];
    const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
    std::uint32_t plane_words[4];
    split_words(words, ElementSize, plane_words);
    // This part holds 16 / ElementSize elements: one word (4 bytes) per plane for 4-byte
    // elements, two words per plane for 2-byte elements.
#pragma unroll
    for (std::size_t plane = 0; plane < ElementSize; ++plane) {
      if constexpr (ElementSize == 2) {
        out[plane][2 * part] = plane_words[2 * plane];
        out[plane][2 * part + 1] = plane_words[2 * plane + 1];
      } else {
        out[plane][part] = plane_words[plane];
      }
    }
  }
#pragma unroll
  for (std::size_t plane = 0; plane < ElementSize; ++plane)
    planes[plane * plane_vectors + i] = make_uint4(out[plane][0], out[plane][1], out[plane][2], out[plane][3]);
}

template <std::size_t ElementSize>
__global__ void merge_vector_kernel(const uint4* planes, std::size_t vectors, std::size_t plane_vectors,
                                    uint4* destination) {
  const std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
  if (i >= vectors) return;
  std::uint32_t in[ElementSize][4];
#pragma unroll
  for (std::size_t plane = 0; plane < ElementSize; ++plane) {
    const uint4 raw = planes[plane * plane_vectors + i];
    in[plane][0] = raw.x;
    in[plane][1] = raw.y;
    in[plane][2] = raw.z;
    in[plane][3] = raw.w;
  }
#pragma unroll
  for (std::size_t part = 0; part < ElementSize; ++part) {
    std::uint32_t plane_words[4];
#pragma unroll
    for (std::size_t plane = 0; plane < ElementSize; ++plane) {
      if constexpr (ElementSize == 2) {
        plane_words[2 * plane] = in[plane][2 * part];
        plane_words[2 * plane + 1] = in[plane][2 * part + 1];
      } else {
        plane_words[plane] = in[plane][part];
      }
    }
    std::uint32_t words[4];
    merge_words(plane_words, ElementSize, words);
    destination[i * ElementSize + part] = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// 4-byte merge with coalesced stores: a thread writes whole 16-byte outputs (4 elements, one
// word from each plane) at a block stride, kMergeOutputsPerThread of them, loads issued first.
constexpr int kMergeOutputsPerThread = 4;

__global__ void merge4_kernel(const std::uint32_t* planes, std::size_t outputs, uint4* destination) {
  const std::size_t first = blockIdx.x * static_cast<std::size_t>(blockDim.x) * kMergeOutputsPerThread + threadIdx.x;
  std::uint32_t plane_words[kMergeOutputsPerThread][4];
#pragma unroll
  for (int k = 0; k < kMergeOutputsPerThread; ++k) {
    const std::size_t output = first + static_cast<std::size_t>(k) * blockDim.x;
    if (output >= outputs) break;
#pragma unroll
    for (int plane = 0; plane < 4; ++plane)
      plane_words[k][plane] = planes[plane * outputs + output];
  }
#pragma unroll
  for (int k = 0; k < kMergeOutputsPerThread; ++k) {
    const std::size_t output = first + static_cast<std::size_t>(k) * blockDim.x;
    if (output >= outputs) break;
    std::uint32_t words[4];
    merge_words(plane_words[k], 4, words);
    destination[output] = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

bool aligned16(const void* pointer) {
  return reinterpret_cast<std::uintptr_t>(pointer) % 16 == 0;
}

}  // namespace

int kernel_byte_planes(bool split, const void* in, std::size_t elements, std::size_t element_size, void* out) {
  if (elements == 0) return 0;
  if (elements % 16 == 0 && aligned16(in) && aligned16(out)) {
    // A thread takes 16 elements; a plane holds elements / 16 vectors.
    const std::size_t vectors = elements / 16;
    const auto vector_blocks = static_cast<unsigned>((vectors + kThreads - 1) / kThreads);
    const auto* source = static_cast<const uint4*>(in);
    auto* target = static_cast<uint4*>(out);
    if (split && element_size == 2)
      split_vector_kernel<2><<<vector_blocks, kThreads>>>(source, vectors, vectors, target);
    if (split && element_size == 4)
      split_vector_kernel<4><<<vector_blocks, kThreads>>>(source, vectors, vectors, target);
    if (!split && element_size == 2)
      merge_vector_kernel<2><<<vector_blocks, kThreads>>>(source, vectors, vectors, target);
    if (!split && element_size == 4) {
      const std::size_t outputs = elements / 4;
      const std::size_t per_block = static_cast<std::size_t>(kThreads) * kMergeOutputsPerThread;
      merge4_kernel<<<static_cast<unsigned>((outputs + per_block - 1) / per_block), kThreads>>>(
          static_cast<const std::uint32_t*>(in), outputs, target);
    }
    cudaError_t error = cudaGetLastError();
    if (error == cudaSuccess) error = cudaDeviceSynchronize();
    return static_cast<int>(error);
  }
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
