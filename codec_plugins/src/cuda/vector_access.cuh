#pragma once

// 16-byte loads and stores of KV elements for the vectorized kernels, and alignment-checked
// word access for payload sections, whose offsets (after a metadata block) are only as aligned
// as the metadata size happens to make them.

#include <cuda_runtime.h>

#include <cstdint>

#include "kvrelay/codec_plugins/float_bits.h"

namespace kvrelay::codec::cuda {

// Elements per 16-byte vector: 4 float32, 8 float16/bfloat16 (dtype codes of core/dtype.h).
template <std::uint32_t Dtype>
inline constexpr int kVectorElements = Dtype == 1 ? 4 : 8;

// Hardware conversions. They round finite values exactly as float_bits.h's scalar versions
// (IEEE, nearest even); NaN (and, for safety, overflow) may come out differently, so callers
// check for them and fall back to the scalar versions for the (rare) vectors that hold one.
__device__ __forceinline__ float half_bits_to_float(std::uint32_t half) {
  float value;
  asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(static_cast<std::uint16_t>(half)));
  return value;
}

// Two floats -> two 16-bit elements in one word (`low` in bits 0-15).
template <std::uint32_t Dtype>
__device__ __forceinline__ std::uint32_t pack_pair(float low, float high) {
  std::uint32_t packed;
  if constexpr (Dtype == 2)
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
  else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
  return packed;
}

// Two floats -> two e4m3 codes (`low` in bits 0-7), saturating at 448 like float_to_e4m3; a NaN
// gives 0x7F/0xFF, which float_to_e4m3 never does (it maps NaN to 448).
__device__ __forceinline__ std::uint32_t e4m3_pair(float low, float high) {
  std::uint16_t packed;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(packed) : "f"(high), "f"(low));
  return packed;
}

// The quantizer steps of float_bits.h without int/float conversion instructions (which issue
// at a quarter of the FP32 rate), giving the same values for every input.

// e4m3_to_float: the code's exponent and mantissa bits placed at float bits 20-26 are its value
// times 2^-120 (an fp32 subnormal for e4m3 subnormals); one exact multiply restores it.
__device__ __forceinline__ float e4m3_to_float_fast(std::uint32_t code) {
  const float magnitude = __fmul_rn(__uint_as_float((code & 0x7FU) << 20), 0x1p120F);
  return __uint_as_float(__float_as_uint(magnitude) | ((code & 0x80U) << 24));
}

// A code (0..255) as a float: 2^23 + code has the code in its mantissa.
__device__ __forceinline__ float code_to_float(std::uint32_t code) {
  return __fsub_rn(__uint_as_float(0x4B000000U | code), 8388608.0F);
}

__device__ __forceinline__ float dequantize_step_fast(std::uint32_t code, float zero, float scale) {
  return __fadd_rn(__fmul_rn(code_to_float(code), scale), zero);
}

__device__ __forceinline__ std::uint32_t quantize_step_fast(float value, float zero, float inv_scale, float max_code) {
  float scaled = __fmul_rn(__fsub_rn(value, zero), inv_scale);
  scaled = scaled > 0.0F ? scaled : 0.0F;  // NaN -> 0
  scaled = scaled < max_code ? scaled : max_code;
  // quantize_step truncates scaled + 0.5 (in [0.5, 255.5]); adding 2^23 rounding toward zero
  // leaves exactly that integer in the low mantissa bits.
  return __float_as_uint(__fadd_rz(__fadd_rn(scaled, 0.5F), 8388608.0F)) - 0x4B000000U;
}

// make_quant_group with hardware half conversions: its clamps keep both inputs finite, where
// the hardware and float_bits.h agree bit for bit.
__device__ __forceinline__ QuantGroup make_quant_group_fast(float min_value, float max_value, float max_code) {
  const float kHalfMax = 65504.0F;
  float zero = min_value > -kHalfMax ? min_value + 0.0F : -kHalfMax;
  zero = zero < kHalfMax ? zero : kHalfMax;
  float range = __fdiv_rn(max_value - min_value, max_code);
  range = range > 0.0F ? range : 0.0F;
  range = range < kHalfMax ? range : kHalfMax;
  const std::uint32_t halves = pack_pair<2>(range, zero);
  QuantGroup group{};
  group.scale_half = static_cast<std::uint16_t>(halves & 0xFFFFU);
  group.zero_half = static_cast<std::uint16_t>(halves >> 16);
  group.zero = half_bits_to_float(group.zero_half);
  group.scale = half_bits_to_float(group.scale_half);
  group.inv_scale = group.scale > 0.0F ? __fdiv_rn(1.0F, group.scale) : 0.0F;
  return group;
}

// One 16-byte vector of elements as floats. Loads are 16-byte aligned (the dispatcher checks
// the KV base and the row size).
template <std::uint32_t Dtype>
__device__ __forceinline__ void unpack_vector(const uint4& raw, float (&values)[kVectorElements<Dtype>]) {
  const std::uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
  bool any_nan = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (Dtype == 1) {
      values[i] = __uint_as_float(words[i]);
    } else if constexpr (Dtype == 2) {
      values[2 * i] = half_bits_to_float(words[i] & 0xFFFFU);
      values[2 * i + 1] = half_bits_to_float(words[i] >> 16);
      any_nan |= values[2 * i] != values[2 * i] || values[2 * i + 1] != values[2 * i + 1];
    } else {
      values[2 * i] = __uint_as_float(words[i] << 16);
      values[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000U);
    }
  }
  if constexpr (Dtype == 2) {
    if (any_nan) {
#pragma unroll
      for (int i = 0; i < 8; ++i)
        values[i] = half_to_float(static_cast<std::uint16_t>(words[i / 2] >> (16 * (i % 2))));
    }
  }
}

template <std::uint32_t Dtype>
__device__ __forceinline__ void load_vector(const std::uint8_t* address, float (&values)[kVectorElements<Dtype>]) {
  unpack_vector<Dtype>(*reinterpret_cast<const uint4*>(address), values);
}

// Magnitudes from which a 16-bit conversion is left to float_bits.h: the largest finite value
// of the type (rounding to it or past it to infinity), and NaN, which fails the comparison.
template <std::uint32_t Dtype>
inline constexpr float kHardwareConversionLimit = Dtype == 2 ? 65504.0F : 3.38953139e38F;

template <std::uint32_t Dtype>
__device__ __forceinline__ void store_vector(std::uint8_t* address, const float (&values)[kVectorElements<Dtype>]) {
  std::uint32_t words[4];
  bool any_special = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (Dtype == 1) {
      words[i] = __float_as_uint(values[i]);
    } else {
      words[i] = pack_pair<Dtype>(values[2 * i], values[2 * i + 1]);
      any_special |= !(fabsf(values[2 * i]) < kHardwareConversionLimit<Dtype>) ||
                     !(fabsf(values[2 * i + 1]) < kHardwareConversionLimit<Dtype>);
    }
  }
  if constexpr (Dtype != 1) {
    if (any_special) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float pair[2] = {values[2 * i], values[2 * i + 1]};
        std::uint32_t halves[2];
#pragma unroll
        for (int j = 0; j < 2; ++j)
          halves[j] = Dtype == 2 ? float_to_half(pair[j]) : float_to_bf16(pair[j]);
        words[i] = halves[0] | (halves[1] << 16);
      }
    }
  }
  *reinterpret_cast<uint4*>(address) = make_uint4(words[0], words[1], words[2], words[3]);
}

// Bytes packed little-endian into words; the widest access the address allows.
template <int Bytes>
__device__ __forceinline__ void store_words(std::uint8_t* address, const std::uint32_t (&words)[(Bytes + 3) / 4]) {
  const auto where = reinterpret_cast<std::uintptr_t>(address);
  if constexpr (Bytes == 16) {
    if (where % 16 == 0) {
      *reinterpret_cast<uint4*>(address) = make_uint4(words[0], words[1], words[2], words[3]);
      return;
    }
  }
  if constexpr (Bytes % 8 == 0) {
    if (where % 8 == 0) {
#pragma unroll
      for (int i = 0; i < Bytes / 8; ++i)
        reinterpret_cast<uint2*>(address)[i] = make_uint2(words[2 * i], words[2 * i + 1]);
      return;
    }
  }
  if constexpr (Bytes % 4 == 0) {
    if (where % 4 == 0) {
#pragma unroll
      for (int i = 0; i < Bytes / 4; ++i)
        reinterpret_cast<std::uint32_t*>(address)[i] = words[i];
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < Bytes; ++i)
    address[i] = static_cast<std::uint8_t>(words[i / 4] >> (8 * (i % 4)));
}

template <int Bytes>
__device__ __forceinline__ void load_words(const std::uint8_t* address, std::uint32_t (&words)[(Bytes + 3) / 4]) {
  const auto where = reinterpret_cast<std::uintptr_t>(address);
  if constexpr (Bytes == 16) {
    if (where % 16 == 0) {
      const uint4 raw = *reinterpret_cast<const uint4*>(address);
      words[0] = raw.x;
      words[1] = raw.y;
      words[2] = raw.z;
      words[3] = raw.w;
      return;
    }
  }
  if constexpr (Bytes % 8 == 0) {
    if (where % 8 == 0) {
#pragma unroll
      for (int i = 0; i < Bytes / 8; ++i) {
        const uint2 raw = reinterpret_cast<const uint2*>(address)[i];
        words[2 * i] = raw.x;
        words[2 * i + 1] = raw.y;
      }
      return;
    }
  }
  if constexpr (Bytes % 4 == 0) {
    if (where % 4 == 0) {
#pragma unroll
      for (int i = 0; i < Bytes / 4; ++i)
        words[i] = reinterpret_cast<const std::uint32_t*>(address)[i];
      return;
    }
  }
#pragma unroll
  for (int i = 0; i < (Bytes + 3) / 4; ++i)
    words[i] = 0;
#pragma unroll
  for (int i = 0; i < Bytes; ++i)
    words[i / 4] |= static_cast<std::uint32_t>(address[i]) << (8 * (i % 4));
}

}  // namespace kvrelay::codec::cuda
