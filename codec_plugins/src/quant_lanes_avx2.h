#pragma once

// Eight-lane AVX2 + F16C forms of float_bits.h's conversions and quantizer steps. Each is the
// same sequence of IEEE single-precision operations as the scalar function it replaces (the
// comments name it), so a lane writes exactly the byte the scalar code, the portable build and
// the CUDA kernels write. Notes on the equivalences used:
// - `a > b ? a : b` is _mm256_max_ps(a, b) and `a < b ? a : b` is _mm256_min_ps(a, b): both
//   return the second operand when the comparison is false, NaN included.
// - F16C's float -> half conversion equals float_to_half on every non-NaN value, and its
//   half -> float conversion equals half_to_float on every input.
// Include only from quant_kernels_avx2.cpp (built with -mavx2 -mf16c, never FMA).

#if !defined(__AVX2__) || !defined(__F16C__) || defined(__FMA__)
#error "quant_lanes_avx2.h needs -mavx2 -mf16c and no FMA"
#endif

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "kvrelay/codec_plugins/float_bits.h"
#include "kvrelay/core/kv_layout.h"

namespace {
namespace lanes {

using kvrelay::DType;
namespace bits = kvrelay::codec;

#define KVRELAY_LANES inline __attribute__((always_inline))

template <DType kDtype>
constexpr std::size_t kElementSize = kDtype == DType::kFloat32 ? 4 : 2;

// Eight elements of `kDtype` at `source` -> floats (exact).
template <DType kDtype>
KVRELAY_LANES __m256 load8(const std::uint8_t* source) {
  if constexpr (kDtype == DType::kFloat32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(source));
  } else {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source));
    if constexpr (kDtype == DType::kFloat16) {
      return _mm256_cvtph_ps(halves);
    } else {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));  // bf16_to_float
    }
  }
}

template <DType kDtype>
KVRELAY_LANES float load1(const std::uint8_t* source) {
  if constexpr (kDtype == DType::kFloat32) {
    float value;
    std::memcpy(&value, source, 4);
    return value;
  } else {
    std::uint16_t value;
    std::memcpy(&value, source, 2);
    return kDtype == DType::kFloat16 ? bits::half_to_float(value) : bits::bf16_to_float(value);
  }
}

// float_to_bf16 on eight lanes, as 32-bit lanes holding the 16-bit results.
KVRELAY_LANES __m256i float_to_bf16_lanes(__m256 value) {
  const __m256i w = _mm256_castps_si256(value);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(w, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(w, _mm256_set1_epi32(0x7FFF)), odd), 16);
  // (w & 0x7FFFFFFF) > 0x7F800000: both sides are non-negative, so the signed compare is exact.
  const __m256i is_nan =
      _mm256_cmpgt_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(w, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, is_nan);
}

// float_to_bf16 on eight lanes known not to hold a NaN (the NaN select dropped).
KVRELAY_LANES __m256i finite_to_bf16_lanes(__m256 value) {
  const __m256i w = _mm256_castps_si256(value);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(w, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(w, _mm256_set1_epi32(0x7FFF)), odd), 16);
}

// Floats -> eight elements of `kDtype` at `destination` (round to nearest even). kNoNaN: the
// caller knows no lane is NaN (bf16 then skips the NaN select).
template <DType kDtype, bool kNoNaN = false>
KVRELAY_LANES void store8(__m256 value, std::uint8_t* destination) {
  if constexpr (kDtype == DType::kFloat32) {
    _mm256_storeu_ps(reinterpret_cast<float*>(destination), value);
  } else if constexpr (kDtype == DType::kFloat16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(destination),
                     _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    // Every lane <= 0xFFFF: the saturating pack is exact.
    const __m256i wide = kNoNaN ? finite_to_bf16_lanes(value) : float_to_bf16_lanes(value);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(destination),
                     _mm_packus_epi32(_mm256_castsi256_si128(wide), _mm256_extracti128_si256(wide, 1)));
  }
}

template <DType kDtype>
KVRELAY_LANES void store1(float value, std::uint8_t* destination) {
  if constexpr (kDtype == DType::kFloat32) {
    std::memcpy(destination, &value, 4);
  } else {
    const std::uint16_t half = kDtype == DType::kFloat16 ? bits::float_to_half(value) : bits::float_to_bf16(value);
    std::memcpy(destination, &half, 2);
  }
}

// quantize_step on eight lanes: 32-bit codes in [0, max_code].
KVRELAY_LANES __m256i quantize8(__m256 value, __m256 zero, __m256 inv_scale, __m256 max_code) {
  __m256 scaled = _mm256_mul_ps(_mm256_sub_ps(value, zero), inv_scale);
  scaled = _mm256_max_ps(scaled, _mm256_setzero_ps());  // NaN -> 0
  scaled = _mm256_min_ps(scaled, max_code);
  return _mm256_cvttps_epi32(_mm256_add_ps(scaled, _mm256_set1_ps(0.5F)));
}

// dequantize_step on the eight codes in the low 8 bytes of `codes`.
KVRELAY_LANES __m256 dequantize8(__m128i codes, __m256 zero, __m256 scale) {
  return _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), scale), zero);
}

// float_to_e4m3 of |value| on eight lanes: 32-bit lanes holding the codes without the sign
// (pack_e4m3_signs adds it to 32 codes at once).
KVRELAY_LANES __m256i e4m3_magnitude_lanes(__m256 value) {
  __m256 magnitude = _mm256_and_ps(value, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  magnitude = _mm256_min_ps(magnitude, _mm256_set1_ps(bits::kFp8E4m3Max));  // NaN -> 448
  const __m256i m = _mm256_castps_si256(magnitude);
  // ((m + 0x7FFFF + odd) >> 20) - (120 << 3), with the rebias folded into the addend: exact for
  // every normal magnitude (m >= 121 << 23); the others take the subnormal lane below.
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(m, 20), _mm256_set1_epi32(1));
  const __m256i normal =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(m, _mm256_set1_epi32(0x7FFFF - (120 << 23))), odd), 20);
  // The scalar code rounds magnitude * 512 + 1.5 * 2^23 to an integer k and converts k. The
  // same sum scaled by 2^-9 (exact, no overflow or underflow here), magnitude + 1.5 * 2^14,
  // rounds identically, and its bits exceed the constant's by k (one ulp is 2^-9 there).
  const __m256 magic = _mm256_set1_ps(24576.0F);
  const __m256i subnormal =
      _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(magnitude, magic)), _mm256_castps_si256(magic));
  const __m256i is_subnormal = _mm256_castps_si256(_mm256_cmp_ps(magnitude, _mm256_set1_ps(0.015625F), _CMP_LT_OQ));
  return _mm256_blendv_epi8(normal, subnormal, is_subnormal);
}

// Packs four vectors of e4m3 magnitude codes (32 elements, in order) into 32 bytes and sets
// each byte's sign bit from the sign of its source float.
KVRELAY_LANES __m256i pack_e4m3_32(const __m256 (&value)[4], const __m256i (&code)[4]) {
  const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(code[0], code[1]), _mm256_packs_epi32(code[2], code[3]));
  // Signed saturation keeps each float's sign bit through both packs.
  const __m256i signs =
      _mm256_packs_epi16(_mm256_packs_epi32(_mm256_castps_si256(value[0]), _mm256_castps_si256(value[1])),
                         _mm256_packs_epi32(_mm256_castps_si256(value[2]), _mm256_castps_si256(value[3])));
  const __m256i signed_bytes = _mm256_or_si256(bytes, _mm256_and_si256(signs, _mm256_set1_epi8(-128)));
  return _mm256_permutevar8x32_epi32(signed_bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// float_to_e4m3 on eight lanes: 32-bit lanes holding the codes.
KVRELAY_LANES __m256i float_to_e4m3_lanes(__m256 value) {
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(value), 24), _mm256_set1_epi32(0x80));
  return _mm256_or_si256(sign, e4m3_magnitude_lanes(value));
}

// e4m3_to_float on the eight codes in the low 8 bytes of `codes`. The code's exponent and
// mantissa bits, placed at float bits 20-26, are a float 2^-120 times the e4m3 value (a float
// subnormal for e4m3 subnormals), so one exact multiply by 2^120 decodes both ranges.
KVRELAY_LANES __m256 e4m3_to_float8(__m128i codes) {
  const __m256i c = _mm256_cvtepu8_epi32(codes);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24);
  const __m256 scaled_down = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x7F)), 20));
  const __m256 magnitude = _mm256_mul_ps(scaled_down, _mm256_castsi256_ps(_mm256_set1_epi32((127 + 120) << 23)));
  return _mm256_or_ps(magnitude, _mm256_castsi256_ps(sign));
}

// Four vectors of 32-bit lanes holding values in [0, 255] -> 32 bytes in lane order.
KVRELAY_LANES __m256i pack32_bytes(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
  return _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// One vector of 32-bit lanes holding values in [0, 255] -> 8 bytes at `out`.
KVRELAY_LANES void store8_bytes(__m256i a, std::uint8_t* out) {
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(words, words));
}

// Eight codes in [0, 15] (32-bit lanes) -> 4 bytes at `out`, element 2i in the low nibble.
KVRELAY_LANES void store8_nibbles(__m256i codes, std::uint8_t* out) {
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
  // 32-bit lane k holds codes 2k (low half) and 2k + 1 (high half).
  const __m128i pairs = _mm_or_si128(_mm_and_si128(words, _mm_set1_epi32(0x0F)),
                                     _mm_and_si128(_mm_srli_epi32(words, 12), _mm_set1_epi32(0xF0)));
  const __m128i bytes = _mm_packus_epi16(_mm_packs_epi32(pairs, pairs), pairs);
  _mm_storeu_si32(out, bytes);
}

// 32 codes in [0, 15] -> 16 bytes, element 2i in the low nibble (pack_nibbles).
KVRELAY_LANES __m128i pack_nibbles32(__m256i codes) {
  const __m256i low = _mm256_and_si256(codes, _mm256_set1_epi16(0x0F));
  const __m256i high = _mm256_and_si256(_mm256_srli_epi16(codes, 4), _mm256_set1_epi16(0xF0));
  const __m256i pairs = _mm256_or_si256(low, high);
  return _mm_packus_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1));
}

// 16 bytes -> 32 codes (unpack_nibbles): elements 0-15 in `first`, 16-31 in `second`.
KVRELAY_LANES void unpack_nibbles32(const std::uint8_t* in, __m128i& first, __m128i& second) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(packed, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
  first = _mm_unpacklo_epi8(low, high);
  second = _mm_unpackhi_epi8(low, high);
}

// make_quant_group on eight groups: min/max lanes -> the fp16 scale and zero as 16-bit lanes
// and the fp32 zero and inverse scale. Ranges and zeros are clamped before the fp16
// conversion, so F16C never sees a NaN there.
KVRELAY_LANES void make_quant_groups8(__m256 min_value, __m256 max_value, __m256 max_code, __m128i& scale_half,
                                      __m128i& zero_half, __m256& zero, __m256& inv_scale) {
  const __m256 half_max = _mm256_set1_ps(65504.0F);
  const __m256 no_value = _mm256_setzero_ps();
  // `min > -65504 ? min + 0 : -65504`: min + 0 compares as min does, and NaN takes -65504.
  __m256 clamped = _mm256_max_ps(_mm256_add_ps(min_value, no_value), _mm256_set1_ps(-65504.0F));
  clamped = _mm256_min_ps(clamped, half_max);
  __m256 range = _mm256_div_ps(_mm256_sub_ps(max_value, min_value), max_code);
  range = _mm256_max_ps(range, no_value);
  range = _mm256_min_ps(range, half_max);
  zero_half = _mm256_cvtps_ph(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  scale_half = _mm256_cvtps_ph(range, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  zero = _mm256_cvtph_ps(zero_half);
  const __m256 scale = _mm256_cvtph_ps(scale_half);
  inv_scale = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0F), scale), _mm256_cmp_ps(scale, no_value, _CMP_GT_OQ));
}

// True when no value of `count` is NaN or infinite.
KVRELAY_LANES bool all_finite(const float* values, std::size_t count) {
  const __m256i no_sign = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i infinity = _mm256_set1_epi32(0x7F800000);
  __m256i bad = _mm256_setzero_si256();
  std::size_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256i magnitude =
        _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(values + i)), no_sign);
    bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(magnitude, _mm256_sub_epi32(infinity, _mm256_set1_epi32(1))));
  }
  bool finite = _mm256_testz_si256(bad, bad) != 0;
  for (; i < count; ++i)
    finite = finite && __builtin_isfinite(values[i]);
  return finite;
}

// Horizontal min of eight lanes (NaN-free: min_ps kept the old lane for a NaN element).
KVRELAY_LANES float fold_min8(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  m = _mm_min_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// Horizontal max of eight non-NaN lanes.
KVRELAY_LANES float fold_max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

#undef KVRELAY_LANES

}  // namespace lanes
}  // namespace
