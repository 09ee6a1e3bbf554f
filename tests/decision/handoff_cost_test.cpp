// Receiver-side handoff costs learned from decision outcomes (HandoffFit in the engine).

#include <catch2/catch.hpp>

#include <limits>

#include "kvrelay/decision/estimators.h"

#include "engine_fixture.h"

using namespace kvrelay::decision;
using kvrelay::decision::testing::EngineFixture;

TEST_CASE("LinearCostFit recovers a fixed cost plus a cost per byte", "[decision][handoff]") {
  LinearCostFit fit;
  CHECK(fit.samples() == 0);
  fit.observe(1e6, 0.012);  // one size: proportional until a second size is seen
  CHECK(fit.predict(2e6) == Approx(0.024));
  for (const double bytes : {2e6, 4e6, 8e6, 16e6})
    fit.observe(bytes, 0.01 + bytes * 2e-9);
  fit.observe(1e6, 0.01 + 1e6 * 2e-9);
  // The first sample (0.012 s at 1 MB) is still in the window; it pulls the fit a little.
  CHECK(fit.seconds_per_byte() == Approx(2e-9).epsilon(0.05));
  CHECK(fit.fixed_seconds() == Approx(0.01).epsilon(0.1));
  CHECK(fit.predict(32e6) == Approx(0.01 + 32e6 * 2e-9).epsilon(0.05));

  SECTION("never a negative cost: a falling window is taken as proportional") {
    LinearCostFit falling;
    falling.observe(1e6, 0.5);
    falling.observe(10e6, 0.1);
    CHECK(falling.fixed_seconds() >= 0.0);
    CHECK(falling.seconds_per_byte() >= 0.0);
  }
  SECTION("non-finite or negative samples are ignored") {
    LinearCostFit guarded;
    guarded.observe(-1.0, 1.0);
    guarded.observe(1e6, std::numeric_limits<double>::quiet_NaN());
    CHECK(guarded.samples() == 0);
  }
  SECTION("the window forgets: after 16 new samples only they count") {
    for (int i = 0; i < 16; ++i)
      fit.observe(4e6 + i * 1e6, 0.1);
    CHECK(fit.seconds_per_byte() == Approx(0.0).margin(1e-15));
    CHECK(fit.fixed_seconds() == Approx(0.1));
  }
}

TEST_CASE("LinearCostFit keeps its prediction through a few handoffs measured on a busy host", "[decision][handoff]") {
  LinearCostFit fit;
  for (int i = 0; i < 12; ++i) {
    const double bytes = (1 + i % 4) * 1e6;
    fit.observe(bytes, 0.005 + bytes * 5e-9);
  }
  // Three handoffs whose worker lost the cores: ten times the usual, one of them at a new size.
  fit.observe(2e6, 10 * (0.005 + 2e6 * 5e-9));
  fit.observe(4e6, 10 * (0.005 + 4e6 * 5e-9));
  fit.observe(8e6, 10 * (0.005 + 8e6 * 5e-9));
  CHECK(fit.fixed_seconds() == Approx(0.005).epsilon(0.01));
  CHECK(fit.seconds_per_byte() == Approx(5e-9).epsilon(0.01));
  CHECK(fit.predict(16e6) == Approx(0.005 + 16e6 * 5e-9).epsilon(0.01));

  SECTION("once slow is the typical case, it is what is predicted") {
    for (int i = 0; i < 12; ++i) {
      const double bytes = (1 + i % 4) * 1e6;
      fit.observe(bytes, 10 * (0.005 + bytes * 5e-9));
    }
    CHECK(fit.predict(2e6) == Approx(10 * (0.005 + 2e6 * 5e-9)).epsilon(0.01));
  }
  SECTION("only empty transfers: all of their time is fixed") {
    LinearCostFit empty;
    for (const double seconds : {0.002, 0.003, 0.1})
      empty.observe(0.0, seconds);
    CHECK(empty.fixed_seconds() == Approx(0.003));
    CHECK(empty.seconds_per_byte() == 0.0);
  }
}

TEST_CASE("the engine's choice follows measured handoff costs, per route and medium", "[decision][handoff]") {
  EngineFixture fixture({}, true, false, PrefillCoefficients{0.01, 5e-3, 1e-6});  // recompute: ~14 s
  const RouteId route = fixture.route();
  const RouteId other = fixture.route();
  TransferShape shape;
  shape.tokens = 2000;  // 200 MB of fp16 KV at 100 kB per token
  const double raw_bytes = 2000 * 100e3;
  auto before = fixture.engine.predict(route, shape);
  REQUIRE(before);
  const MediumId first = before.value().argmin;
  REQUIRE(fixture.engine.medium(first).needs_kv());

  // The medium the link and codec model prefers turns out slow on the receiver (fresh-memory
  // decode, import): five times what the model predicted.
  const double predicted = before.value().cost_of(first).total_s;
  fixture.engine.observe_handoff(route, first, raw_bytes, 5.0 * predicted);
  auto after = fixture.engine.predict(route, shape);
  REQUIRE(after);
  CHECK(after.value().argmin != first);
  CHECK(after.value().cost_of(first).comm_s == Approx(5.0 * predicted));
  CHECK(after.value().cost_of(first).codec_s == 0.0);
  // Another route over the same link has not seen that outcome.
  CHECK(fixture.engine.predict(other, shape).value().argmin == first);

  SECTION("an outcome for tokens or an unknown route or medium is ignored") {
    fixture.engine.observe_handoff(route, fixture.id("tokens"), raw_bytes, 100.0);
    fixture.engine.observe_handoff(99, first, raw_bytes, 100.0);
    fixture.engine.observe_handoff(route, 200, raw_bytes, 100.0);
    CHECK(fixture.engine.predict(route, shape).value().cost_of(fixture.id("tokens")).total_s ==
          Approx(before.value().cost_of(fixture.id("tokens")).total_s));
  }
}
