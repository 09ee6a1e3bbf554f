// Issue #28, live calibration: audited outcomes that measure a medium slower than the engine
// predicts raise that medium's correction on the route, a bounded step per window, until the
// engine's choice moves. The engine's own estimates are left as they were: only the audit
// sees the planted effect here.

#include "kvrelay/broker/live_calibration.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kvrelay/decision/engine_from_policy.h"

#include "decision/policy_fixture.h"

using namespace kvrelay;
using namespace kvrelay::broker;

namespace {

Policy calibrated_review_policy() {
  auto document = nlohmann::json::parse(decision::testing::two_node_policy());
  for (auto& route : document["routes"]) {
    if (route["id"] == "plan-review") {
      route["allowed_media"] = {"tokens", "kv_raw"};
      route["audit"] = {
          {"fraction", 0.5}, {"calibrate", "live"}, {"calibrate_window", 8}, {"calibrate_max_step_s", 0.25}};
    }
  }
  auto policy = parse_policy(document.dump(), "test.json");
  REQUIRE(policy);
  return std::move(policy).value();
}

// One audited outcome: `medium` delivered, measured `residual_s` over what the engine predicted.
AuditedOutcome audited_outcome(const std::string& medium, double residual_s) {
  const double predicted = medium == "tokens" ? 0.5 : 0.1;
  return AuditedOutcome{medium,
                        medium == "tokens" ? KvSpan::kNone : KvSpan::kAll,
                        predicted + residual_s,
                        {{"tokens", 0.5}, {"kv_raw", 0.1}}};
}

}  // namespace

TEST_CASE("live calibration refits a medium's correction from a window, a bounded step at a time",
          "[broker][calibration]") {
  const Policy policy = calibrated_review_policy();
  const RoutePolicy& route = *policy.find_route("plan-review");
  REQUIRE(route.audit.calibrate_live);
  LiveCalibration calibration;
  double correction = 0.0;
  const auto current = [&](const std::string& medium) { return medium == "kv_raw" ? correction : 0.0; };
  // kv_raw's handoffs take 0.6 s more than predicted; tokens 0.02 s (overheads both share).
  std::optional<Refit> refit;
  for (int i = 0; i < 8; ++i) {
    const auto filed = calibration.observe(
        route, audited_outcome(i % 2 == 0 ? "tokens" : "kv_raw", i % 2 == 0 ? 0.02 : 0.62), current);
    if (i < 7) CHECK_FALSE(filed);
    refit = filed;
  }
  REQUIRE(refit);
  REQUIRE(refit->media.size() == 1);
  CHECK(refit->trials == 8);
  CHECK(refit->media[0].medium == "kv_raw");
  CHECK(refit->media[0].target_s == Approx(0.6));
  CHECK(refit->media[0].after_s == Approx(0.25));  // the step bound
  CHECK(refit->media[0].bounded);
  correction = refit->media[0].after_s;
  for (int window = 0; window < 2; ++window) {
    for (int i = 0; i < 8; ++i)
      refit = calibration.observe(route, audited_outcome(i % 2 == 0 ? "tokens" : "kv_raw", i % 2 == 0 ? 0.02 : 0.62),
                                  current);
    REQUIRE(refit);
    correction = refit->media[0].after_s;
  }
  CHECK(correction == Approx(0.6));  // 0.25, 0.5, then the target
  CHECK_FALSE(refit->media[0].bounded);
  const auto snapshot = calibration.snapshot();
  CHECK(snapshot["refits"].size() == 3);
  CHECK(snapshot["refits"][2]["media"][0]["after_s"].get<double>() == Approx(0.6));
  CHECK(snapshot["pending"]["plan-review"] == 0);

  // Partial spans are counted but not fitted; a window without two tokens samples refits nothing.
  for (int i = 0; i < 8; ++i) {
    auto partial = audited_outcome("kv_raw", 5.0);
    partial.span = KvSpan::kPrompt;
    refit = calibration.observe(route, partial, current);
  }
  CHECK_FALSE(refit);
}

TEST_CASE("an audit correction moves the engine's choice on its route only", "[broker][calibration]") {
  const Policy policy = calibrated_review_policy();
  auto built = decision::engine_from_policy(policy, decision::LinkPriors{});
  REQUIRE(built);
  decision::DecisionEngine& engine = built.value();
  const auto route = engine.find_route("plan-review").value();
  const auto kv_raw = engine.find_medium("kv_raw").value();
  decision::TransferShape shape;
  shape.tokens = 4096;
  const auto before = engine.predict(route, shape);
  REQUIRE(before);
  REQUIRE(before.value().argmin == kv_raw);  // a long context: KV pays on the engine's priors
  const double margin =
      before.value().cost_of(decision::kTokensMedium).total_s - before.value().cost_of(kv_raw).total_s;
  REQUIRE(margin > 0.0);
  engine.set_audit_correction(route, kv_raw, margin * 1.5);
  const auto after = engine.predict(route, shape);
  REQUIRE(after);
  CHECK(after.value().argmin == decision::kTokensMedium);
  CHECK(after.value().cost_of(kv_raw).audit_s == Approx(margin * 1.5));
  CHECK(engine.audit_correction(route, kv_raw) == Approx(margin * 1.5));
  const auto other = engine.find_route("plan-code").value();
  CHECK(engine.audit_correction(other, kv_raw) == 0.0);
}
