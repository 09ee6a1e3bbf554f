#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <random>

#include "kvrelay/decision/estimators.h"

using kvrelay::decision::PrefillCoefficients;
using kvrelay::decision::PrefillFit;
using kvrelay::decision::WindowedMean;
using kvrelay::decision::WindowedRate;

TEST_CASE("WindowedRate returns the prior until measured, then bytes over seconds of the window") {
  WindowedRate rate(4, 100.0);
  CHECK(rate.per_second() == 100.0);
  rate.observe(1000.0, 1.0);
  rate.observe(3000.0, 1.0);
  CHECK(rate.per_second() == Approx(2000.0));
  // Four more samples push the first two out of the window.
  for (int i = 0; i < 4; ++i) {
    rate.observe(500.0, 1.0);
  }
  CHECK(rate.per_second() == Approx(500.0));
  // Broken measurements are ignored rather than poisoning the estimate.
  rate.observe(1.0, 0.0);
  rate.observe(std::numeric_limits<double>::quiet_NaN(), 1.0);
  rate.observe(-5.0, 1.0);
  CHECK(rate.per_second() == Approx(500.0));
  CHECK(rate.samples() == 4);
}

TEST_CASE("WindowedMean averages the last N samples") {
  WindowedMean mean(3, 7.0);
  CHECK(mean.mean() == 7.0);
  for (const double v : {1.0, 2.0, 3.0, 10.0}) {
    mean.observe(v);
  }
  CHECK(mean.mean() == Approx((2.0 + 3.0 + 10.0) / 3.0));
}

TEST_CASE("PrefillFit keeps the prior until enough samples, then recovers the true curve from noisy data") {
  const PrefillCoefficients prior{0.5, 1e-3, 0.0};
  const PrefillCoefficients truth{0.02, 1.5e-4, 4e-9};
  PrefillFit fit(64, 8, prior);
  std::mt19937_64 rng(42);
  // Context lengths are spread log-uniformly, as agent contexts are (16 .. 32k tokens).
  std::uniform_real_distribution<double> log_length(std::log(16.0), std::log(32768.0));
  const auto length = [&log_length](std::mt19937_64& g) { return static_cast<std::uint64_t>(std::exp(log_length(g))); };
  std::uniform_int_distribution<std::uint64_t> cached(0, 8192);
  std::normal_distribution<double> noise(1.0, 0.03);
  for (int i = 0; i < 7; ++i) {
    const auto n = length(rng);
    const auto c = cached(rng);
    fit.observe(n, c, truth.predict(static_cast<double>(n), static_cast<double>(c)) * noise(rng));
  }
  CHECK_FALSE(fit.fitted());
  CHECK(fit.predict(1000, 0) == Approx(prior.predict(1000, 0)));
  for (int i = 0; i < 200; ++i) {
    const auto n = length(rng);
    const auto c = cached(rng);
    fit.observe(n, c, truth.predict(static_cast<double>(n), static_cast<double>(c)) * noise(rng));
  }
  REQUIRE(fit.fitted());
  for (const auto& [n, c] : {std::pair<double, double>{256, 0}, {4096, 1024}, {20000, 4000}, {32768, 0}}) {
    const double expected = truth.predict(n, c);
    CHECK(fit.predict(static_cast<std::uint64_t>(n), static_cast<std::uint64_t>(c)) ==
          Approx(expected).epsilon(0.05));
  }
}

TEST_CASE("PrefillFit never produces negative coefficients, even when the data would suggest them") {
  // Linear data with a negative offset would drive `a` below zero in a plain fit.
  PrefillFit fit(32, 4, PrefillCoefficients{0.01, 1e-4, 1e-9});
  for (std::uint64_t n = 1000; n <= 4100; n += 100) {
    fit.observe(n, 0, 1e-4 * static_cast<double>(n) - 0.05);
  }
  const auto& k = fit.coefficients();
  CHECK(k.a >= 0.0);
  CHECK(k.b >= 0.0);
  CHECK(k.c >= 0.0);
  CHECK(fit.predict(3000, 0) == Approx(0.25).epsilon(0.1));
}

TEST_CASE("PrefillFit follows a load change within one window") {
  const PrefillCoefficients truth{0.01, 2e-4, 0.0};
  PrefillFit fit(32, 8, truth);
  for (int round = 0; round < 2; ++round) {
    const double load = round == 0 ? 1.0 : 3.0;  // receiver becomes three times slower
    for (int i = 0; i < 32; ++i) {
      const std::uint64_t n = 256 + static_cast<std::uint64_t>(i) * 512;
      fit.observe(n, 0, truth.predict(static_cast<double>(n), 0) * load);
    }
    CHECK(fit.predict(4096, 0) == Approx(truth.predict(4096, 0) * load).epsilon(0.02));
  }
}
