#pragma once

// CPU inner loops of the quantizing codecs, compiled twice: by quant_kernels_baseline.cpp for
// any x86-64 (SSE2) and by quant_kernels_avx2.cpp with -mavx2 -mf16c; quant_codec.cpp picks one
// at run time. Every row is first converted into a float scratch row (the only dtype-specific
// step: load_row / store_row), then processed by branch-free loops over contiguous floats that
// GCC vectorizes: min/max, the per-group parameters, quantize, pack. The scalar arithmetic is
// float_bits.h's, unchanged, so both builds and the CUDA kernels write the same bytes (no FMA:
// the files build with -ffp-contract=off and neither enables FMA).
//
// Include only from those two files. Everything here has internal linkage (anonymous
// namespace): the two builds use different instruction sets and must never be merged by the
// linker.

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "kvrelay/codec_plugins/float_bits.h"
#include "kvrelay/core/kv_layout.h"

#include "quant_kernel_api.h"

namespace {

using kvrelay::DType;
using kvrelay::codec::detail::QuantDecodeArgs;
using kvrelay::codec::detail::QuantEncodeArgs;
namespace bits = kvrelay::codec;

template <DType kDtype>
constexpr std::size_t kElementSize = kDtype == DType::kFloat32 ? 4 : 2;

// Bytes ahead of the conversion that load_row asks the memory system for: KV streams from DRAM.
constexpr std::size_t kPrefetchDistance = 2048;

template <DType kDtype>
void load_row(const std::uint8_t* __restrict source, std::size_t count, float* __restrict row) {
  if constexpr (kDtype == DType::kFloat32) {
    for (std::size_t i = 0; i < count * 4; i += 64)
      __builtin_prefetch(source + i + kPrefetchDistance);
    std::memcpy(row, source, count * 4);
  } else if constexpr (kDtype == DType::kBFloat16) {
    for (std::size_t block = 0; block < count; block += 32) {
      __builtin_prefetch(source + 2 * block + kPrefetchDistance);
      const std::size_t end = block + 32 < count ? block + 32 : count;
      for (std::size_t i = block; i < end; ++i) {
        std::uint16_t value;
        std::memcpy(&value, source + 2 * i, 2);
        row[i] = bits::bf16_to_float(value);
      }
    }
  } else {
    std::size_t i = 0;
#if defined(__F16C__)
    for (; i + 32 <= count; i += 32) {
      __builtin_prefetch(source + 2 * i + kPrefetchDistance);
      for (std::size_t j = i; j < i + 32; j += 8) {
        const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + 2 * j));
        _mm256_storeu_ps(row + j, _mm256_cvtph_ps(halves));
      }
    }
    for (; i + 8 <= count; i += 8) {
      const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + 2 * i));
      _mm256_storeu_ps(row + i, _mm256_cvtph_ps(halves));
    }
#endif
    for (; i < count; ++i) {
      std::uint16_t half;
      std::memcpy(&half, source + 2 * i, 2);
      row[i] = bits::half_to_float(half);
    }
  }
}

// float -> dtype with round to nearest even. F16C's conversion equals float_to_half on every
// non-NaN input; decoded values are never NaN (finite fp16 scales and zeros).
template <DType kDtype>
void store_row(const float* __restrict row, std::size_t count, std::uint8_t* __restrict destination) {
  if constexpr (kDtype == DType::kFloat32) {
    std::memcpy(destination, row, count * 4);
  } else if constexpr (kDtype == DType::kBFloat16) {
    for (std::size_t i = 0; i < count; ++i) {
      const std::uint16_t value = bits::float_to_bf16(row[i]);
      std::memcpy(destination + 2 * i, &value, 2);
    }
  } else {
    std::size_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= count; i += 8) {
      const __m128i halves = _mm256_cvtps_ph(_mm256_loadu_ps(row + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(destination + 2 * i), halves);
    }
#endif
    for (; i < count; ++i) {
      const std::uint16_t half = bits::float_to_half(row[i]);
      std::memcpy(destination + 2 * i, &half, 2);
    }
  }
}

// One register of floats as a GCC vector (4 lanes in the baseline build, 8 in the AVX2 build):
// reductions over a run keep independent lanes, which needs no -ffast-math, then fold them with
// in-register shuffles (an 8-lane type in the baseline build would fold through memory).
#if defined(__AVX__)
typedef float Lanes __attribute__((vector_size(32)));
typedef std::int32_t LaneIndex __attribute__((vector_size(32)));
#else
typedef float Lanes __attribute__((vector_size(16)));
typedef std::int32_t LaneIndex __attribute__((vector_size(16)));
#endif
constexpr std::size_t kLanes = sizeof(Lanes) / sizeof(float);

// Loads kLanes floats from an unaligned address.
inline __attribute__((always_inline)) Lanes load_lanes(const float* x) {
  Lanes v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

// `v < lo ? v : lo` keeps lo for a NaN v, so NaN never enters a lane; the fold order then does
// not matter (make_quant_group canonicalizes -0 and +0).
inline __attribute__((always_inline)) Lanes lane_min(Lanes a, Lanes b) {
  return a < b ? a : b;
}
inline __attribute__((always_inline)) Lanes lane_max(Lanes a, Lanes b) {
  return a > b ? a : b;
}

// Folds the lanes: with AVX first the two 128-bit halves, then within four lanes.
typedef float Quad __attribute__((vector_size(16)));
typedef std::int32_t QuadIndex __attribute__((vector_size(16)));

inline __attribute__((always_inline)) Quad fold_halves_min(Lanes v) {
#if defined(__AVX__)
  const Quad low = _mm256_castps256_ps128(v);
  const Quad high = _mm256_extractf128_ps(v, 1);
  return low < high ? low : high;
#else
  return v;
#endif
}
inline __attribute__((always_inline)) Quad fold_halves_max(Lanes v) {
#if defined(__AVX__)
  const Quad low = _mm256_castps256_ps128(v);
  const Quad high = _mm256_extractf128_ps(v, 1);
  return low > high ? low : high;
#else
  return v;
#endif
}

// The quad's lanes in the order I0..I3 (GCC spells the shuffle differently from clang, which
// builds the fuzz preset).
template <int I0, int I1, int I2, int I3>
inline __attribute__((always_inline)) Quad shuffle_quad(Quad m) {
#if defined(__clang__)
  return __builtin_shufflevector(m, m, I0, I1, I2, I3);
#else
  return __builtin_shuffle(m, QuadIndex{I0, I1, I2, I3});
#endif
}

inline __attribute__((always_inline)) float fold_min(Lanes v) {
  Quad m = fold_halves_min(v);
  Quad swapped = shuffle_quad<2, 3, 0, 1>(m);
  m = m < swapped ? m : swapped;
  swapped = shuffle_quad<1, 0, 3, 2>(m);
  m = m < swapped ? m : swapped;
  return m[0];
}
inline __attribute__((always_inline)) float fold_max(Lanes v) {
  Quad m = fold_halves_max(v);
  Quad swapped = shuffle_quad<2, 3, 0, 1>(m);
  m = m > swapped ? m : swapped;
  swapped = shuffle_quad<1, 0, 3, 2>(m);
  m = m > swapped ? m : swapped;
  return m[0];
}

// Min and max of a short run (NaN ignored unless all are NaN: then +inf / -inf).
inline __attribute__((always_inline)) void min_max(const float* __restrict x, std::size_t count, float& lo_out,
                                                   float& hi_out) {
  const float inf = __builtin_inff();
  Lanes lo = Lanes{} + inf;
  Lanes hi = -lo;
  std::size_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    const Lanes v = load_lanes(x + i);
    lo = lane_min(v, lo);
    hi = lane_max(v, hi);
  }
  float lo_tail = inf;
  float hi_tail = -inf;
  for (; i < count; ++i) {
    lo_tail = x[i] < lo_tail ? x[i] : lo_tail;
    hi_tail = x[i] > hi_tail ? x[i] : hi_tail;
  }
  const float lo_lanes = fold_min(lo);
  const float hi_lanes = fold_max(hi);
  lo_out = lo_tail < lo_lanes ? lo_tail : lo_lanes;
  hi_out = hi_tail > hi_lanes ? hi_tail : hi_lanes;
}

// Max of |x| over a short run (0 for an empty run; NaN ignored).
inline __attribute__((always_inline)) float abs_max(const float* __restrict x, std::size_t count) {
  const LaneIndex no_sign = LaneIndex{} + 0x7FFFFFFF;
  Lanes hi = {};
  std::size_t i = 0;
  for (; i + kLanes <= count; i += kLanes) {
    LaneIndex bits_v;
    const Lanes v = load_lanes(x + i);
    std::memcpy(&bits_v, &v, sizeof v);
    bits_v &= no_sign;
    Lanes magnitude;
    std::memcpy(&magnitude, &bits_v, sizeof magnitude);
    hi = lane_max(magnitude, hi);
  }
  float hi_tail = 0.0F;
  for (; i < count; ++i) {
    const float v = __builtin_fabsf(x[i]);
    hi_tail = v > hi_tail ? v : hi_tail;
  }
  const float hi_lanes = fold_max(hi);
  return hi_tail > hi_lanes ? hi_tail : hi_lanes;
}

// Group parameters for `count` groups at once (a vectorized loop over make_quant_group).
void make_groups(const float* __restrict lo, const float* __restrict hi, std::size_t count, float max_code,
                 std::uint16_t* __restrict scale_half, std::uint16_t* __restrict zero_half, float* __restrict zero,
                 float* __restrict inv_scale) {
  for (std::size_t i = 0; i < count; ++i) {
    const bits::QuantGroup group = bits::make_quant_group(lo[i], hi[i], max_code);
    scale_half[i] = group.scale_half;
    zero_half[i] = group.zero_half;
    zero[i] = group.zero;
    inv_scale[i] = group.inv_scale;
  }
}

void quantize_run(const float* __restrict x, std::size_t count, float zero, float inv_scale, float max_code,
                  std::uint8_t* __restrict codes) {
  for (std::size_t i = 0; i < count; ++i)
    codes[i] = static_cast<std::uint8_t>(bits::quantize_step(x[i], zero, inv_scale, max_code));
}

void dequantize_run(const std::uint8_t* __restrict codes, std::size_t count, float zero, float scale,
                    float* __restrict x) {
  for (std::size_t i = 0; i < count; ++i)
    x[i] = bits::dequantize_step(codes[i], zero, scale);
}

// int4: element 2i in the low nibble, 2i+1 in the high one; an odd count ends with a zero nibble.
void pack_nibbles(const std::uint8_t* __restrict codes, std::size_t count, std::uint8_t* __restrict out) {
  const std::size_t pairs = count / 2;
  for (std::size_t i = 0; i < pairs; ++i) {
    std::uint16_t pair;
    std::memcpy(&pair, codes + 2 * i, 2);
    out[i] = static_cast<std::uint8_t>((pair & 0x0FU) | ((pair >> 4) & 0xF0U));
  }
  if (count % 2 != 0) out[pairs] = codes[count - 1];
}

void unpack_nibbles(const std::uint8_t* __restrict in, std::size_t count, std::uint8_t* __restrict codes) {
  const std::size_t pairs = count / 2;
  for (std::size_t i = 0; i < pairs; ++i) {
    const auto byte = static_cast<std::uint16_t>(in[i]);
    const auto pair = static_cast<std::uint16_t>((byte & 0x0FU) | ((byte & 0xF0U) << 4));
    std::memcpy(codes + 2 * i, &pair, 2);
  }
  if (count % 2 != 0) codes[count - 1] = in[pairs] & 0x0FU;
}

// Returns the codes of one row: unpacked into `scratch` for int4, in place for int8.
const std::uint8_t* load_codes(bool int4, const std::uint8_t* in, std::size_t count, std::uint8_t* scratch) {
  if (!int4) return in;
  unpack_nibbles(in, count, scratch);
  return scratch;
}

// Keys: per channel over groups of `group` tokens. Two passes over each token group: min/max
// down the columns, then quantize each row with the column parameters.
template <DType kDtype>
void encode_keys(const QuantEncodeArgs& a) {
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kElementSize<kDtype>;
  float* __restrict x = a.scratch_floats;
  float* __restrict lo = x + row;
  float* __restrict hi = lo + row;
  float* __restrict zero = hi + row;
  float* __restrict inv = zero + row;
  float* __restrict rows4 = inv + row;
  std::uint16_t* __restrict scale_half = a.scratch_halves;
  std::uint16_t* __restrict zero_half = scale_half + row;
  for (std::size_t start = 0; start < a.middle; start += a.group) {
    const std::size_t count = a.group < a.middle - start ? a.group : a.middle - start;
    const std::uint8_t* source = a.rows + start * row_bytes;
    for (std::size_t c = 0; c < row; ++c) {
      lo[c] = __builtin_inff();
      hi[c] = -__builtin_inff();
    }
    // Four rows per sweep over the column minima and maxima: a quarter of their loads and stores.
    std::size_t swept = 0;
    for (; swept + 4 <= count; swept += 4) {
      for (std::size_t r = 0; r < 4; ++r)
        load_row<kDtype>(source + (swept + r) * row_bytes, row, rows4 + r * row);
      const float* __restrict x0 = rows4;
      const float* __restrict x1 = rows4 + row;
      const float* __restrict x2 = rows4 + 2 * row;
      const float* __restrict x3 = rows4 + 3 * row;
      for (std::size_t c = 0; c < row; ++c) {
        float l = lo[c];
        float h = hi[c];
        l = x0[c] < l ? x0[c] : l;
        h = x0[c] > h ? x0[c] : h;
        l = x1[c] < l ? x1[c] : l;
        h = x1[c] > h ? x1[c] : h;
        l = x2[c] < l ? x2[c] : l;
        h = x2[c] > h ? x2[c] : h;
        l = x3[c] < l ? x3[c] : l;
        h = x3[c] > h ? x3[c] : h;
        lo[c] = l;
        hi[c] = h;
      }
    }
    for (; swept < count; ++swept) {
      load_row<kDtype>(source + swept * row_bytes, row, x);
      for (std::size_t c = 0; c < row; ++c) {
        lo[c] = x[c] < lo[c] ? x[c] : lo[c];
        hi[c] = x[c] > hi[c] ? x[c] : hi[c];
      }
    }
    make_groups(lo, hi, row, a.max_code, scale_half, zero_half, zero, inv);
    std::uint8_t* meta = a.meta + (start / a.group) * row * 4;
    std::memcpy(meta, scale_half, row * 2);
    std::memcpy(meta + row * 2, zero_half, row * 2);
    for (std::size_t t = 0; t < count; ++t) {
      load_row<kDtype>(source + t * row_bytes, row, x);
      std::uint8_t* out = a.codes + (start + t) * a.code_row_bytes;
      std::uint8_t* __restrict codes = a.int4 ? a.scratch_codes : out;
      for (std::size_t c = 0; c < row; ++c)
        codes[c] = static_cast<std::uint8_t>(bits::quantize_step(x[c], zero[c], inv[c], a.max_code));
      if (a.int4) pack_nibbles(codes, row, out);
    }
  }
}

template <DType kDtype>
void decode_keys(const QuantDecodeArgs& a) {
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kElementSize<kDtype>;
  float* __restrict x = a.scratch_floats;
  float* __restrict scale = x + row;
  float* __restrict zero = scale + row;
  for (std::size_t start = 0; start < a.middle; start += a.group) {
    const std::size_t count = a.group < a.middle - start ? a.group : a.middle - start;
    const std::uint8_t* meta = a.meta + (start / a.group) * row * 4;
    load_row<DType::kFloat16>(meta, row, scale);
    load_row<DType::kFloat16>(meta + row * 2, row, zero);
    for (std::size_t t = 0; t < count; ++t) {
      const std::uint8_t* __restrict codes =
          load_codes(a.int4, a.codes + (start + t) * a.code_row_bytes, row, a.scratch_codes);
      for (std::size_t c = 0; c < row; ++c)
        x[c] = bits::dequantize_step(codes[c], zero[c], scale[c]);
      store_row<kDtype>(x, row, a.rows + (start + t) * row_bytes);
    }
  }
}

// Values: per token, groups of `value_group` channels inside each head. Per row: min/max of
// every group, all group parameters in one vectorized loop, then quantize group by group.
template <DType kDtype>
void encode_values(const QuantEncodeArgs& a) {
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kElementSize<kDtype>;
  const std::size_t per_head = (a.head_dim + a.value_group - 1) / a.value_group;
  const std::size_t groups = a.kv_heads * per_head;
  float* __restrict x = a.scratch_floats;
  float* __restrict lo = x + row;
  float* __restrict hi = lo + groups;
  float* __restrict zero = hi + groups;
  float* __restrict inv = zero + groups;
  std::uint16_t* __restrict scale_half = a.scratch_halves;
  std::uint16_t* __restrict zero_half = scale_half + groups;
  for (std::size_t t = 0; t < a.middle; ++t) {
    load_row<kDtype>(a.rows + t * row_bytes, row, x);
    std::uint8_t* out = a.codes + t * a.code_row_bytes;
    std::uint8_t* __restrict codes = a.int4 ? a.scratch_codes : out;
    for (std::size_t g = 0; g < groups; ++g) {
      const std::size_t in_head = (g % per_head) * a.value_group;
      const std::size_t first = (g / per_head) * a.head_dim + in_head;
      const std::size_t count = a.value_group < a.head_dim - in_head ? a.value_group : a.head_dim - in_head;
      min_max(x + first, count, lo[g], hi[g]);
    }
    make_groups(lo, hi, groups, a.max_code, scale_half, zero_half, zero, inv);
    std::uint8_t* meta = a.meta + t * groups * 4;
    for (std::size_t g = 0; g < groups; ++g) {
      std::memcpy(meta + 4 * g, scale_half + g, 2);
      std::memcpy(meta + 4 * g + 2, zero_half + g, 2);
    }
    for (std::size_t g = 0; g < groups; ++g) {
      const std::size_t in_head = (g % per_head) * a.value_group;
      const std::size_t first = (g / per_head) * a.head_dim + in_head;
      const std::size_t count = a.value_group < a.head_dim - in_head ? a.value_group : a.head_dim - in_head;
      quantize_run(x + first, count, zero[g], inv[g], a.max_code, codes + first);
    }
    if (a.int4) pack_nibbles(codes, row, out);
  }
}

template <DType kDtype>
void decode_values(const QuantDecodeArgs& a) {
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kElementSize<kDtype>;
  const std::size_t per_head = (a.head_dim + a.value_group - 1) / a.value_group;
  const std::size_t groups = a.kv_heads * per_head;
  float* __restrict x = a.scratch_floats;
  float* __restrict pairs = x + row;  // (scale, zero) per group, as on the wire
  for (std::size_t t = 0; t < a.middle; ++t) {
    load_row<DType::kFloat16>(a.meta + t * groups * 4, 2 * groups, pairs);
    const std::uint8_t* __restrict codes = load_codes(a.int4, a.codes + t * a.code_row_bytes, row, a.scratch_codes);
    for (std::size_t g = 0; g < groups; ++g) {
      const std::size_t in_head = (g % per_head) * a.value_group;
      const std::size_t first = (g / per_head) * a.head_dim + in_head;
      const std::size_t count = a.value_group < a.head_dim - in_head ? a.value_group : a.head_dim - in_head;
      dequantize_run(codes + first, count, pairs[2 * g + 1], pairs[2 * g], x + first);
    }
    store_row<kDtype>(x, row, a.rows + t * row_bytes);
  }
}

// fp8: one f32 scale per token and head (amax / 448).
template <DType kDtype>
void encode_fp8(const QuantEncodeArgs& a) {
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kElementSize<kDtype>;
  const std::size_t dim = a.head_dim;
  float* __restrict x = a.scratch_floats;
  for (std::size_t t = 0; t < a.middle; ++t) {
    load_row<kDtype>(a.rows + t * row_bytes, row, x);
    std::uint8_t* __restrict codes = a.codes + t * row;
    for (std::size_t h = 0; h < a.kv_heads; ++h) {
      const float amax = abs_max(x + h * dim, dim);
      const float scale = bits::fp8_scale(amax);
      const float inv = 1.0F / scale;
      std::memcpy(a.meta + (t * a.kv_heads + h) * 4, &scale, 4);
      const float* __restrict head = x + h * dim;
      std::uint8_t* __restrict out = codes + h * dim;
      for (std::size_t d = 0; d < dim; ++d)
        out[d] = bits::float_to_e4m3(head[d] * inv);
    }
  }
}

template <DType kDtype>
void decode_fp8(const QuantDecodeArgs& a) {
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kElementSize<kDtype>;
  const std::size_t dim = a.head_dim;
  float* __restrict x = a.scratch_floats;
  for (std::size_t t = 0; t < a.middle; ++t) {
    const std::uint8_t* __restrict codes = a.codes + t * row;
    for (std::size_t h = 0; h < a.kv_heads; ++h) {
      float scale;
      std::memcpy(&scale, a.meta + (t * a.kv_heads + h) * 4, 4);
      const std::uint8_t* __restrict in = codes + h * dim;
      float* __restrict out = x + h * dim;
      for (std::size_t d = 0; d < dim; ++d)
        out[d] = bits::e4m3_to_float(in[d]) * scale;
    }
    store_row<kDtype>(x, row, a.rows + t * row_bytes);
  }
}

template <DType kDtype>
constexpr kvrelay::codec::detail::QuantKernelSet kernels_for() {
  return {encode_keys<kDtype>,   decode_keys<kDtype>, encode_values<kDtype>,
          decode_values<kDtype>, encode_fp8<kDtype>,  decode_fp8<kDtype>};
}

}  // namespace
