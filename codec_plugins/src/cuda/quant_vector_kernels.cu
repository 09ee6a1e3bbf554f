// The quantizing codecs' fast path: every thread moves one 16-byte vector of KV, all layers go in
// one launch per K/V section, and the exact sink/recent rows are two strided copies. A group's
// min/max (or a head's absmax) is reduced across the threads of its segment with warp shuffles;
// min and max are exact in any order, and make_quant_group folds -0 into +0, so the bytes equal
// the sequential CPU loops'. Shapes it does not cover go to quant_kernels.cu's per-tensor path.

#include <cuda_runtime.h>

#include "../quant_layout.h"
#include "quant_vector_kernels.h"
#include "vector_access.cuh"

namespace kvrelay::codec::cuda {
namespace {

using detail::QuantKind;
using detail::QuantSection;

constexpr int kThreads = 256;
// Tokens per thread in the per-vector kernels: four 16-byte loads in flight instead of one.
constexpr int kTokensPerThread = 4;

// One launch covers the same section (K or V) of every layer: blockIdx.y is the layer.
struct SectionLaunch {
  std::uint8_t* kv;  // the first layer's middle rows (read by encode, written by decode)
  std::size_t kv_stride;
  std::uint8_t* section;  // the first layer's quantized section (metadata, then codes)
  std::size_t section_stride;
  std::size_t middle;
  std::uint32_t heads;
  std::uint32_t dim;
  std::uint32_t row;
  std::uint32_t group;          // K: tokens per group; V: channels per group (divides dim)
  std::uint32_t segment_lanes;  // threads sharing one scale: fp8 dim / vector, V group / vector
  std::size_t meta_bytes;
  std::size_t code_row_bytes;
  float max_code;
};

// This block's layer: its KV rows and its quantized section (metadata, then codes).
struct LayerSection {
  std::uint8_t* kv;
  std::uint8_t* meta;
  std::uint8_t* codes;
};

__device__ __forceinline__ LayerSection layer_section(const SectionLaunch& p) {
  std::uint8_t* meta = p.section + blockIdx.y * p.section_stride;
  return {p.kv + blockIdx.y * p.kv_stride, meta, meta + p.meta_bytes};
}

__device__ __forceinline__ std::size_t thread_index() {
  return blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x;
}

template <std::uint32_t Dtype>
constexpr std::size_t kElementBytes = Dtype == 1 ? 4 : 2;

template <QuantKind Kind, int Count>
constexpr int kCodeBytes = Kind == QuantKind::kInt4 ? Count / 2 : Count;

// Codes of `Count` consecutive channels (Count even), packed as the payload stores them.
template <QuantKind Kind, int Count>
__device__ __forceinline__ void put_code(std::uint32_t (&words)[(kCodeBytes<Kind, Count> + 3) / 4], int i,
                                         std::uint32_t code) {
  if constexpr (Kind == QuantKind::kInt4) {
    words[i / 8] |= code << (4 * (i % 8));
  } else {
    words[i / 4] |= code << (8 * (i % 4));
  }
}

template <QuantKind Kind, int Count>
__device__ __forceinline__ std::uint32_t get_code(const std::uint32_t (&words)[(kCodeBytes<Kind, Count> + 3) / 4],
                                                  int i) {
  if constexpr (Kind == QuantKind::kInt4)
    return (words[i / 8] >> (4 * (i % 8))) & 0xFU;
  else
    return (words[i / 4] >> (8 * (i % 4))) & 0xFFU;
}

template <QuantKind Kind>
__device__ __forceinline__ std::size_t code_offset(std::size_t token, std::size_t code_row_bytes,
                                                   std::uint32_t channel) {
  return token * code_row_bytes + (Kind == QuantKind::kInt4 ? channel / 2 : channel);
}

// fp8 codes of one vector. Hardware conversion; a NaN (0x7F/0xFF, which float_to_e4m3 never
// writes) sends the vector through scaled_e4m3. Only a NaN input makes a NaN product (fp8_scale
// keeps inverses finite), and for other inputs the product's sign is the input's.
template <int Vector>
__device__ __forceinline__ void fp8_codes(const float (&x)[Vector], float inv, std::uint32_t (&words)[Vector / 4]) {
  std::uint32_t nan_bytes = 0;
#pragma unroll
  for (int w = 0; w < Vector / 4; ++w) {
    words[w] = e4m3_pair(__fmul_rn(x[4 * w], inv), __fmul_rn(x[4 * w + 1], inv)) |
               (e4m3_pair(__fmul_rn(x[4 * w + 2], inv), __fmul_rn(x[4 * w + 3], inv)) << 16);
    // A byte whose low seven bits are all set carries into its top bit.
    nan_bytes |= ((words[w] & 0x7F7F7F7FU) + 0x01010101U) & 0x80808080U;
  }
  if (nan_bytes == 0) return;
#pragma unroll
  for (int w = 0; w < Vector / 4; ++w) {
    words[w] = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      words[w] |= std::uint32_t{scaled_e4m3(x[4 * w + i], inv)} << (8 * i);
  }
}

// fp8 (K and V) and int V sections: a thread takes one vector of channels in kTokensPerThread
// consecutive tokens (loads first, so several are in flight); the threads of a segment share
// one scale.
template <std::uint32_t Dtype, QuantKind Kind>
__global__ void __launch_bounds__(kThreads) segment_encode_kernel(SectionLaunch p) {
  constexpr int kVector = kVectorElements<Dtype>;
  constexpr int kCodes = kCodeBytes<Kind, kVector>;
  const auto [kv, meta, codes] = layer_section(p);
  const std::uint32_t vectors_per_row = p.row / kVector;
  const std::size_t id = thread_index();
  const std::size_t first_token = (id / vectors_per_row) * kTokensPerThread;
  const auto channel = static_cast<std::uint32_t>(id % vectors_per_row) * kVector;
  const std::uint32_t head = channel / p.dim;
  float x[kTokensPerThread][kVector];
#pragma unroll
  for (int u = 0; u < kTokensPerThread; ++u) {
    const std::size_t token = first_token + u;
    if (token < p.middle) {
      load_vector<Dtype>(kv + (token * p.row + channel) * kElementBytes<Dtype>, x[u]);
    } else {
#pragma unroll
      for (int i = 0; i < kVector; ++i)
        x[u][i] = 0.0F;
    }
  }
#pragma unroll
  for (int u = 0; u < kTokensPerThread; ++u) {
    const std::size_t token = first_token + u;
    const bool active = token < p.middle;
    std::uint32_t words[(kCodes + 3) / 4] = {};
    if constexpr (Kind == QuantKind::kFp8) {
      float amax = 0.0F;
#pragma unroll
      for (int i = 0; i < kVector; ++i) {
        const float v = fabsf(x[u][i]);
        amax = v > amax ? v : amax;
      }
      // Every lane of the warp reaches the shuffles, inactive ones too.
      for (std::uint32_t offset = p.segment_lanes / 2; offset > 0; offset /= 2) {
        const float other = __shfl_xor_sync(0xFFFFFFFFU, amax, offset);
        amax = other > amax ? other : amax;
      }
      if (!active) continue;
      const float scale = fp8_scale(amax);
      const float inv = __fdiv_rn(1.0F, scale);
      if (channel % p.dim == 0) {
        const std::uint32_t scale_word[1] = {__float_as_uint(scale)};
        store_words<4>(meta + (token * p.heads + head) * 4, scale_word);
      }
      fp8_codes<kVector>(x[u], inv, words);
    } else {
      float lo = __int_as_float(0x7F800000);
      float hi = __int_as_float(0xFF800000);
#pragma unroll
      for (int i = 0; i < kVector; ++i) {
        lo = x[u][i] < lo ? x[u][i] : lo;
        hi = x[u][i] > hi ? x[u][i] : hi;
      }
      for (std::uint32_t offset = p.segment_lanes / 2; offset > 0; offset /= 2) {
        const float other_lo = __shfl_xor_sync(0xFFFFFFFFU, lo, offset);
        const float other_hi = __shfl_xor_sync(0xFFFFFFFFU, hi, offset);
        lo = other_lo < lo ? other_lo : lo;
        hi = other_hi > hi ? other_hi : hi;
      }
      if (!active) continue;
      const QuantGroup q = make_quant_group_fast(lo, hi, p.max_code);
      const std::uint32_t in_head = channel % p.dim;
      if (in_head % p.group == 0) {
        const std::uint32_t groups_per_head = p.dim / p.group;
        const std::uint32_t pair[1] = {static_cast<std::uint32_t>(q.scale_half) |
                                       (static_cast<std::uint32_t>(q.zero_half) << 16)};
        store_words<4>(meta + ((token * p.heads + head) * groups_per_head + in_head / p.group) * 4, pair);
      }
#pragma unroll
      for (int i = 0; i < kVector; ++i)
        put_code<Kind, kVector>(words, i, quantize_step_fast(x[u][i], q.zero, q.inv_scale, p.max_code));
    }
    store_words<kCodes>(codes + code_offset<Kind>(token, p.code_row_bytes, channel), words);
  }
}

// Per-channel key groups of one vector of channels from their min/max: the quantizer's zero
// and inverse scale per channel, and (when `store`) the fp16 scales and zeros in the group's
// metadata at `scales` (all scales of the group's row, then all zeros).
template <int Vector>
__device__ __forceinline__ void key_groups(const SectionLaunch& p, const float (&lo)[Vector], const float (&hi)[Vector],
                                           std::uint8_t* scales, std::uint32_t channel, bool store,
                                           float (&zero)[Vector], float (&inv_scale)[Vector]) {
  std::uint32_t scale_words[Vector / 2] = {};
  std::uint32_t zero_words[Vector / 2] = {};
#pragma unroll
  for (int i = 0; i < Vector; ++i) {
    const QuantGroup q = make_quant_group_fast(lo[i], hi[i], p.max_code);
    zero[i] = q.zero;
    inv_scale[i] = q.inv_scale;
    scale_words[i / 2] |= static_cast<std::uint32_t>(q.scale_half) << (16 * (i % 2));
    zero_words[i / 2] |= static_cast<std::uint32_t>(q.zero_half) << (16 * (i % 2));
  }
  if (!store) return;
  store_words<2 * Vector>(scales + 2 * channel, scale_words);
  store_words<2 * Vector>(scales + 2 * static_cast<std::size_t>(p.row) + 2 * channel, zero_words);
}

// int K sections with groups too large for keys_encode_sliced_kernel: one thread per (token
// group, vector of channels), reading the group twice (min/max, then codes); per-channel scales.
template <std::uint32_t Dtype, QuantKind Kind>
__global__ void __launch_bounds__(kThreads) keys_encode_kernel(SectionLaunch p) {
  constexpr int kVector = kVectorElements<Dtype>;
  constexpr int kCodes = kCodeBytes<Kind, kVector>;
  const auto [kv, meta, codes] = layer_section(p);
  const std::uint32_t vectors_per_row = p.row / kVector;
  const std::size_t id = thread_index();
  const std::size_t group = id / vectors_per_row;
  const auto channel = static_cast<std::uint32_t>(id % vectors_per_row) * kVector;
  const std::size_t start = group * p.group;
  if (start >= p.middle) return;
  const std::size_t end = start + p.group < p.middle ? start + p.group : p.middle;
  float lo[kVector];
  float hi[kVector];
#pragma unroll
  for (int i = 0; i < kVector; ++i) {
    lo[i] = __int_as_float(0x7F800000);
    hi[i] = __int_as_float(0xFF800000);
  }
#pragma unroll 4
  for (std::size_t token = start; token < end; ++token) {
    float x[kVector];
    load_vector<Dtype>(kv + (token * p.row + channel) * kElementBytes<Dtype>, x);
#pragma unroll
    for (int i = 0; i < kVector; ++i) {
      lo[i] = x[i] < lo[i] ? x[i] : lo[i];
      hi[i] = x[i] > hi[i] ? x[i] : hi[i];
    }
  }
  float zero[kVector];
  float inv_scale[kVector];
  key_groups(p, lo, hi, meta + group * p.row * 4, channel, true, zero, inv_scale);
#pragma unroll 4
  for (std::size_t token = start; token < end; ++token) {
    float x[kVector];
    load_vector<Dtype>(kv + (token * p.row + channel) * kElementBytes<Dtype>, x);
    std::uint32_t words[(kCodes + 3) / 4] = {};
#pragma unroll
    for (int i = 0; i < kVector; ++i)
      put_code<Kind, kVector>(words, i, quantize_step_fast(x[i], zero[i], inv_scale[i], p.max_code));
    store_words<kCodes>(codes + code_offset<Kind>(token, p.code_row_bytes, channel), words);
  }
}

// int K sections with groups of up to kKeySliceTokens * 32 tokens: the group's tokens are split
// into slices of kKeySliceTokens over `slices` adjacent lanes (SectionLaunch::segment_lanes),
// which keep their raw vectors in registers, so the group is read from memory once (the
// two-pass keys_encode_kernel reads it twice: its working set outgrows the L2 cache).
constexpr int kKeySliceTokens = 16;

template <std::uint32_t Dtype, QuantKind Kind>
__global__ void __launch_bounds__(kThreads) keys_encode_sliced_kernel(SectionLaunch p) {
  constexpr int kVector = kVectorElements<Dtype>;
  constexpr int kCodes = kCodeBytes<Kind, kVector>;
  const auto [kv, meta, codes] = layer_section(p);
  const std::uint32_t slices = p.segment_lanes;
  const std::uint32_t vectors_per_row = p.row / kVector;
  const std::size_t id = thread_index();
  const auto slice = static_cast<std::uint32_t>(id % slices);
  const std::size_t column = id / slices;  // (group, vector of channels)
  const std::size_t group = column / vectors_per_row;
  const auto channel = static_cast<std::uint32_t>(column % vectors_per_row) * kVector;
  // Tokens of this lane: [first, first + count), inside the group and the middle rows.
  const std::size_t group_start = group * p.group;
  const std::size_t group_end = group_start + p.group < p.middle ? group_start + p.group : p.middle;
  const std::size_t first = group_start + static_cast<std::size_t>(slice) * kKeySliceTokens;
  const std::size_t count =
      first < group_end ? (group_end - first < kKeySliceTokens ? group_end - first : kKeySliceTokens) : 0;

  uint4 raw[kKeySliceTokens];
#pragma unroll
  for (int k = 0; k < kKeySliceTokens; ++k) {
    if (static_cast<std::size_t>(k) < count)
      raw[k] = *reinterpret_cast<const uint4*>(kv + ((first + k) * p.row + channel) * kElementBytes<Dtype>);
  }
  float lo[kVector];
  float hi[kVector];
#pragma unroll
  for (int i = 0; i < kVector; ++i) {
    lo[i] = __int_as_float(0x7F800000);
    hi[i] = __int_as_float(0xFF800000);
  }
#pragma unroll
  for (int k = 0; k < kKeySliceTokens; ++k) {
    if (static_cast<std::size_t>(k) >= count) break;
    float x[kVector];
    unpack_vector<Dtype>(raw[k], x);
#pragma unroll
    for (int i = 0; i < kVector; ++i) {
      lo[i] = x[i] < lo[i] ? x[i] : lo[i];
      hi[i] = x[i] > hi[i] ? x[i] : hi[i];
    }
  }
  // Every lane of the warp reaches the shuffles, lanes without tokens too.
  for (std::uint32_t offset = slices / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int i = 0; i < kVector; ++i) {
      const float other_lo = __shfl_xor_sync(0xFFFFFFFFU, lo[i], offset);
      const float other_hi = __shfl_xor_sync(0xFFFFFFFFU, hi[i], offset);
      lo[i] = other_lo < lo[i] ? other_lo : lo[i];
      hi[i] = other_hi > hi[i] ? other_hi : hi[i];
    }
  }
  if (group_start >= p.middle) return;
  float zero[kVector];
  float inv_scale[kVector];
  key_groups(p, lo, hi, meta + group * p.row * 4, channel, slice == 0, zero, inv_scale);
#pragma unroll
  for (int k = 0; k < kKeySliceTokens; ++k) {
    if (static_cast<std::size_t>(k) >= count) break;
    float x[kVector];
    unpack_vector<Dtype>(raw[k], x);
    std::uint32_t words[(kCodes + 3) / 4] = {};
#pragma unroll
    for (int i = 0; i < kVector; ++i)
      put_code<Kind, kVector>(words, i, quantize_step_fast(x[i], zero[i], inv_scale[i], p.max_code));
    store_words<kCodes>(codes + code_offset<Kind>(first + k, p.code_row_bytes, channel), words);
  }
}

// Every section decodes with one thread per vector of channels in kTokensPerThread tokens.
template <std::uint32_t Dtype, QuantKind Kind, bool IsValue>
__global__ void __launch_bounds__(kThreads) section_decode_kernel(SectionLaunch p) {
  constexpr int kVector = kVectorElements<Dtype>;
  constexpr int kCodes = kCodeBytes<Kind, kVector>;
  // Keys: a scale and a zero per channel; fp8 and values: one (scale, zero) per vector.
  constexpr int kMetaWords = Kind != QuantKind::kFp8 && !IsValue ? kVector : 1;
  const auto [kv, meta, codes] = layer_section(p);
  const std::uint32_t vectors_per_row = p.row / kVector;
  const std::size_t id = thread_index();
  const std::size_t first_token = (id / vectors_per_row) * kTokensPerThread;
  const auto channel = static_cast<std::uint32_t>(id % vectors_per_row) * kVector;
  const std::uint32_t head = channel / p.dim;
  std::uint32_t words[kTokensPerThread][(kCodes + 3) / 4];
  std::uint32_t meta_words[kTokensPerThread][kMetaWords];
#pragma unroll
  for (int u = 0; u < kTokensPerThread; ++u) {
    const std::size_t token = first_token + u;
    if (token >= p.middle) break;
    load_words<kCodes>(codes + code_offset<Kind>(token, p.code_row_bytes, channel), words[u]);
    if constexpr (Kind == QuantKind::kFp8) {
      load_words<4>(meta + (token * p.heads + head) * 4, meta_words[u]);
    } else if constexpr (IsValue) {
      const std::uint32_t groups_per_head = p.dim / p.group;
      load_words<4>(meta + ((token * p.heads + head) * groups_per_head + (channel % p.dim) / p.group) * 4,
                    meta_words[u]);
    } else {
      // Scales then zeros, each kVector halves: kVector / 2 words apiece.
      const std::uint8_t* scales = meta + (token / p.group) * p.row * 4;
      std::uint32_t halves[kVector / 2];
      load_words<2 * kVector>(scales + 2 * channel, halves);
#pragma unroll
      for (int i = 0; i < kVector / 2; ++i)
        meta_words[u][i] = halves[i];
      load_words<2 * kVector>(scales + 2 * static_cast<std::size_t>(p.row) + 2 * channel, halves);
#pragma unroll
      for (int i = 0; i < kVector / 2; ++i)
        meta_words[u][kVector / 2 + i] = halves[i];
    }
  }
#pragma unroll
  for (int u = 0; u < kTokensPerThread; ++u) {
    const std::size_t token = first_token + u;
    if (token >= p.middle) break;
    float x[kVector];
    if constexpr (Kind == QuantKind::kFp8) {
      const float scale = __uint_as_float(meta_words[u][0]);
#pragma unroll
      for (int i = 0; i < kVector; ++i)
        x[i] = __fmul_rn(e4m3_to_float_fast(get_code<Kind, kVector>(words[u], i)), scale);
    } else if constexpr (IsValue) {
      const float scale = half_bits_to_float(meta_words[u][0] & 0xFFFFU);
      const float zero = half_bits_to_float(meta_words[u][0] >> 16);
#pragma unroll
      for (int i = 0; i < kVector; ++i)
        x[i] = dequantize_step_fast(get_code<Kind, kVector>(words[u], i), zero, scale);
    } else {
#pragma unroll
      for (int i = 0; i < kVector; ++i) {
        const float scale = half_bits_to_float((meta_words[u][i / 2] >> (16 * (i % 2))) & 0xFFFFU);
        const float zero = half_bits_to_float((meta_words[u][kVector / 2 + i / 2] >> (16 * (i % 2))) & 0xFFFFU);
        x[i] = dequantize_step_fast(get_code<Kind, kVector>(words[u], i), zero, scale);
      }
    }
    store_vector<Dtype>(kv + (token * p.row + channel) * kElementBytes<Dtype>, x);
  }
}

bool is_power_of_two_up_to_warp(std::size_t value) {
  return value >= 1 && value <= 32 && (value & (value - 1)) == 0;
}

std::size_t vector_elements(std::uint32_t dtype) {
  return dtype == 1 ? 4 : 8;
}

std::uint32_t value_group(const KernelPlan& plan) {
  return static_cast<std::uint32_t>(plan.group < plan.dim ? plan.group : plan.dim);
}

// Channels of a token that share one scale: a head for fp8, a value group for int8/int4.
std::size_t scale_segment(const KernelPlan& plan) {
  return static_cast<QuantKind>(plan.kind) == QuantKind::kFp8 ? plan.dim : value_group(plan);
}

template <std::uint32_t Dtype, QuantKind Kind>
cudaError_t launch_section(bool encode, bool is_value, const SectionLaunch& launch, std::size_t layers) {
  constexpr std::size_t kVector = kVectorElements<Dtype>;
  const std::size_t vectors_per_row = launch.row / kVector;
  const bool keys_kernel = encode && !is_value && Kind != QuantKind::kFp8;
  const std::size_t groups = (launch.middle + launch.group - 1) / launch.group;
  if (keys_kernel && launch.group <= kKeySliceTokens * 32) {
    SectionLaunch sliced = launch;
    sliced.segment_lanes = 1;
    while (sliced.segment_lanes * kKeySliceTokens < launch.group)
      sliced.segment_lanes *= 2;
    const std::size_t threads = groups * vectors_per_row * sliced.segment_lanes;
    const dim3 grid(static_cast<unsigned>((threads + kThreads - 1) / kThreads), static_cast<unsigned>(layers));
    keys_encode_sliced_kernel<Dtype, Kind><<<grid, kThreads>>>(sliced);
    return cudaGetLastError();
  }
  const std::size_t threads = keys_kernel
                                  ? groups * vectors_per_row
                                  : ((launch.middle + kTokensPerThread - 1) / kTokensPerThread) * vectors_per_row;
  const dim3 grid(static_cast<unsigned>((threads + kThreads - 1) / kThreads), static_cast<unsigned>(layers));
  if (keys_kernel) {
    keys_encode_kernel<Dtype, Kind><<<grid, kThreads>>>(launch);
  } else if (encode) {
    segment_encode_kernel<Dtype, Kind><<<grid, kThreads>>>(launch);
  } else if (is_value) {
    section_decode_kernel<Dtype, Kind, true><<<grid, kThreads>>>(launch);
  } else {
    section_decode_kernel<Dtype, Kind, false><<<grid, kThreads>>>(launch);
  }
  return cudaGetLastError();
}

template <std::uint32_t Dtype>
cudaError_t launch_section_for(QuantKind kind, bool encode, bool is_value, const SectionLaunch& launch,
                               std::size_t layers) {
  switch (kind) {
    case QuantKind::kFp8:
      return launch_section<Dtype, QuantKind::kFp8>(encode, is_value, launch, layers);
    case QuantKind::kInt8:
      return launch_section<Dtype, QuantKind::kInt8>(encode, is_value, launch, layers);
    case QuantKind::kInt4:
      return launch_section<Dtype, QuantKind::kInt4>(encode, is_value, launch, layers);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

bool vector_path_applies(const KernelPlan& plan, const void* device_kv) {
  const std::size_t vector = vector_elements(plan.dtype);
  if (reinterpret_cast<std::uintptr_t>(device_kv) % 16 != 0 || plan.row_bytes % 16 != 0) return false;
  if (plan.layers > 65535 || plan.row_bytes > 0xFFFFFFFFU) return false;
  const std::size_t segment = scale_segment(plan);
  return plan.dim % segment == 0 && segment % vector == 0 && is_power_of_two_up_to_warp(segment / vector);
}

int kernel_quant_vectorized(const KernelPlan& plan, bool encode, const void* device_in, void* device_out) {
  const auto kind = static_cast<QuantKind>(plan.kind);
  const QuantSection keys = detail::quant_section(kind, false, plan.middle, plan.heads, plan.dim, plan.group);
  const QuantSection values = detail::quant_section(kind, true, plan.middle, plan.heads, plan.dim, plan.group);
  const std::size_t sink_bytes = plan.sink * plan.row_bytes;
  const std::size_t recent_bytes = plan.recent * plan.row_bytes;
  const std::size_t exact_bytes = sink_bytes + recent_bytes;
  const std::size_t layer_payload = 2 * exact_bytes + keys.total() + values.total();
  auto* kv = static_cast<std::uint8_t*>(encode ? const_cast<void*>(device_in) : device_out);
  auto* payload = static_cast<std::uint8_t*>(encode ? device_out : const_cast<void*>(device_in));
  const std::size_t recent_row_offset = (plan.tokens - plan.recent) * plan.row_bytes;
  const std::size_t vector = vector_elements(plan.dtype);

  cudaError_t error = cudaSuccess;
  for (int section = 0; section < 2 && error == cudaSuccess; ++section) {
    const bool is_value = section == 1;
    std::uint8_t* kv_first = kv + (is_value ? plan.tensor_bytes : 0);
    std::uint8_t* payload_first = payload + (is_value ? exact_bytes + keys.total() : 0);
    // Exact rows: one strided copy each for sink and recent rows over all layers.
    const auto copy = [&](std::uint8_t* kv_rows, std::uint8_t* payload_rows, std::size_t width) {
      if (width == 0) return cudaSuccess;
      return encode ? cudaMemcpy2DAsync(payload_rows, layer_payload, kv_rows, 2 * plan.tensor_bytes, width, plan.layers,
                                        cudaMemcpyDeviceToDevice)
                    : cudaMemcpy2DAsync(kv_rows, 2 * plan.tensor_bytes, payload_rows, layer_payload, width, plan.layers,
                                        cudaMemcpyDeviceToDevice);
    };
    error = copy(kv_first, payload_first, sink_bytes);
    if (error == cudaSuccess) error = copy(kv_first + recent_row_offset, payload_first + sink_bytes, recent_bytes);
    if (error != cudaSuccess || plan.middle == 0) continue;
    const QuantSection& layout = is_value ? values : keys;
    SectionLaunch launch{};
    launch.kv = kv_first + sink_bytes;
    launch.kv_stride = 2 * plan.tensor_bytes;
    launch.section = payload_first + exact_bytes;
    launch.section_stride = layer_payload;
    launch.middle = plan.middle;
    launch.heads = static_cast<std::uint32_t>(plan.heads);
    launch.dim = static_cast<std::uint32_t>(plan.dim);
    launch.row = static_cast<std::uint32_t>(plan.heads * plan.dim);
    launch.group = is_value ? value_group(plan) : static_cast<std::uint32_t>(plan.group);
    launch.segment_lanes = static_cast<std::uint32_t>(scale_segment(plan) / vector);
    launch.meta_bytes = layout.meta_bytes;
    launch.code_row_bytes = layout.code_row_bytes;
    launch.max_code = kind == QuantKind::kInt4 ? 15.0F : 255.0F;
    switch (plan.dtype) {
      case 1:
        error = launch_section_for<1>(kind, encode, is_value, launch, plan.layers);
        break;
      case 2:
        error = launch_section_for<2>(kind, encode, is_value, launch, plan.layers);
        break;
      default:
        error = launch_section_for<3>(kind, encode, is_value, launch, plan.layers);
        break;
    }
  }
  if (error == cudaSuccess) error = cudaDeviceSynchronize();
  return static_cast<int>(error);
}

}  // namespace kvrelay::codec::cuda
