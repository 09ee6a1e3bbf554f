#include <catch2/catch.hpp>

#include "engine_fixture.h"

using namespace kvrelay::decision;
using kvrelay::RoutePolicy;
using testing::EngineFixture;

namespace {

constexpr std::uint64_t kTokens = 4096;

// Bandwidth at which tokens and kv_raw cost the same for kTokens, from the fixture's numbers:
// prefill(n) + 4n/B = 1e5*n/B  =>  B = n * (1e5 - 4) / prefill(n).
double break_even_bytes_per_s() {
  const double n = static_cast<double>(kTokens);
  const double prefill = 0.01 + 1e-4 * n + 1e-9 * n * n;
  return n * (100e3 - 4.0) / prefill;
}

struct Run {
  int switches = 0;
  std::vector<MediumId> chosen;
};

// Feeds one link sample per step (1 s of virtual time apart) and decides after each.
template <class Bandwidth>
Run drive(EngineFixture& f, RouteId route, int steps, Bandwidth bandwidth_at) {
  Run run;
  MediumId last = kNoMedium;
  for (int step = 0; step < steps; ++step) {
    const double bw = bandwidth_at(step);
    f.engine.observe_link(f.link, 64e6, 64e6 / bw);
    const Decision d = f.engine.decide(route, TransferShape{kTokens, 0, 1.0, static_cast<double>(step), 0, {}}).value();
    if (last != kNoMedium && d.chosen != last) {
      ++run.switches;
    }
    last = d.chosen;
    run.chosen.push_back(d.chosen);
  }
  return run;
}

RoutePolicy tokens_or_raw() {
  RoutePolicy policy;
  policy.allowed_media = {"tokens", "kv_raw"};
  return policy;
}

}  // namespace

TEST_CASE("Bandwidth oscillating around break-even does not flap the route") {
  const double even = break_even_bytes_per_s();
  // Samples alternate 25% above and below break-even, with a slow +-5% drift on top.
  const auto oscillating = [even](int step) {
    const double drift = 1.0 + 0.05 * ((step / 20) % 2 == 0 ? 1.0 : -1.0);
    return even * drift * (step % 2 == 0 ? 1.25 : 0.75);
  };
  EngineFixture f;
  const RouteId route = f.route(tokens_or_raw());
  const Run run = drive(f, route, 400, oscillating);
  CHECK(run.switches <= 1);

  // The same feed without windowing, threshold or dwell flaps constantly, so the check above
  // is about hysteresis and not about a feed that never crosses break-even.
  EngineConfig instantaneous;
  instantaneous.link_window = 1;
  instantaneous.min_dwell_s = 0.0;
  EngineFixture g(instantaneous);
  RoutePolicy no_threshold = tokens_or_raw();
  no_threshold.hysteresis_threshold = 0.0;
  const Run naive = drive(g, g.route(no_threshold), 400, oscillating);
  CHECK(naive.switches > 100);
}

TEST_CASE("A real bandwidth step switches the medium within the estimator window") {
  const double even = break_even_bytes_per_s();
  EngineConfig config;
  config.link_window = 16;
  config.min_dwell_s = 2.0;
  EngineFixture f(config);
  const RouteId route = f.route(tokens_or_raw());
  const MediumId raw = f.id("kv_raw");

  constexpr int kStepAt = 100;
  const Run run = drive(f, route, 200, [even](int step) { return step < kStepAt ? even * 3.0 : even / 3.0; });
  CHECK(run.chosen[kStepAt - 1] == raw);      // fast link: KV
  CHECK(run.chosen.back() == kTokensMedium);  // slow link: tokens
  int switched_at = -1;
  for (int step = kStepAt; step < 200; ++step) {
    if (run.chosen[static_cast<std::size_t>(step)] == kTokensMedium) {
      switched_at = step;
      break;
    }
  }
  REQUIRE(switched_at >= kStepAt);
  CHECK(switched_at - kStepAt < static_cast<int>(config.link_window));
  CHECK(run.switches == 1);  // KV -> tokens after the step, nothing else
}

TEST_CASE("Hysteresis holds a cheaper argmin below the threshold and reports it") {
  EngineFixture f;
  RoutePolicy policy = tokens_or_raw();
  policy.hysteresis_threshold = 0.5;
  const RouteId route = f.route(policy);
  const double even = break_even_bytes_per_s();
  // Settle on kv_raw with a link 30% faster than break-even...
  for (int i = 0; i < 16; ++i) {
    f.engine.observe_link(f.link, 64e6, 64e6 / (even * 1.3));
  }
  Decision first = f.engine.decide(route, TransferShape{kTokens, 0, 1.0, 0.0, 0, {}}).value();
  REQUIRE(first.chosen == f.id("kv_raw"));
  // ...then 30% slower: tokens is cheaper, but by less than 50%.
  for (int i = 0; i < 16; ++i) {
    f.engine.observe_link(f.link, 64e6, 64e6 / (even * 0.7));
  }
  const Decision held = f.engine.decide(route, TransferShape{kTokens, 0, 1.0, 100.0, 0, {}}).value();
  CHECK(held.argmin == kTokensMedium);
  CHECK(held.chosen == f.id("kv_raw"));
  CHECK(held.hysteresis_held);
  CHECK(held.reason == DecisionReason::kHysteresisHeld);
  CHECK(held.predicted_gain > 0.0);
  CHECK(held.predicted_gain < 0.5);
}

TEST_CASE("The minimum dwell delays a switch that beats the threshold") {
  EngineConfig config;
  config.min_dwell_s = 10.0;
  EngineFixture f(config);
  const RouteId route = f.route(tokens_or_raw());
  const double even = break_even_bytes_per_s();
  for (int i = 0; i < 16; ++i) {
    f.engine.observe_link(f.link, 64e6, 64e6 / (even * 4));
  }
  REQUIRE(f.engine.decide(route, TransferShape{kTokens, 0, 1.0, 0.0, 0, {}}).value().chosen == f.id("kv_raw"));
  for (int i = 0; i < 16; ++i) {
    f.engine.observe_link(f.link, 64e6, 64e6 / (even / 4));
  }
  const Decision early = f.engine.decide(route, TransferShape{kTokens, 0, 1.0, 5.0, 0, {}}).value();
  CHECK(early.reason == DecisionReason::kDwellHeld);
  CHECK(early.chosen == f.id("kv_raw"));
  const Decision later = f.engine.decide(route, TransferShape{kTokens, 0, 1.0, 10.0, 0, {}}).value();
  CHECK(later.reason == DecisionReason::kSwitched);
  CHECK(later.chosen == kTokensMedium);
}

TEST_CASE("Length regimes keep separate hysteresis state on one route") {
  EngineFixture f(EngineConfig{}, true, false, testing::kAttentionBound);
  const RouteId route = f.route_over("1GBps", 1e9);
  // Alternating short and long contexts follow the break-even length without being held.
  for (int i = 0; i < 10; ++i) {
    const Decision shorter = f.engine.decide(route, TransferShape{16, 0, 1.0, i * 2.0, 0, {}}).value();
    const Decision longer = f.engine.decide(route, TransferShape{16384, 0, 1.0, i * 2.0 + 1, 0, {}}).value();
    CHECK(shorter.chosen == kTokensMedium);
    CHECK(f.engine.medium(longer.chosen).needs_kv());
    CHECK_FALSE(shorter.hysteresis_held);
    CHECK_FALSE(longer.hysteresis_held);
  }
}
