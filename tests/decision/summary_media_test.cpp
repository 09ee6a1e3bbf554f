// The summary medium (issue #28, docs/summary.md): priced from its token budget, B's prefill of
// it and the summariser's time; chosen only where a route names it; excluded below the quality
// floor like a lossy medium; never by the fingerprint rule, since no KV moves.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kvrelay/decision/decision_json.h"
#include "kvrelay/decision/engine_from_policy.h"

#include "engine_fixture.h"

using namespace kvrelay;
using namespace kvrelay::decision;
using kvrelay::decision::testing::EngineFixture;

namespace {

RoutePolicy summary_test_route(std::string id, std::uint32_t budget = 64) {
  RoutePolicy policy;
  policy.id = std::move(id);
  policy.allowed_media = {"tokens", "kv_raw", "summary"};
  policy.summary.max_tokens = budget;
  return policy;
}

TransferShape summarisable_context(std::uint64_t tokens = 16384) {
  TransferShape shape;
  shape.tokens = tokens;
  shape.expected_output_tokens = 100;
  return shape;
}

}  // namespace

TEST_CASE("summary is priced from its budget, B's prefill of it and the summariser's decode prior",
          "[decision][summary]") {
  EngineFixture f;  // decode 0.01 s/token on both agents, 1 Gbit/s and 1 ms, prefill 0.01 + 1e-4 n + 1e-9 n^2
  const RouteId r = f.route(summary_test_route("s", 64));
  const Decision d = f.engine.predict(r, summarisable_context()).value();
  const auto& summary = d.cost_of(f.id("summary"));
  CHECK(summary.excluded == Exclusion::kNone);
  CHECK(summary.wire_bytes == Approx(64 * 4.0));
  CHECK(summary.comm_s == Approx(256.0 / 1.25e8 + 1e-3));
  CHECK(summary.codec_s == 0.0);
  // B prefills 64 new tokens (nothing of them cached), after the summariser decoded 64 at 10 ms.
  CHECK(summary.comp_s == Approx((0.01 + 1e-4 * 64 + 1e-9 * 64 * 64) + 0.01 * 64));
  CHECK(summary.loss_s == Approx(0.25 * 100 * 0.01));
  CHECK(summary.total_s == Approx(summary.comm_s + summary.comp_s + summary.loss_s));
  CHECK(f.engine.summariser_seconds(r) == Approx(0.64));
  // A long context on this link: cheaper summarised than re-prefilled or moved as KV.
  CHECK(d.argmin == f.id("summary"));
}

TEST_CASE("summary's cost grows with the budget and with the summariser time measured on the route",
          "[decision][summary]") {
  EngineFixture f;
  const RouteId small = f.route(summary_test_route("small", 32));
  const RouteId large = f.route(summary_test_route("large", 256));
  const double small_cost = f.engine.predict(small, summarisable_context()).value().cost_of(f.id("summary")).total_s;
  const double large_cost = f.engine.predict(large, summarisable_context()).value().cost_of(f.id("summary")).total_s;
  CHECK(large_cost > small_cost);

  // Measured calls replace the prior: a windowed mean per route.
  const double before = f.engine.predict(small, summarisable_context()).value().cost_of(f.id("summary")).comp_s;
  f.engine.observe_summary(small, 2.0);
  f.engine.observe_summary(small, 4.0);
  CHECK(f.engine.summariser_seconds(small) == Approx(3.0));
  const auto after = f.engine.predict(small, summarisable_context()).value().cost_of(f.id("summary"));
  CHECK(after.comp_s == Approx(before - 0.01 * 32 + 3.0));
  CHECK(after.comp_s > before);
  // The other route keeps its own estimate; bad samples are ignored.
  CHECK(f.engine.summariser_seconds(large) == Approx(0.01 * 256));
  f.engine.observe_summary(small, -1.0);
  f.engine.observe_summary(small, std::numeric_limits<double>::quiet_NaN());
  CHECK(f.engine.summariser_seconds(small) == Approx(3.0));
  // Slow enough summaries lose to the other media.
  for (int i = 0; i < 16; ++i)
    f.engine.observe_summary(small, 100.0);
  CHECK(f.engine.predict(small, summarisable_context()).value().argmin != f.id("summary"));
}

TEST_CASE("summary is excluded unless the route names it, which an empty allowed_media does not",
          "[decision][summary]") {
  EngineFixture f;
  const RouteId every = f.route();  // allowed_media empty: every medium that moves the context
  const Decision d = f.engine.predict(every, summarisable_context()).value();
  CHECK(d.cost_of(f.id("summary")).excluded == Exclusion::kNotAllowed);
  CHECK(d.argmin != f.id("summary"));
  CHECK(d.cost_of(f.id("kv_raw")).excluded == Exclusion::kNone);

  RoutePolicy listed = summary_test_route("listed");
  CHECK(f.engine.predict(f.route(listed), summarisable_context()).value().cost_of(f.id("summary")).excluded ==
        Exclusion::kNone);

  RoutePolicy forced;
  forced.id = "forced";
  forced.forced_medium = "summary";
  const Decision forced_decision = f.engine.predict(f.route(forced), TransferShape{64, 0, 1.0, 0.0, 16, {}}).value();
  CHECK(forced_decision.argmin == f.id("summary"));
  CHECK(forced_decision.cost_of(kTokensMedium).excluded == Exclusion::kNotForced);

  // A lookup after B's request left asks with summary_possible false: nothing to summarise any more.
  TransferShape late = summarisable_context();
  late.summary_possible = false;
  const Decision after = f.engine.predict(f.route(summary_test_route("late")), late).value();
  CHECK(after.cost_of(f.id("summary")).excluded == Exclusion::kSummaryUnavailable);
  CHECK(after.argmin != f.id("summary"));
}

TEST_CASE("summary crosses models whose fingerprints differ, where every KV medium is excluded",
          "[decision][summary]") {
  EngineFixture f(EngineConfig{}, /*same_model=*/false);
  RoutePolicy policy = summary_test_route("cross");
  policy.allowed_media = {"tokens", "kv_raw", "kv_int8", "summary"};
  const Decision d = f.engine.predict(f.route(policy), summarisable_context()).value();
  CHECK(d.cost_of(f.id("kv_raw")).excluded == Exclusion::kFingerprintMismatch);
  CHECK(d.cost_of(f.id("kv_int8")).excluded == Exclusion::kFingerprintMismatch);
  CHECK(d.cost_of(f.id("summary")).excluded == Exclusion::kNone);
  CHECK(d.argmin == f.id("summary"));
  // fp8 KV moves only as bytes; a summary moves no KV, so the dtype does not exclude it.
  TransferShape fp8 = summarisable_context();
  fp8.dtype = DType::kFp8E4M3;
  CHECK(f.engine.predict(f.route(summary_test_route("fp8")), fp8).value().cost_of(f.id("summary")).excluded ==
        Exclusion::kNone);
}

TEST_CASE("a route's quality floor excludes summary like a lossy medium, by its calibrated fidelity",
          "[decision][summary]") {
  EngineFixture f;
  RoutePolicy floored = summary_test_route("floored");
  floored.quality_floor = 0.6;  // above the default 0.5
  const RouteId r = f.route(floored);
  CHECK(f.engine.predict(r, summarisable_context()).value().cost_of(f.id("summary")).excluded ==
        Exclusion::kBelowQualityFloor);
  // An audit measured it better on this deployment (cost_model.media.summary.fidelity).
  REQUIRE(f.engine.update_medium_quality(f.id("summary"), 0.8, 0.1));
  const Decision d = f.engine.predict(r, summarisable_context()).value();
  CHECK(d.cost_of(f.id("summary")).excluded == Exclusion::kNone);
  CHECK(d.cost_of(f.id("summary")).loss_s == Approx(0.1 * 100 * 0.01));
  // A chain already below the floor: only lossless media.
  TransferShape degraded = summarisable_context();
  degraded.chain_fidelity = 0.5;
  CHECK(f.engine.predict(r, degraded).value().cost_of(f.id("summary")).excluded == Exclusion::kPrecisionRefresh);
  // Chosen, it multiplies the chain's fidelity like any lossy hop.
  const Decision chosen = f.engine.decide(r, summarisable_context()).value();
  REQUIRE(chosen.chosen == f.id("summary"));
  CHECK(chosen.chain_fidelity_after == Approx(0.8));
}

TEST_CASE("the policy's summary budget and calibration reach the engine, and a reload keeps the samples",
          "[decision][summary]") {
  Policy policy;
  policy.node_id = "n";
  AgentPolicy a;
  a.id = "a";
  a.model = ModelFingerprint{"llama", 5, 4, 8, DType::kFloat32, "a"};
  AgentPolicy b = a;
  b.id = "b";
  b.model.weights_identity = "b";
  policy.agents = {a, b};
  RoutePolicy route = summary_test_route("a-to-b", 32);
  route.from_agent = "a";
  route.to_agent = "b";
  policy.routes = {route};
  policy.cost_model.media.emplace_back("summary", MediumCostModel{0.7, 0.05});
  auto engine = engine_from_policy(policy, LinkPriors{}).value();
  const RouteId r = engine.find_route("a-to-b").value();
  const MediumId summary = engine.find_medium("summary").value();
  CHECK(engine.medium(summary).profile.fidelity == Approx(0.7));
  CHECK(engine.summariser_seconds(r) == Approx(0.02 * 32));  // the default decode prior

  engine.observe_summary(r, 1.5);
  policy.routes[0].summary.max_tokens = 128;
  REQUIRE(apply_policy_settings(engine, policy));
  CHECK(engine.summariser_seconds(r) == Approx(1.5));
  const auto d = engine.predict(r, summarisable_context()).value();
  CHECK(d.cost_of(summary).wire_bytes == Approx(128 * 4.0));
  const auto logged = decision_to_json(d, engine);
  bool listed = false;
  for (const auto& candidate : logged["candidates"]) {
    if (candidate["medium"] == "summary") listed = true;
  }
  CHECK(listed);
}
