#pragma once

// Scalar conversions and quantizer steps shared by the CPU codecs and the CUDA kernels, so both
// produce the same bytes. Rules that keep them bit-identical: only IEEE single-precision
// operations with round-to-nearest-even, no fused multiply-add (CUDA files build with
// -fmad=false), no library math whose precision differs between host and device, and NaN
// flushed by the clamps before any float-to-int conversion (which would be undefined).

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVRELAY_HD __host__ __device__ __forceinline__
#else
#define KVRELAY_HD inline __attribute__((always_inline))
#endif

namespace kvrelay::codec {

KVRELAY_HD float bits_to_float(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

KVRELAY_HD std::uint32_t float_to_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

// Branch-free select: the vectorizer keeps loops whose selects are plain bit arithmetic.
KVRELAY_HD std::uint32_t select_bits(bool condition, std::uint32_t if_true, std::uint32_t if_false) {
  const std::uint32_t mask = 0U - static_cast<std::uint32_t>(condition);
  return (if_true & mask) | (if_false & ~mask);
}

// IEEE half -> float, exact, branch-free (after Maratyszcza's FP16 library).
KVRELAY_HD float half_to_float(std::uint16_t half) {
  const std::uint32_t w = static_cast<std::uint32_t>(half) << 16;
  const std::uint32_t sign = w & 0x80000000U;
  const std::uint32_t two_w = w + w;
  const float normalized = bits_to_float((two_w >> 4) + (0xE0U << 23)) * bits_to_float(0x7800000U);  // 2^-112
  const float denormalized = bits_to_float((two_w >> 17) | (126U << 23)) - 0.5F;
  const std::uint32_t result =
      sign | select_bits(two_w < (1U << 27), float_to_bits(denormalized), float_to_bits(normalized));
  return bits_to_float(result);
}

// float -> IEEE half, round to nearest even; NaN stays NaN, overflow goes to infinity.
KVRELAY_HD std::uint16_t float_to_half(float value) {
  const float scale_to_inf = bits_to_float(0x77800000U);   // 2^112
  const float scale_to_zero = bits_to_float(0x08800000U);  // 2^-110
  const std::uint32_t w = float_to_bits(value);
  float base = bits_to_float(w & 0x7FFFFFFFU) * scale_to_inf;
  base = base * scale_to_zero;
  const std::uint32_t shl1_w = w + w;
  const std::uint32_t sign = w & 0x80000000U;
  std::uint32_t bias = shl1_w & 0xFF000000U;
  bias = select_bits(bias < 0x71000000U, 0x71000000U, bias);
  base = bits_to_float((bias >> 1) + 0x07800000U) + base;
  const std::uint32_t bits = float_to_bits(base);
  const std::uint32_t exp_bits = (bits >> 13) & 0x00007C00U;
  const std::uint32_t mantissa_bits = bits & 0x00000FFFU;
  const std::uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<std::uint16_t>((sign >> 16) | select_bits(shl1_w > 0xFF000000U, 0x7E00U, nonsign));
}

KVRELAY_HD float bf16_to_float(std::uint16_t value) {
  return bits_to_float(static_cast<std::uint32_t>(value) << 16);
}

// float -> bfloat16, round to nearest even; NaN becomes a quiet NaN of the same sign.
KVRELAY_HD std::uint16_t float_to_bf16(float value) {
  const std::uint32_t bits = float_to_bits(value);
  const std::uint32_t rounded = (bits + 0x7FFFU + ((bits >> 16) & 1U)) >> 16;
  const bool is_nan = (bits & 0x7FFFFFFFU) > 0x7F800000U;
  return static_cast<std::uint16_t>(select_bits(is_nan, (bits >> 16) | 0x40U, rounded));
}

// Largest finite e4m3 (fn variant: no infinities, 0x7F/0xFF are NaN, never produced here).
inline constexpr float kFp8E4m3Max = 448.0F;

// |value| (already scaled, any float) -> e4m3 code, round to nearest even, saturating at 448.
KVRELAY_HD std::uint8_t float_to_e4m3(float value) {
  const std::uint32_t sign = (float_to_bits(value) >> 24) & 0x80U;
  float magnitude = bits_to_float(float_to_bits(value) & 0x7FFFFFFFU);
  // NaN compares false: it becomes 448 here, never reaching an int conversion.
  magnitude = magnitude < kFp8E4m3Max ? magnitude : kFp8E4m3Max;
  // Normal range (>= 2^-6): round the fp32 mantissa to 3 bits, rebias the exponent 127 -> 7.
  const std::uint32_t bits = float_to_bits(magnitude);
  const std::uint32_t normal = ((bits + 0x7FFFFU + ((bits >> 20) & 1U)) >> 20) - (120U << 3);
  // Subnormal range: multiples of 2^-9; the magic constant makes the add round to an integer.
  const float sub = (magnitude * 512.0F + 12582912.0F) - 12582912.0F;
  const auto subnormal = static_cast<std::uint32_t>(static_cast<std::int32_t>(sub));
  const std::uint32_t code = select_bits(magnitude < 0.015625F, subnormal, normal);
  return static_cast<std::uint8_t>(sign | code);
}

// The per-head fp8 scale: amax / 448, or 1 where that cannot be used: amax zero, NaN or
// infinite, or below 2^-100, where 1 / scale could overflow and 0 * (1 / scale) give NaN. So
// inverse scales are always finite and positive, and only a NaN input makes a NaN product.
KVRELAY_HD float fp8_scale(float amax) {
  return amax >= 0x1p-100F && amax < bits_to_float(0x7F800000U) ? amax / kFp8E4m3Max : 1.0F;
}

// The e4m3 code of `value` scaled by an fp8_scale inverse. The sign is taken from `value`: a NaN
// product keeps the input's sign on x86 but is a positive canonical NaN on NVIDIA GPUs.
KVRELAY_HD std::uint8_t scaled_e4m3(float value, float inv_scale) {
  const std::uint32_t sign = (float_to_bits(value) >> 24) & 0x80U;
  return static_cast<std::uint8_t>(sign | (float_to_e4m3(value * inv_scale) & 0x7FU));
}

KVRELAY_HD float e4m3_to_float(std::uint8_t code) {
  const std::uint32_t sign = static_cast<std::uint32_t>(code & 0x80U) << 24;
  const std::uint32_t exponent = (code >> 3) & 0xFU;
  const std::uint32_t mantissa = code & 0x7U;
  const float subnormal = static_cast<float>(mantissa) * 0.001953125F;  // 2^-9
  const float normal = bits_to_float(((exponent + 120U) << 23) | (mantissa << 20));
  return bits_to_float(sign | select_bits(exponent == 0, float_to_bits(subnormal), float_to_bits(normal)));
}

// e5m2 is the top byte of an IEEE half: exact both ways through half_to_float.
KVRELAY_HD float e5m2_to_float(std::uint8_t code) {
  return half_to_float(static_cast<std::uint16_t>(static_cast<std::uint16_t>(code) << 8));
}

// float -> e5m2 via the half, round to nearest even on the low byte; NaN stays NaN, overflow
// carries into infinity. Rounds twice (float -> half -> e5m2): for synthetic and test data only.
KVRELAY_HD std::uint8_t float_to_e5m2(float value) {
  const std::uint32_t half = float_to_half(value);
  const bool is_nan = (half & 0x7FFFU) > 0x7C00U;
  const std::uint32_t rounded = (half + 0x7FU + ((half >> 8) & 1U)) >> 8;
  return static_cast<std::uint8_t>(select_bits(is_nan, (half >> 8) | 0x02U, rounded));
}

// Asymmetric quantizer step: code = round((x - zero) * inv_scale) clamped to [0, max_code].
// Written as a clamp then +0.5 truncation (values are non-negative there) so host and device agree.
KVRELAY_HD std::uint32_t quantize_step(float value, float zero, float inv_scale, float max_code) {
  float scaled = (value - zero) * inv_scale;
  scaled = scaled > 0.0F ? scaled : 0.0F;  // NaN -> 0
  scaled = scaled < max_code ? scaled : max_code;
  // Signed conversion: x86 has no vector float -> unsigned instruction before AVX-512.
  return static_cast<std::uint32_t>(static_cast<std::int32_t>(scaled + 0.5F));
}

KVRELAY_HD float dequantize_step(std::uint32_t code, float zero, float scale) {
  return static_cast<float>(code) * scale + zero;
}

// Turns a group's [min, max] into the fp16 scale/zero pair stored on the wire, and the fp32
// values both sides compute with. Ranges beyond fp16 saturate (documented in docs/codecs.md).
struct QuantGroup {
  std::uint16_t scale_half;
  std::uint16_t zero_half;
  float scale;
  float zero;
  float inv_scale;
};

KVRELAY_HD QuantGroup make_quant_group(float min_value, float max_value, float max_code) {
  const float kHalfMax = 65504.0F;
  // "+ 0.0F" turns -0 into +0, so the result does not depend on which zero a reduction met first.
  float zero = min_value > -kHalfMax ? min_value + 0.0F : -kHalfMax;  // NaN -> -65504
  zero = zero < kHalfMax ? zero : kHalfMax;
  float range = (max_value - min_value) / max_code;
  range = range > 0.0F ? range : 0.0F;
  range = range < kHalfMax ? range : kHalfMax;
  QuantGroup group{};
  group.zero_half = float_to_half(zero);
  group.scale_half = float_to_half(range);
  group.zero = half_to_float(group.zero_half);
  group.scale = half_to_float(group.scale_half);
  group.inv_scale = group.scale > 0.0F ? 1.0F / group.scale : 0.0F;
  return group;
}

}  // namespace kvrelay::codec
