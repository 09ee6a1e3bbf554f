#include "kvrelay/decision/engine_from_policy.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "policy_fixture.h"

using namespace kvrelay::decision;

TEST_CASE("engine_from_policy builds agents, one link per peer node, and every route") {
  const auto policy = kvrelay::parse_policy(testing::two_node_policy(), "test.json");
  REQUIRE(policy);
  LinkPriors priors;
  priors.shm_bytes_per_s = 8e9;
  priors.tcp_bytes_per_s = 1e9;
  auto built = engine_from_policy(policy.value(), priors);
  REQUIRE(built);
  DecisionEngine& engine = built.value();
  CHECK(engine.route_count() == 4);
  CHECK(engine.link_bytes_per_s(engine.find_link("local").value()) == 8e9);
  CHECK(engine.link_bytes_per_s(engine.find_link("peer:node-b").value()) == 1e9);
  CHECK(engine.link_bytes_per_s(engine.find_link("peer:node-c").value()) == 8e9);  // same host: shm

  // KV size per token comes from the fingerprint: 32 layers * 2 * 8 heads * 128 dim * 2 bytes.
  const RouteId plan_code = engine.find_route("plan-code").value();
  const Decision d = engine.predict(plan_code, TransferShape{1000, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(d.cost_of(engine.find_medium("kv_raw").value()).wire_bytes == Approx(1000.0 * 32 * 2 * 8 * 128 * 2));

  const Decision review =
      engine.predict(engine.find_route("plan-review").value(), TransferShape{1000, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(review.cost_of(engine.find_medium("kv_fp8").value()).excluded == Exclusion::kNotAllowed);

  const Decision sum =
      engine.predict(engine.find_route("plan-sum").value(), TransferShape{30000, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(sum.argmin == kTokensMedium);
  CHECK(sum.cost_of(engine.find_medium("kv_raw").value()).excluded == Exclusion::kFingerprintMismatch);
}

TEST_CASE("measure_copy_bandwidth returns a plausible host figure") {
  const double bandwidth = measure_copy_bandwidth(8U << 20);
  CHECK(bandwidth > 1e8);   // any machine copies faster than 100 MB/s
  CHECK(bandwidth < 1e12);  // and slower than 1 TB/s
}

TEST_CASE("engine_from_policy applies the policy's calibrated cost model") {
  auto document = nlohmann::json::parse(testing::two_node_policy());
  document["cost_model"] = nlohmann::json::parse(R"({
      "agents": {"coder": {"prefill_s": {"a": 0.5, "b": 0.001, "c": 0}, "decode_s_per_token": 0.04}},
      "media": {"kv_int8": {"fidelity": 0.9, "extra_decode_fraction": 0.25}}})");
  const auto policy = kvrelay::parse_policy(document.dump(), "test.json");
  REQUIRE(policy);
  auto built = engine_from_policy(policy.value(), LinkPriors{});
  REQUIRE(built);
  DecisionEngine& engine = built.value();
  const auto coder = engine.prefill_coefficients(engine.find_agent("coder").value());
  CHECK(coder.a == 0.5);
  CHECK(coder.b == 0.001);
  CHECK(coder.c == 0.0);
  const auto planner = engine.prefill_coefficients(engine.find_agent("planner").value());
  CHECK(planner.a == AgentParams{}.prefill_prior.a);  // not calibrated: the prior stays
  const MediumId int8 = engine.find_medium("kv_int8").value();
  CHECK(engine.medium(int8).profile.fidelity == 0.9);
  CHECK(engine.medium(int8).profile.extra_decode_fraction == 0.25);
  CHECK(engine.media_count() == std::size(kvrelay::kBuiltinMedia));
  // The calibrated prefill and decode enter the prediction: tokens costs a + b n for 1000 tokens,
  // int8's quality loss costs 0.25 * 100 output tokens * 0.04 s.
  const Decision d =
      engine.predict(engine.find_route("plan-code").value(), TransferShape{1000, 0, 1.0, 0.0, 100, {}}).value();
  CHECK(d.cost_of(kTokensMedium).comp_s == Approx(0.5 + 0.001 * 1000));
  CHECK(d.cost_of(int8).loss_s == Approx(0.25 * 100 * 0.04));
}
