// The quantizer loops built with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mf16c (never FMA, see
// codec_plugins/CMakeLists.txt); only called after cpu_path.cpp has checked the CPU for all of
// them. The passes of quant_kernels_avx2.cpp on the sixteen-lane steps of quant_lanes_avx512.h,
// for the shapes whose rows, heads and groups are whole vectors (16 elements; int4 keys 32);
// any other shape runs the AVX2 build's loops, which write the same bytes.

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512DQ__) || \
    !defined(__AVX2__) || !defined(__F16C__)
#error "quant_kernels_avx512.cpp needs -mavx512f -mavx512bw -mavx512vl -mavx512dq -mf16c"
#endif
#if defined(__FMA__)
#error "FMA would round differently from the baseline build and the CUDA kernels"
#endif

// GCC 12 warns inside its own AVX-512 headers (_mm512_undefined_epi32 as a "maybe uninitialized"
// pass-through operand, GCC bug 105593); the warning is about the header, not this code.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <cstring>

#include "quant_kernel_api.h"
#include "quant_lanes_avx2.h"
#include "quant_lanes_avx512.h"

namespace {

using kvrelay::DType;
using kvrelay::codec::detail::avx2_quant_kernels;
using kvrelay::codec::detail::QuantDecodeArgs;
using kvrelay::codec::detail::QuantEncodeArgs;
using kvrelay::codec::detail::QuantKernelSet;
using kvrelay::codec::detail::QuantTensorDims;
namespace bits = kvrelay::codec;

template <DType kDtype>
constexpr std::size_t kElementSize = kDtype == DType::kFloat32 ? 4 : 2;

// Bytes ahead of the current row that the loops ask the memory system for (as quant_kernels.h).
constexpr std::size_t kPrefetchDistance = 2048;

template <DType kDtype>
const QuantKernelSet& avx2_set() {
  const auto& table = avx2_quant_kernels();
  if constexpr (kDtype == DType::kFloat32) {
    return table.fp32;
  } else if constexpr (kDtype == DType::kFloat16) {
    return table.fp16;
  } else {
    return table.bf16;
  }
}

// Asks for bytes the loops will read soon (the KV streams from DRAM); prefetches never fault.
inline __attribute__((always_inline)) void prefetch_bytes(const std::uint8_t* start, std::size_t bytes) {
  for (std::size_t b = 0; b < bytes; b += 64)
    __builtin_prefetch(start + b);
}

// True for bf16 when every scale and zero of a stretch is finite: `code * scale + zero` (fp8:
// `e4m3 * scale`) is then never NaN, and the bf16 stores skip their NaN select. fp16 and fp32
// stores have none, so their loops are built once.
template <DType kDtype>
bool no_nan_possible(const float* scales, const float* zeros, std::size_t count) {
  if constexpr (kDtype == DType::kBFloat16) {
    return lanes::all_finite(scales, count) && lanes::all_finite(zeros, count);
  } else {
    return false;
  }
}

// Value groups (and fp8 heads) that are whole vectors: every group's first element and length
// are multiples of 16.
bool groups_in_vectors(const QuantTensorDims& a) {
  return a.head_dim % 16 == 0 && a.value_group % 16 == 0;
}

// Calls body(group, first element, element count) for the value groups of a row in order (as
// quant_kernels_avx2.cpp's for_each_group).
template <class Body>
inline __attribute__((always_inline)) void for_each_group(const QuantTensorDims& a, Body&& body) {
  std::size_t g = 0;
  for (std::size_t head_start = 0; head_start < a.row_elements; head_start += a.head_dim) {
    for (std::size_t in_head = 0; in_head < a.head_dim; in_head += a.value_group, ++g)
      body(g, head_start + in_head, a.value_group < a.head_dim - in_head ? a.value_group : a.head_dim - in_head);
  }
}

// make_quant_group on `count` groups (a multiple of 8), eight per step: fp16 scales and zeros to
// `scale_half` / `zero_half`, the fp32 zeros and inverse scales to `zero` / `inv`.
void make_groups8(const float* __restrict lo, const float* __restrict hi, std::size_t count, float max_code,
                  std::uint8_t* __restrict scale_half, std::uint8_t* __restrict zero_half, float* __restrict zero,
                  float* __restrict inv) {
  const __m256 top = _mm256_set1_ps(max_code);
  for (std::size_t g = 0; g < count; g += 8) {
    __m128i scale8;
    __m128i zero8;
    __m256 zero_f;
    __m256 inv_f;
    lanes::make_quant_groups8(_mm256_loadu_ps(lo + g), _mm256_loadu_ps(hi + g), top, scale8, zero8, zero_f, inv_f);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(scale_half + 2 * g), scale8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(zero_half + 2 * g), zero8);
    _mm256_storeu_ps(zero + g, zero_f);
    _mm256_storeu_ps(inv + g, inv_f);
  }
}

// Keys: per channel over groups of `group` tokens (rows of whole vectors; int4 rows of 32):
// column min/max eight rows per sweep, the group's parameters, then each row quantized from
// the source again (L2).
template <DType kDtype, bool kInt4>
void encode_keys_512(const QuantEncodeArgs& a) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kSize;
  float* __restrict lo = a.scratch_floats;
  float* __restrict hi = lo + row;
  float* __restrict zero = hi + row;
  float* __restrict inv = zero + row;
  const __m512 top = _mm512_set1_ps(a.max_code);
  for (std::size_t start = 0; start < a.middle; start += a.group) {
    const std::size_t count = a.group < a.middle - start ? a.group : a.middle - start;
    const std::uint8_t* source = a.rows + start * row_bytes;
    std::size_t swept = 0;
    for (std::size_t c = 0; c < row; c += 16) {
      _mm512_storeu_ps(lo + c, _mm512_set1_ps(__builtin_inff()));
      _mm512_storeu_ps(hi + c, _mm512_set1_ps(-__builtin_inff()));
    }
    for (; swept < count; swept += 8) {
      const std::size_t rows = count - swept < 8 ? count - swept : 8;
      prefetch_bytes(source + (swept + 8) * row_bytes, 8 * row_bytes);
      const std::uint8_t* block = source + swept * row_bytes;
      for (std::size_t c = 0; c < row; c += 16) {
        __m512 l = _mm512_loadu_ps(lo + c);
        __m512 h = _mm512_loadu_ps(hi + c);
        for (std::size_t r = 0; r < rows; ++r) {
          const __m512 v = lanes16::load16<kDtype>(block + r * row_bytes + c * kSize);
          l = _mm512_min_ps(v, l);  // `v < l ? v : l`: a NaN v keeps l
          h = _mm512_max_ps(v, h);
        }
        _mm512_storeu_ps(lo + c, l);
        _mm512_storeu_ps(hi + c, h);
      }
    }
    std::uint8_t* meta = a.meta + (start / a.group) * row * 4;
    make_groups8(lo, hi, row, a.max_code, meta, meta + row * 2, zero, inv);
    for (std::size_t t = 0; t < count; ++t) {
      const std::uint8_t* __restrict x = source + t * row_bytes;
      std::uint8_t* __restrict out = a.codes + (start + t) * a.code_row_bytes;
      std::size_t c = 0;
      // 16-bit rows only: fp32 keys measured 3-15% slower this way (their one-vector loop below).
      for (; kSize == 2 && c + 64 <= row; c += 64) {
        __m512i q[4];
        for (std::size_t k = 0; k < 4; ++k) {
          const std::size_t first = c + 16 * k;
          q[k] = lanes16::quantize16_unclamped_low(lanes16::load16<kDtype>(x + first * kSize),
                                                   _mm512_loadu_ps(zero + first), _mm512_loadu_ps(inv + first), top);
        }
        const __m512i codes = lanes16::codes64(q[0], q[1], q[2], q[3]);
        if constexpr (kInt4) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c / 2), lanes16::nibble_pairs64(codes));
        } else {
          _mm512_storeu_si512(out + c, codes);
        }
      }
      if constexpr (kInt4) {
        for (; c < row; c += 32) {
          const __m128i low = lanes16::nibbles16(lanes16::quantize16(
              lanes16::load16<kDtype>(x + c * kSize), _mm512_loadu_ps(zero + c), _mm512_loadu_ps(inv + c), top));
          const __m128i high = lanes16::nibbles16(lanes16::quantize16(lanes16::load16<kDtype>(x + (c + 16) * kSize),
                                                                      _mm512_loadu_ps(zero + c + 16),
                                                                      _mm512_loadu_ps(inv + c + 16), top));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c / 2), _mm_unpacklo_epi64(low, high));
        }
      } else {
        for (; c < row; c += 16) {
          const __m512i q = lanes16::quantize16(lanes16::load16<kDtype>(x + c * kSize), _mm512_loadu_ps(zero + c),
                                                _mm512_loadu_ps(inv + c), top);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), _mm512_cvtepi32_epi8(q));
        }
      }
    }
  }
}

template <DType kDtype>
void encode_keys_any(const QuantEncodeArgs& a) {
  if (a.int4 && a.row_elements % 32 == 0) {
    encode_keys_512<kDtype, true>(a);
  } else if (!a.int4 && a.row_elements % 16 == 0) {
    encode_keys_512<kDtype, false>(a);
  } else {
    avx2_set<kDtype>().encode_keys(a);
  }
}

// Codes [first, first + 16) of a row, one per byte.
inline __attribute__((always_inline)) __m128i codes16(bool int4, const std::uint8_t* row_codes, std::size_t first) {
  return int4 ? lanes16::unpack_nibbles16(row_codes + first / 2)
              : _mm_loadu_si128(reinterpret_cast<const __m128i*>(row_codes + first));
}

template <DType kDtype, bool kInt4>
void decode_keys_512(const QuantDecodeArgs& a) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kSize;
  float* __restrict scale = a.scratch_floats;
  float* __restrict zero = scale + row;
  for (std::size_t start = 0; start < a.middle; start += a.group) {
    const std::size_t count = a.group < a.middle - start ? a.group : a.middle - start;
    const std::uint8_t* meta = a.meta + (start / a.group) * row * 4;
    for (std::size_t c = 0; c < row; c += 16) {
      _mm512_storeu_ps(scale + c, lanes16::load16<DType::kFloat16>(meta + 2 * c));
      _mm512_storeu_ps(zero + c, lanes16::load16<DType::kFloat16>(meta + row * 2 + 2 * c));
    }
    const auto decode_rows = [&]<bool kNoNaN>() {
      for (std::size_t t = 0; t < count; ++t) {
        const std::uint8_t* __restrict codes = a.codes + (start + t) * a.code_row_bytes;
        std::uint8_t* __restrict destination = a.rows + (start + t) * row_bytes;
        for (std::size_t c = 0; c < row; c += 16) {
          const __m512 x =
              lanes16::dequantize16(codes16(kInt4, codes, c), _mm512_loadu_ps(zero + c), _mm512_loadu_ps(scale + c));
          lanes16::store16<kDtype, kNoNaN>(x, destination + c * kSize);
        }
      }
    };
    if (no_nan_possible<kDtype>(scale, zero, row)) {
      decode_rows.template operator()<true>();
    } else {
      decode_rows.template operator()<false>();
    }
  }
}

template <DType kDtype>
void decode_keys_any(const QuantDecodeArgs& a) {
  if (a.row_elements % 16 != 0) {
    avx2_set<kDtype>().decode_keys(a);
  } else if (a.int4) {
    decode_keys_512<kDtype, true>(a);
  } else {
    decode_keys_512<kDtype, false>(a);
  }
}

// Values: per token, groups of `value_group` channels inside each head (whole vectors): each
// group's min/max from the source in registers, sixteen groups reduced together
// (reduce16x16), the parameters of eight groups per step, then the row quantized from the
// source again (now in L1), four vectors per step with each vector's group looked up.
// kGroupVectors: the vectors of every group when all groups have the same length (it divides
// head_dim), so the sweep's inner loop unrolls; 0 for any whole-vector grouping.
template <DType kDtype, bool kInt4, std::size_t kGroupVectors>
void encode_values_512(const QuantEncodeArgs& a) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kSize;
  const std::size_t vectors = row / 16;
  const std::size_t groups = a.kv_heads * (a.head_dim / a.value_group + (a.head_dim % a.value_group != 0 ? 1 : 0));
  const std::size_t padded = (groups + 15) / 16 * 16;
  float* __restrict lo = a.scratch_floats;
  float* __restrict hi = lo + padded;
  float* __restrict zero = hi + padded;
  float* __restrict inv = zero + padded;
  auto* __restrict halves = reinterpret_cast<std::uint8_t*>(a.scratch_halves);  // scales, then zeros
  std::uint16_t* __restrict vector_group = a.scratch_halves + 2 * padded;
  for_each_group(a, [&](std::size_t g, std::size_t first, std::size_t count) {
    for (std::size_t i = 0; i < count; i += 16)
      vector_group[(first + i) / 16] = static_cast<std::uint16_t>(g);
  });
  const __m512 top = _mm512_set1_ps(a.max_code);
  for (std::size_t t = 0; t < a.middle; ++t) {
    const std::uint8_t* __restrict source = a.rows + t * row_bytes;
    prefetch_bytes(source + kPrefetchDistance, row_bytes);
    __m512 group_lo[16];
    __m512 group_hi[16];
    const auto sweep_group = [&](std::size_t g, std::size_t first, std::size_t count) {
      __m512 l = _mm512_set1_ps(__builtin_inff());
      __m512 h = _mm512_set1_ps(-__builtin_inff());
      for (std::size_t i = 0; i < (kGroupVectors != 0 ? 16 * kGroupVectors : count); i += 16) {
        const __m512 v = lanes16::load16<kDtype>(source + (first + i) * kSize);
        l = _mm512_min_ps(v, l);  // a NaN v keeps l
        h = _mm512_max_ps(v, h);
      }
      const int lane = static_cast<int>(g % 16);
      group_lo[lanes16::group_slot(lane)] = l;
      group_hi[lanes16::group_slot(lane)] = h;
      if (lane == 15 || g + 1 == groups) {
        for (int unused = lane + 1; unused < 16; ++unused) {  // results not stored on the wire
          group_lo[lanes16::group_slot(unused)] = l;
          group_hi[lanes16::group_slot(unused)] = h;
        }
        _mm512_storeu_ps(lo + (g - static_cast<std::size_t>(lane)), lanes16::reduce16x16<false>(group_lo));
        _mm512_storeu_ps(hi + (g - static_cast<std::size_t>(lane)), lanes16::reduce16x16<true>(group_hi));
      }
    };
    if constexpr (kGroupVectors != 0) {
      for (std::size_t g = 0; g < groups; ++g)
        sweep_group(g, 16 * kGroupVectors * g, 16 * kGroupVectors);
    } else {
      for_each_group(a, sweep_group);
    }
    make_groups8(lo, hi, padded, a.max_code, halves, halves + 2 * padded, zero, inv);
    // (scale, zero) per group, as on the wire.
    std::uint8_t* meta = a.meta + t * groups * 4;
    for (std::size_t g = 0; g < groups; g += 8) {
      const __m128i scale8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + 2 * g));
      const __m128i zero8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(halves + 2 * padded + 2 * g));
      const __m256i pairs = _mm256_set_m128i(_mm_unpackhi_epi16(scale8, zero8), _mm_unpacklo_epi16(scale8, zero8));
      const auto lanes_left = static_cast<__mmask8>(groups - g < 8 ? (1U << (groups - g)) - 1 : 0xFFU);
      _mm256_mask_storeu_epi32(meta + 4 * g, lanes_left, pairs);
    }
    std::uint8_t* __restrict out = a.codes + t * a.code_row_bytes;
    std::size_t v = 0;
    for (; v + 4 <= vectors; v += 4) {
      __m512i q[4];
      for (std::size_t k = 0; k < 4; ++k) {
        const std::size_t g = vector_group[v + k];
        q[k] = lanes16::quantize16_unclamped_low(lanes16::load16<kDtype>(source + 16 * (v + k) * kSize),
                                                 _mm512_set1_ps(zero[g]), _mm512_set1_ps(inv[g]), top);
      }
      const __m512i codes = lanes16::codes64(q[0], q[1], q[2], q[3]);
      if constexpr (kInt4) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 8 * v), lanes16::nibble_pairs64(codes));
      } else {
        _mm512_storeu_si512(out + 16 * v, codes);
      }
    }
    for (; v < vectors; ++v) {
      const std::size_t g = vector_group[v];
      const __m512i q = lanes16::quantize16(lanes16::load16<kDtype>(source + 16 * v * kSize), _mm512_set1_ps(zero[g]),
                                            _mm512_set1_ps(inv[g]), top);
      if constexpr (kInt4) {
        _mm_storel_epi64(reinterpret_cast<__m128i*>(out + 8 * v), lanes16::nibbles16(q));
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * v), _mm512_cvtepi32_epi8(q));
      }
    }
  }
}

template <DType kDtype, std::size_t kGroupVectors>
void encode_values_with(const QuantEncodeArgs& a) {
  if (a.int4) {
    encode_values_512<kDtype, true, kGroupVectors>(a);
  } else {
    encode_values_512<kDtype, false, kGroupVectors>(a);
  }
}

template <DType kDtype>
void encode_values_any(const QuantEncodeArgs& a) {
  // The group table (one 16-bit entry per vector) shares the halves scratch with the metadata.
  const std::size_t padded_groups = (a.row_elements / 16 + 15) / 16 * 16;
  if (!groups_in_vectors(a) || 2 * padded_groups + a.row_elements / 16 > 2 * a.row_elements ||
      a.row_elements / 16 > 0xFFFF) {
    avx2_set<kDtype>().encode_values(a);
  } else if (a.value_group == 32 && a.head_dim % 32 == 0) {
    encode_values_with<kDtype, 2>(a);
  } else if (a.value_group == 64 && a.head_dim % 64 == 0) {
    encode_values_with<kDtype, 4>(a);
  } else {
    encode_values_with<kDtype, 0>(a);
  }
}

// kGroupVectors as for encode_values_512.
template <DType kDtype, bool kInt4, std::size_t kGroupVectors>
void decode_values_512(const QuantDecodeArgs& a) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const std::size_t row = a.row_elements;
  const std::size_t row_bytes = row * kSize;
  const std::size_t groups = a.kv_heads * (a.head_dim / a.value_group + (a.head_dim % a.value_group != 0 ? 1 : 0));
  float* __restrict pairs = a.scratch_floats;  // (scale, zero) per group, as on the wire
  for (std::size_t t = 0; t < a.middle; ++t) {
    const std::uint8_t* meta = a.meta + t * groups * 4;
    std::size_t p = 0;
    for (; p + 16 <= 2 * groups; p += 16)
      _mm512_storeu_ps(pairs + p, lanes16::load16<DType::kFloat16>(meta + 2 * p));
    for (; p < 2 * groups; ++p) {
      std::uint16_t half;
      std::memcpy(&half, meta + 2 * p, 2);
      pairs[p] = bits::half_to_float(half);
    }
    const std::uint8_t* __restrict codes = a.codes + t * a.code_row_bytes;
    std::uint8_t* __restrict destination = a.rows + t * row_bytes;
    const auto decode_row = [&]<bool kNoNaN>() {
      const auto decode_group = [&](std::size_t g, std::size_t first, std::size_t count) {
        const __m512 scale = _mm512_set1_ps(pairs[2 * g]);
        const __m512 zero = _mm512_set1_ps(pairs[2 * g + 1]);
        for (std::size_t i = 0; i < (kGroupVectors != 0 ? 16 * kGroupVectors : count); i += 16)
          lanes16::store16<kDtype, kNoNaN>(lanes16::dequantize16(codes16(kInt4, codes, first + i), zero, scale),
                                           destination + (first + i) * kSize);
      };
      if constexpr (kGroupVectors != 0) {
        for (std::size_t g = 0; g < groups; ++g)
          decode_group(g, 16 * kGroupVectors * g, 16 * kGroupVectors);
      } else {
        for_each_group(a, decode_group);
      }
    };
    if (no_nan_possible<kDtype>(pairs, pairs, 2 * groups)) {
      decode_row.template operator()<true>();
    } else {
      decode_row.template operator()<false>();
    }
  }
}

template <DType kDtype, std::size_t kGroupVectors>
void decode_values_with(const QuantDecodeArgs& a) {
  if (a.int4) {
    decode_values_512<kDtype, true, kGroupVectors>(a);
  } else {
    decode_values_512<kDtype, false, kGroupVectors>(a);
  }
}

template <DType kDtype>
void decode_values_any(const QuantDecodeArgs& a) {
  if (!groups_in_vectors(a)) {
    avx2_set<kDtype>().decode_values(a);
  } else if (a.value_group == 32 && a.head_dim % 32 == 0) {
    decode_values_with<kDtype, 2>(a);
  } else if (a.value_group == 64 && a.head_dim % 64 == 0) {
    decode_values_with<kDtype, 4>(a);
  } else {
    decode_values_with<kDtype, 0>(a);
  }
}

// Max |x| over one head of `dim` elements (a multiple of 16; NaN ignored), as abs_max. fp16 and
// bf16 magnitudes order as their bit patterns do, so their max is taken on integers with the
// NaN patterns (above infinity's) dropped; the result converts exactly.
template <DType kDtype>
inline __attribute__((always_inline)) float head_abs_max(const std::uint8_t* __restrict head, std::size_t dim) {
  if constexpr (kDtype == DType::kFloat32) {
    const __m512i no_sign = _mm512_set1_epi32(0x7FFFFFFF);
    __m512 wide = _mm512_setzero_ps();
    for (std::size_t d = 0; d < dim; d += 16) {
      const __m512 magnitude = _mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(head + 4 * d), no_sign));
      wide = _mm512_max_ps(magnitude, wide);  // a NaN magnitude keeps `wide`
    }
    return lanes16::fold_max16(wide);
  } else {
    const __m512i no_sign = _mm512_set1_epi16(0x7FFF);
    const __m512i infinity = _mm512_set1_epi16(kDtype == DType::kFloat16 ? 0x7C00 : 0x7F80);
    __m512i wide = _mm512_setzero_si512();
    std::size_t d = 0;
    for (; d + 32 <= dim; d += 32) {
      const __m512i magnitude = _mm512_and_si512(_mm512_loadu_si512(head + 2 * d), no_sign);
      wide = _mm512_mask_max_epu16(wide, _mm512_cmple_epu16_mask(magnitude, infinity), wide, magnitude);
    }
    __m256i top = _mm256_max_epu16(_mm512_castsi512_si256(wide), _mm512_extracti64x4_epi64(wide, 1));
    if (d < dim) {  // the last 16 elements
      const __m256i magnitude = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(head + 2 * d)),
                                                 _mm256_set1_epi16(0x7FFF));
      top = _mm256_mask_max_epu16(top, _mm256_cmple_epu16_mask(magnitude, _mm512_castsi512_si256(infinity)), top,
                                  magnitude);
    }
    // max = ~min(~x): the one horizontal 16-bit reduction SSE4.1 has is minpos.
    const __m128i half = _mm_max_epu16(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    const auto pattern =
        static_cast<std::uint16_t>(~_mm_extract_epi16(_mm_minpos_epu16(_mm_xor_si128(half, _mm_set1_epi16(-1))), 0));
    return kDtype == DType::kFloat16 ? bits::half_to_float(pattern) : bits::bf16_to_float(pattern);
  }
}

// fp8: one f32 scale per token and head (amax / 448). Per row: every head's amax, then the
// scales (independent divisions), then the codes (the row is in L1).
template <DType kDtype>
void encode_fp8_512(const QuantEncodeArgs& a) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const std::size_t row = a.row_elements;
  const std::size_t dim = a.head_dim;
  const std::size_t heads = a.kv_heads;
  float* __restrict amax = a.scratch_floats;
  float* __restrict scale = amax + heads;
  float* __restrict inv = scale + heads;
  for (std::size_t t = 0; t < a.middle; ++t) {
    const std::uint8_t* __restrict source = a.rows + t * row * kSize;
    prefetch_bytes(source + kPrefetchDistance, row * kSize);
    for (std::size_t h = 0; h < heads; ++h)
      amax[h] = head_abs_max<kDtype>(source + h * dim * kSize, dim);
    for (std::size_t h = 0; h < heads; ++h) {
      scale[h] = bits::fp8_scale(amax[h]);
      inv[h] = 1.0F / scale[h];
    }
    std::memcpy(a.meta + t * heads * 4, scale, heads * 4);
    std::uint8_t* __restrict out = a.codes + t * row;
    for (std::size_t h = 0; h < heads; ++h) {
      const __m512 inv16 = _mm512_set1_ps(inv[h]);
      std::size_t d = h * dim;
      const std::size_t end = (h + 1) * dim;
      // fp32 rows: 64 codes at a time narrow with two packs and a permute (codes64), cheaper than
      // four vpmovdb (codes are at most 255, so the saturating packs keep them). 16-bit rows
      // measured 7-8% slower this way, so they keep one vector at a time.
      for (; kSize == 4 && d + 64 <= end; d += 64) {
        __m512i codes[4];
        for (std::size_t k = 0; k < 4; ++k) {
          codes[k] = lanes16::float_to_e4m3_lanes16(
              _mm512_mul_ps(lanes16::load16<kDtype>(source + (d + 16 * k) * kSize), inv16));
        }
        _mm512_storeu_si512(out + d, lanes16::codes64(codes[0], codes[1], codes[2], codes[3]));
      }
      for (; d < end; d += 16) {
        const __m512 scaled = _mm512_mul_ps(lanes16::load16<kDtype>(source + d * kSize), inv16);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d), lanes16::float_to_e4m3_16(scaled));
      }
    }
  }
}

template <DType kDtype>
void encode_fp8_any(const QuantEncodeArgs& a) {
  if (a.head_dim % 16 == 0) {
    encode_fp8_512<kDtype>(a);
  } else {
    avx2_set<kDtype>().encode_fp8(a);
  }
}

template <DType kDtype>
void decode_fp8_512(const QuantDecodeArgs& a) {
  constexpr std::size_t kSize = kElementSize<kDtype>;
  const std::size_t row = a.row_elements;
  const std::size_t dim = a.head_dim;
  float* __restrict scales = a.scratch_floats;
  for (std::size_t t = 0; t < a.middle; ++t) {
    const std::uint8_t* __restrict codes = a.codes + t * row;
    std::uint8_t* __restrict destination = a.rows + t * row * kSize;
    std::memcpy(scales, a.meta + t * a.kv_heads * 4, a.kv_heads * 4);
    const auto decode_row = [&]<bool kNoNaN>() {
      for (std::size_t h = 0; h < a.kv_heads; ++h) {
        const __m512 scale16 = _mm512_set1_ps(scales[h]);
        for (std::size_t d = h * dim; d < (h + 1) * dim; d += 16) {
          const __m128i sixteen = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + d));
          lanes16::store16<kDtype, kNoNaN>(_mm512_mul_ps(lanes16::e4m3_to_float16(sixteen), scale16),
                                           destination + d * kSize);
        }
      }
    };
    if (no_nan_possible<kDtype>(scales, scales, a.kv_heads)) {
      decode_row.template operator()<true>();
    } else {
      decode_row.template operator()<false>();
    }
  }
}

template <DType kDtype>
void decode_fp8_any(const QuantDecodeArgs& a) {
  if (a.head_dim % 16 == 0) {
    decode_fp8_512<kDtype>(a);
  } else {
    avx2_set<kDtype>().decode_fp8(a);
  }
}

template <DType kDtype>
constexpr QuantKernelSet avx512_kernels_for() {
  return {encode_keys_any<kDtype>,   decode_keys_any<kDtype>, encode_values_any<kDtype>,
          decode_values_any<kDtype>, encode_fp8_any<kDtype>,  decode_fp8_any<kDtype>};
}

}  // namespace

namespace kvrelay::codec::detail {

const QuantKernelTable& avx512_quant_kernels() noexcept {
  static constexpr QuantKernelTable kTable{avx512_kernels_for<DType::kFloat32>(), avx512_kernels_for<DType::kFloat16>(),
                                           avx512_kernels_for<DType::kBFloat16>()};
  return kTable;
}

}  // namespace kvrelay::codec::detail
