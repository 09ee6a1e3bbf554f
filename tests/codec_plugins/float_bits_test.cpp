#include "kvrelay/codec_plugins/float_bits.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "support/skip.h"

using namespace kvrelay::codec;

namespace {

// Brute force: the e4m3 code whose value is nearest to x (ties to the even code), saturating.
std::uint8_t nearest_e4m3(float x) {
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double magnitude = std::fabs(static_cast<double>(x));
  int best = 0;
  double best_error = INFINITY;
  for (int code = 0; code <= 0x7E; ++code) {
    const double error = std::fabs(e4m3_to_float(static_cast<std::uint8_t>(code)) - magnitude);
    if (error < best_error || (error == best_error && code % 2 == 0)) {
      best = code;
      best_error = error;
    }
  }
  return static_cast<std::uint8_t>(sign | best);
}

}  // namespace

TEST_CASE("e4m3 decode table matches the format's definition", "[codec][float]") {
  CHECK(e4m3_to_float(0x00) == 0.0F);
  CHECK(e4m3_to_float(0x01) == std::ldexp(1.0F, -9));  // smallest subnormal
  CHECK(e4m3_to_float(0x08) == std::ldexp(1.0F, -6));  // smallest normal
  CHECK(e4m3_to_float(0x38) == 1.0F);
  CHECK(e4m3_to_float(0x7E) == 448.0F);
  CHECK(e4m3_to_float(0xBE) == -1.75F);  // sign, exponent 7 (bias 7), mantissa 6/8
}

TEST_CASE("float_to_e4m3 rounds to the nearest code with ties to even and saturates", "[codec][float]") {
  std::mt19937 random(7);
  std::uniform_real_distribution<float> exponent(-14.0F, 10.0F);
  for (int i = 0; i < 20000; ++i) {
    const float magnitude = std::exp2(exponent(random));
    const float x = (i % 2 == 0) ? magnitude : -magnitude;
    INFO("x = " << x);
    REQUIRE(float_to_e4m3(x) == nearest_e4m3(x));
  }
  // Exact midpoints between neighbouring codes.
  for (int code = 0; code < 0x7E; ++code) {
    const float low = e4m3_to_float(static_cast<std::uint8_t>(code));
    const float high = e4m3_to_float(static_cast<std::uint8_t>(code + 1));
    const float middle = (low + high) / 2;
    INFO("code " << code);
    REQUIRE(float_to_e4m3(middle) == ((code % 2 == 0) ? code : code + 1));
  }
  CHECK(float_to_e4m3(1e30F) == 0x7E);
  CHECK(float_to_e4m3(NAN) == 0x7E);  // flushed by the clamp, never undefined behaviour
}

#if defined(__FLT16_MAX__)
TEST_CASE("half conversions agree with the compiler's _Float16 on every value", "[codec][float]") {
  for (std::uint32_t bits = 0; bits < 65536; ++bits) {
    const auto half_bits = static_cast<std::uint16_t>(bits);
    _Float16 reference;
    std::memcpy(&reference, &half_bits, 2);
    const float expected = static_cast<float>(reference);
    const float actual = half_to_float(half_bits);
    if (std::isnan(expected)) {
      REQUIRE(std::isnan(actual));
    } else {
      REQUIRE(float_to_bits(actual) == float_to_bits(expected));
    }
  }
  std::mt19937 random(11);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 200000; ++i) {
    const float x = bits_to_float(any_bits(random));
    const auto reference = static_cast<_Float16>(x);
    std::uint16_t expected;
    std::memcpy(&expected, &reference, 2);
    const std::uint16_t actual = float_to_half(x);
    if (std::isnan(x)) {
      REQUIRE((actual & 0x7C00) == 0x7C00);
      REQUIRE((actual & 0x03FF) != 0);
    } else {
      INFO("x = " << x);
      REQUIRE(actual == expected);
    }
  }
}
#else
TEST_CASE("half conversions agree with the compiler's _Float16 on every value", "[codec][float]") {
  KVRELAY_SKIP("compiler lacks _Float16");
}
#endif

TEST_CASE("bf16 conversion rounds to nearest even and keeps NaN", "[codec][float]") {
  std::mt19937 random(13);
  std::uniform_int_distribution<std::uint32_t> any_bits;
  for (int i = 0; i < 100000; ++i) {
    const std::uint32_t bits = any_bits(random);
    const float x = bits_to_float(bits);
    const std::uint16_t result = float_to_bf16(x);
    if (std::isnan(x)) {
      REQUIRE(std::isnan(bf16_to_float(result)));
      continue;
    }
    const std::uint32_t down = bits & 0xFFFF0000U;
    const double low = bits_to_float(down);
    const double high = bits_to_float(down + 0x10000U);
    const double chosen = bf16_to_float(result);
    INFO("bits " << bits);
    if (std::isinf(chosen) && !std::isinf(x)) {
      REQUIRE(std::fabs(x) > bf16_to_float(0x7F7F));  // rounds past the largest finite bf16
      continue;
    }
    const double error = std::fabs(chosen - x);
    REQUIRE(error <= std::fabs(low - x));
    if (std::isfinite(high)) REQUIRE(error <= std::fabs(high - x));
  }
  CHECK(float_to_bf16(1.0F) == 0x3F80);
  CHECK(float_to_bf16(bits_to_float(0x3F808000U)) == 0x3F80);  // tie -> even
  CHECK(float_to_bf16(bits_to_float(0x3F818000U)) == 0x3F82);  // tie -> even (up)
}

TEST_CASE("e5m2 is the top byte of a half: every code decodes and re-encodes to itself", "[codec][float]") {
  for (int code = 0; code < 256; ++code) {
    INFO(code);
    const auto byte = static_cast<std::uint8_t>(code);
    const float value = e5m2_to_float(byte);
    CHECK(float_to_bits(value) == float_to_bits(half_to_float(static_cast<std::uint16_t>(code << 8))));
    if (std::isnan(value)) {
      CHECK(std::isnan(e5m2_to_float(float_to_e5m2(value))));
    } else {
      CHECK(float_to_e5m2(value) == byte);
    }
  }
  CHECK(e5m2_to_float(0x3C) == 1.0F);
  CHECK(e5m2_to_float(0x7B) == 57344.0F);  // largest finite
  CHECK(std::isinf(e5m2_to_float(0x7C)));
  CHECK(float_to_e5m2(1e6F) == 0x7C);    // overflow carries into infinity
  CHECK(float_to_e5m2(1.125F) == 0x3C);  // a tie between 1.0 (even) and 1.25 rounds to even
  CHECK(float_to_e5m2(1.375F) == 0x3E);  // a tie between 1.25 (odd) and 1.5 rounds to even
}
