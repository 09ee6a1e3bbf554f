#pragma once

// Sixteen-lane AVX-512 (F, BW, VL, DQ) forms of float_bits.h's conversions and quantizer steps,
// as quant_lanes_avx2.h has them on eight lanes: each is the same sequence of IEEE
// single-precision operations as the scalar function it replaces, so a lane writes exactly the
// byte the scalar code, the portable build and the CUDA kernels write. Results narrow with the
// truncating moves (vpmovdb, vpmovdw, vpmovqb), exact here because every lane already fits.
// Include only from quant_kernels_avx512.cpp (never FMA).

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX512DQ__) || \
    defined(__FMA__)
#error "quant_lanes_avx512.h needs -mavx512f -mavx512bw -mavx512vl -mavx512dq and no FMA"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kvrelay/codec_plugins/float_bits.h"
#include "kvrelay/core/kv_layout.h"

namespace {
namespace lanes16 {

using kvrelay::DType;
namespace bits = kvrelay::codec;

#define KVRELAY_LANES inline __attribute__((always_inline))

// Sixteen elements of `kDtype` at `source` -> floats (exact).
template <DType kDtype>
KVRELAY_LANES __m512 load16(const std::uint8_t* source) {
  if constexpr (kDtype == DType::kFloat32) {
    return _mm512_loadu_ps(source);
  } else {
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(source));
    if constexpr (kDtype == DType::kFloat16) {
      return _mm512_cvtph_ps(halves);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));  // bf16_to_float
    }
  }
}

// float_to_bf16 on sixteen lanes, as 32-bit lanes holding the 16-bit results.
KVRELAY_LANES __m512i float_to_bf16_lanes(__m512 value) {
  const __m512i w = _mm512_castps_si512(value);
  const __m512i high = _mm512_srli_epi32(w, 16);
  const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(w, _mm512_set1_epi32(0x7FFF)), odd), 16);
  // (w & 0x7FFFFFFF) > 0x7F800000: both sides are non-negative, so the signed compare is exact.
  const __mmask16 is_nan =
      _mm512_cmpgt_epi32_mask(_mm512_and_si512(w, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  return _mm512_mask_or_epi32(rounded, is_nan, high, _mm512_set1_epi32(0x40));
}

// float_to_bf16_lanes for lanes known not to be NaN: the rounding alone.
KVRELAY_LANES __m512i float_to_bf16_lanes_no_nan(__m512 value) {
  const __m512i w = _mm512_castps_si512(value);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(w, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(w, _mm512_set1_epi32(0x7FFF)), odd), 16);
}

// Floats -> sixteen elements of `kDtype` at `destination` (round to nearest even; F16C's rounding
// equals float_to_half on every non-NaN value, as in quant_lanes_avx2.h). kNoNaN: the caller
// knows no lane is NaN (bf16 then skips the NaN select, a third of its work).
template <DType kDtype, bool kNoNaN = false>
KVRELAY_LANES void store16(__m512 value, std::uint8_t* destination) {
  if constexpr (kDtype == DType::kFloat32) {
    _mm512_storeu_ps(destination, value);
  } else if constexpr (kDtype == DType::kFloat16) {
    // Without optimisation GCC's _mm512_cvtps_ph is a macro passing mask -1 as an unsigned short.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-conversion"
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(destination),
                        _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#pragma GCC diagnostic pop
  } else if constexpr (kNoNaN) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(destination),
                        _mm512_cvtepi32_epi16(float_to_bf16_lanes_no_nan(value)));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(destination), _mm512_cvtepi32_epi16(float_to_bf16_lanes(value)));
  }
}

// quantize_step on sixteen lanes: 32-bit codes in [0, max_code].
KVRELAY_LANES __m512i quantize16(__m512 value, __m512 zero, __m512 inv_scale, __m512 max_code) {
  __m512 scaled = _mm512_mul_ps(_mm512_sub_ps(value, zero), inv_scale);
  scaled = _mm512_max_ps(scaled, _mm512_setzero_ps());  // NaN -> 0: max returns the second operand
  scaled = _mm512_min_ps(scaled, max_code);
  return _mm512_cvttps_epi32(_mm512_add_ps(scaled, _mm512_set1_ps(0.5F)));
}

// quantize16 without its lower clamp, for codes64: a lane the clamp would lift to 0 (negative,
// NaN, -inf) converts to a negative number (INT_MIN for NaN), which codes64 saturates to 0, so
// the code is the same. `min(max_code, scaled)` keeps a NaN (min returns its second operand).
KVRELAY_LANES __m512i quantize16_unclamped_low(__m512 value, __m512 zero, __m512 inv_scale, __m512 max_code) {
  const __m512 scaled = _mm512_min_ps(max_code, _mm512_mul_ps(_mm512_sub_ps(value, zero), inv_scale));
  return _mm512_cvttps_epi32(_mm512_add_ps(scaled, _mm512_set1_ps(0.5F)));
}

// Four vectors of 32-bit codes (at most 255, negatives meaning 0) -> 64 code bytes in element
// order: two saturating packs narrow them (interleaved per 128-bit lane), one permute restores
// the order. Cheaper than four truncating vpmovdb, and the saturation replaces the lower clamp.
KVRELAY_LANES __m512i codes64(__m512i q0, __m512i q1, __m512i q2, __m512i q3) {
  const __m512i bytes = _mm512_packus_epi16(_mm512_packs_epi32(q0, q1), _mm512_packs_epi32(q2, q3));
  // Dword 4 * lane + k of `bytes` holds elements 4 * lane .. 4 * lane + 3 of q_k.
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), bytes);
}

// 64 codes in [0, 15], one per byte -> 32 bytes, element 2i in the low nibble (even + 16 * odd).
KVRELAY_LANES __m256i nibble_pairs64(__m512i codes) {
  return _mm512_cvtepi16_epi8(_mm512_maddubs_epi16(codes, _mm512_set1_epi16(0x1001)));
}

// Sixteen codes in [0, 15] (32-bit lanes) -> 8 bytes in the low half, element 2i in the low
// nibble: each 64-bit lane holds one pair.
KVRELAY_LANES __m128i nibbles16(__m512i codes) {
  const __m512i pairs = _mm512_or_si512(_mm512_and_si512(codes, _mm512_set1_epi64(0x0F)),
                                        _mm512_and_si512(_mm512_srli_epi64(codes, 28), _mm512_set1_epi64(0xF0)));
  return _mm512_cvtepi64_epi8(pairs);
}

// 8 bytes of nibbles -> 16 codes, one per byte (unpack_nibbles).
KVRELAY_LANES __m128i unpack_nibbles16(const std::uint8_t* in) {
  const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(in));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm_unpacklo_epi8(_mm_and_si128(packed, mask), _mm_and_si128(_mm_srli_epi16(packed, 4), mask));
}

// dequantize_step on sixteen codes (one per byte).
KVRELAY_LANES __m512 dequantize16(__m128i codes, __m512 zero, __m512 scale) {
  return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes)), scale), zero);
}

// float_to_e4m3 on sixteen lanes -> sixteen codes in 32-bit lanes (the arithmetic of
// quant_lanes_avx2.h's e4m3_magnitude_lanes, which documents why each step is exact).
KVRELAY_LANES __m512i float_to_e4m3_lanes16(__m512 value) {
  __m512 magnitude = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(value), _mm512_set1_epi32(0x7FFFFFFF)));
  magnitude = _mm512_min_ps(magnitude, _mm512_set1_ps(bits::kFp8E4m3Max));  // NaN -> 448
  const __m512i m = _mm512_castps_si512(magnitude);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(m, 20), _mm512_set1_epi32(1));
  const __m512i normal =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(m, _mm512_set1_epi32(0x7FFFF - (120 << 23))), odd), 20);
  const __m512 magic = _mm512_set1_ps(24576.0F);
  const __m512i subnormal =
      _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(magnitude, magic)), _mm512_castps_si512(magic));
  const __mmask16 is_subnormal = _mm512_cmp_ps_mask(magnitude, _mm512_set1_ps(0.015625F), _CMP_LT_OQ);
  const __m512i code = _mm512_mask_blend_epi32(is_subnormal, normal, subnormal);
  // code | (value >> 24 & 0x80) in one instruction (0xF8: A | (B & C)).
  return _mm512_ternarylogic_epi32(code, _mm512_srli_epi32(_mm512_castps_si512(value), 24), _mm512_set1_epi32(0x80),
                                   0xF8);
}

// The same, as sixteen code bytes.
KVRELAY_LANES __m128i float_to_e4m3_16(__m512 value) {
  return _mm512_cvtepi32_epi8(float_to_e4m3_lanes16(value));
}

// e4m3_to_float on sixteen codes (quant_lanes_avx2.h's e4m3_to_float8: the code's bits at
// float bits 20-26 times 2^120, exact for normals and subnormals).
KVRELAY_LANES __m512 e4m3_to_float16(__m128i codes) {
  const __m512i c = _mm512_cvtepu8_epi32(codes);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x80)), 24);
  const __m512 scaled_down = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(0x7F)), 20));
  const __m512 magnitude = _mm512_mul_ps(scaled_down, _mm512_castsi512_ps(_mm512_set1_epi32((127 + 120) << 23)));
  return _mm512_or_ps(magnitude, _mm512_castsi512_ps(sign));
}

template <bool kMax>
KVRELAY_LANES __m512 min_or_max(__m512 a, __m512 b) {
  if constexpr (kMax) {
    return _mm512_max_ps(a, b);
  } else {
    return _mm512_min_ps(a, b);
  }
}

// The min (or max) of each of sixteen NaN-free vectors, all in one vector: each step halves the
// lanes per input with two shuffles and one min, so sixteen horizontal folds cost 45 operations
// instead of 128. Lane 4q + k of the result reduces input q + 4k (group_slot maps back).
template <bool kMax>
KVRELAY_LANES __m512 reduce16x16(const __m512 (&v)[16]) {
  __m512 halves[8];
  for (int i = 0; i < 8; ++i) {
    halves[i] = min_or_max<kMax>(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                                 _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  __m512 quarters[4];
  for (int i = 0; i < 4; ++i) {
    quarters[i] = min_or_max<kMax>(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                   _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xDD));
  }
  __m512 pairs[2];
  for (int i = 0; i < 2; ++i) {
    const __m512d x = _mm512_castps_pd(quarters[2 * i]);
    const __m512d y = _mm512_castps_pd(quarters[2 * i + 1]);
    pairs[i] = min_or_max<kMax>(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  return min_or_max<kMax>(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// The input of reduce16x16 whose result lands in lane `lane`.
constexpr int group_slot(int lane) {
  return lane / 4 + 4 * (lane % 4);
}

// Horizontal min / max of sixteen NaN-free lanes (the order does not matter: make_quant_group
// canonicalizes -0 and +0).
KVRELAY_LANES float fold_min16(__m512 v) {
  const __m256 half = _mm256_min_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  m = _mm_min_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

KVRELAY_LANES float fold_max16(__m512 v) {
  const __m256 half = _mm256_max_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

#undef KVRELAY_LANES

}  // namespace lanes16
}  // namespace
