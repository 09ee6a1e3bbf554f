#pragma once

// The vectorized quantizer kernels (quant_vector_kernels.cu) and the shapes they cover; the
// per-tensor kernels of quant_kernels.cu take every other shape.

#include "kernel_api.h"

namespace kvrelay::codec::cuda {

// 16-byte aligned KV rows, and each shared scale's segment a power-of-two count of vectors
// (at most a warp): fp8 needs head_dim / vector, int8/int4 min(group, head_dim) / vector.
[[nodiscard]] bool vector_path_applies(const KernelPlan& plan, const void* device_kv);
// As kernel_quant; returns a cudaError_t.
[[nodiscard]] int kernel_quant_vectorized(const KernelPlan& plan, bool encode, const void* device_in, void* device_out);

}  // namespace kvrelay::codec::cuda
