// A policy reload reaches a running engine: live settings through apply_policy_settings with
// every learned estimate kept, topology changes through a rebuild (engine_topology differs).
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kvrelay/decision/engine_from_policy.h"

#include "policy_fixture.h"

using namespace kvrelay::decision;
using nlohmann::json;

namespace {

kvrelay::Policy parsed(const json& document) {
  auto policy = kvrelay::parse_policy(document.dump(), "test.json");
  INFO((policy ? std::string() : policy.error().message));
  REQUIRE(policy);
  return std::move(policy).value();
}

json base_document() {
  return json::parse(testing::two_node_policy());
}

// What the engine has learned on plan-code (planner -> coder, local) and the link to node-b.
void teach(DecisionEngine& engine) {
  const AgentId coder = engine.find_agent("coder").value();
  for (int i = 0; i < 16; ++i) {
    const auto tokens = static_cast<std::uint64_t>(100 + 50 * i);
    engine.observe_prefill(coder, tokens, 0, 0.002 + 1e-6 * static_cast<double>(tokens));
  }
  engine.observe_link(engine.find_link("peer:node-b").value(), 4e8, 1.0);
  const MediumId int8 = engine.find_medium("kv_int8").value();
  for (int i = 0; i < 32; ++i)
    engine.observe_codec(int8, kvrelay::DType::kFloat16, 1e6, 0.4e6, 1e-4, 1e-4);
  engine.observe_load(coder, 2.0);
}

}  // namespace

TEST_CASE("a reload applies the cost model and route settings to a kept engine, keeping what it learned",
          "[decision][reload]") {
  json document = base_document();
  const kvrelay::Policy before = parsed(document);
  auto built = engine_from_policy(before, LinkPriors{});
  REQUIRE(built);
  DecisionEngine& engine = built.value();
  teach(engine);
  const AgentId coder = engine.find_agent("coder").value();
  const MediumId int8 = engine.find_medium("kv_int8").value();
  const MediumId sparse = engine.find_medium("kv_sparse").value();
  const RouteId plan_code = engine.find_route("plan-code").value();
  const TransferShape shape{4000, 0, 1.0, 0.0, 100, {}};
  const PrefillCoefficients learned_prefill = engine.prefill_coefficients(coder);
  const double learned_link = engine.link_bytes_per_s(engine.find_link("peer:node-b").value());
  const Decision old = engine.predict(plan_code, shape).value();
  CHECK(old.cost_of(int8).excluded == Exclusion::kNone);
  CHECK(old.cost_of(sparse).excluded == Exclusion::kSparseUnsupported);
  CHECK_FALSE(old.deadline_miss);

  document["cost_model"] = json::parse(R"({"media": {"kv_int8": {"fidelity": 0.8, "extra_decode_fraction": 0.5}},
                                           "agents": {"coder": {"decode_s_per_token": 0.05}}})");
  document["routes"][0]["quality_floor"] = 0.85;
  document["routes"][0]["deadline_ms"] = 1;
  document["routes"][0]["hysteresis"] = 2.0;
  document["agents"][1]["accepts_sparse_kv"] = true;
  const kvrelay::Policy after = parsed(document);
  REQUIRE(engine_topology(after) == engine_topology(before));
  REQUIRE(apply_policy_settings(engine, after));

  const Decision now = engine.predict(plan_code, shape).value();
  // cost_model: int8's quality loss is priced at the new fraction and decode time, its
  // fidelity now sits below the route's new floor.
  CHECK(now.cost_of(int8).loss_s == Approx(0.5 * 100 * 0.05));
  CHECK(old.cost_of(int8).loss_s == Approx(0.01 * 100 * 0.02));
  CHECK(now.cost_of(int8).excluded == Exclusion::kBelowQualityFloor);
  CHECK(now.cost_of(sparse).excluded != Exclusion::kSparseUnsupported);  // accepts_sparse_kv
  CHECK(engine.decide(plan_code, shape).value().deadline_miss);          // deadline_ms
  // Learned: the prefill fit, the link throughput, the codec ratio and the receiver's load.
  CHECK(engine.prefill_coefficients(coder).a == learned_prefill.a);
  CHECK(engine.prefill_coefficients(coder).b == learned_prefill.b);
  CHECK(engine.link_bytes_per_s(engine.find_link("peer:node-b").value()) == learned_link);
  CHECK(now.cost_of(int8).wire_bytes == old.cost_of(int8).wire_bytes);
  CHECK(now.cost_of(kTokensMedium).comp_s == old.cost_of(kTokensMedium).comp_s);

  // An entry removed from the cost model restores the catalogue's default.
  document.erase("cost_model");
  REQUIRE(apply_policy_settings(engine, parsed(document)));
  CHECK(engine.medium(int8).profile.fidelity == find_builtin_medium("kv_int8")->profile.fidelity);
  CHECK(engine.predict(plan_code, shape).value().cost_of(int8).loss_s == Approx(0.01 * 100 * 0.02));
}

TEST_CASE("a calibrated prefill prior reaches a kept engine before its fit has samples", "[decision][reload]") {
  json document = base_document();
  auto built = engine_from_policy(parsed(document), LinkPriors{});
  REQUIRE(built);
  DecisionEngine& engine = built.value();
  document["cost_model"] = json::parse(R"({"agents": {"coder": {"prefill_s": {"a": 0.5, "b": 0.001, "c": 0}}}})");
  REQUIRE(apply_policy_settings(engine, parsed(document)));
  const auto coefficients = engine.prefill_coefficients(engine.find_agent("coder").value());
  CHECK(coefficients.a == 0.5);
  CHECK(coefficients.b == 0.001);
  CHECK(coefficients.c == 0.0);
}

TEST_CASE("hysteresis set by a reload holds a kept route's previous choice", "[decision][reload]") {
  json document = base_document();
  auto built = engine_from_policy(parsed(document), LinkPriors{});
  REQUIRE(built);
  DecisionEngine& engine = built.value();
  const RouteId route = engine.find_route("plan-code").value();
  const TransferShape shape{4000, 0, 1.0, 10.0, 0, {}};
  const Decision first = engine.decide(route, shape).value();
  // A link measured at 1 MB/s makes tokens the argmin by a wide margin.
  const LinkId local = engine.find_link("local").value();
  for (int i = 0; i < 32; ++i)
    engine.observe_link(local, 1e6, 1.0);
  const Decision probe = engine.predict(route, shape).value();
  REQUIRE(probe.argmin != first.chosen);
  document["routes"][0]["hysteresis"] = 10.0;  // no gain is worth a switch
  REQUIRE(apply_policy_settings(engine, parsed(document)));
  const Decision held = engine.decide(route, TransferShape{4000, 0, 1.0, 20.0, 0, {}}).value();
  CHECK(held.chosen == first.chosen);
  CHECK(held.reason == DecisionReason::kHysteresisHeld);
}

TEST_CASE("agents, routes, peers and plugin media make the topology, settings and forced media do not",
          "[decision][reload]") {
  const json document = base_document();
  const std::string base = engine_topology(parsed(document));
  const auto changed = [&](auto edit) {
    json copy = document;
    edit(copy);
    return engine_topology(engine_view(parsed(copy))) != base;
  };
  CHECK(changed([](json& d) { d["agents"][1]["model"]["weights"] = "other"; }));
  CHECK(changed([](json& d) { d["agents"][2]["node"] = "node-c"; }));
  CHECK(changed([](json& d) { d["routes"].push_back({{"id", "code-plan"}, {"from", "coder"}, {"to", "planner"}}); }));
  CHECK(changed([](json& d) { d["peers"][0]["same_host"] = true; }));
  CHECK(changed([](json& d) { d["routes"][0]["allowed_media"] = {"kv_raw", "codec:xor"}; }));
  CHECK_FALSE(changed([](json& d) { d["routes"][0]["allowed_media"] = {"kv_raw", "kv_int8"}; }));
  CHECK_FALSE(changed([](json& d) { d["routes"][0]["hysteresis"] = 0.4; }));
  CHECK_FALSE(changed([](json& d) { d["routes"][0]["forced_medium"] = "codec:xor"; }));
  CHECK_FALSE(changed([](json& d) { d["routes"][0]["enabled"] = false; }));
  CHECK_FALSE(changed([](json& d) { d["cost_model"] = {{"media", {{"kv_int4", {{"fidelity", 0.5}}}}}}; }));
  CHECK_FALSE(changed([](json& d) { d["agents"][0]["upstream"] = "http://127.0.0.1:9999"; }));
}

TEST_CASE("live updates refuse what needs a rebuild", "[decision][reload]") {
  auto built = engine_from_policy(parsed(base_document()), LinkPriors{});
  REQUIRE(built);
  DecisionEngine& engine = built.value();
  AgentParams other_model = engine.agent(engine.find_agent("coder").value());
  other_model.fingerprint_id += 1;
  CHECK(engine.update_agent(other_model).error().code == kvrelay::ErrorCode::kUnsupported);
  kvrelay::RoutePolicy rerouted;
  rerouted.id = "plan-code";
  rerouted.from_agent = "planner";
  rerouted.to_agent = "reviewer";
  CHECK(engine.update_route(rerouted).error().code == kvrelay::ErrorCode::kUnsupported);
  kvrelay::RoutePolicy unknown_medium;
  unknown_medium.id = "plan-code";
  unknown_medium.from_agent = "planner";
  unknown_medium.to_agent = "coder";
  unknown_medium.allowed_media = {"codec:never-registered"};
  CHECK_FALSE(engine.update_route(unknown_medium));
  // The refused update left the route as it was: every medium still allowed.
  const Decision d =
      engine.predict(engine.find_route("plan-code").value(), TransferShape{1000, 0, 1.0, 0.0, 0, {}}).value();
  CHECK(d.cost_of(engine.find_medium("kv_int8").value()).excluded == Exclusion::kNone);
}
