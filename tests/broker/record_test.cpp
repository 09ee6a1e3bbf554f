// The record stage: the decision record, the lookup metrics and the engine's feedback.

#include "record.h"

#include <catch2/catch.hpp>

#include "kvrelay/decision/engine_from_policy.h"

#include "stage_fixture.h"

using namespace kvrelay;
using namespace kvrelay::broker;
using namespace kvrelay::broker::stage_testing;

TEST_CASE("record: a plan and its outcome reach the decision log and the metrics", "[broker][record]") {
  metrics::Registry registry;
  KvPathMetrics metrics(registry);
  DecisionLog log(4);
  LookupPlan plan;
  plan.choice = {"kv_int8", "engine", "cheapest", nlohmann::json{{"chosen", "kv_int8"}}, false, std::nullopt};
  nlohmann::json record{{"kind", "lookup"}};
  record_plan(record, plan, 2e-6, metrics);
  finish_lookup(std::move(record), "hit_local", 32, 1.5, metrics, log);
  const auto recent = log.recent(1);
  REQUIRE(recent.size() == 1);
  CHECK(recent[0]["medium"] == "kv_int8");
  CHECK(recent[0]["source"] == "engine");
  CHECK(recent[0]["outcome"] == "hit_local");
  CHECK(recent[0]["served_tokens"] == 32);
  CHECK(recent[0]["cost"]["chosen"] == "kv_int8");
  CHECK_FALSE(recent[0].contains("held_prefix_served"));
  CHECK_FALSE(recent[0].contains("precision_refresh"));
  CHECK_FALSE(recent[0].contains("chain_product"));  // no route, no floor
  CHECK(metrics.lookups.with({"hit_local"}).value() == 1.0);
  CHECK(metrics.decisions.with({"kv_int8", "engine"}).value() == 1.0);
  CHECK(metrics.decision_seconds.get().count() == 1);
}

TEST_CASE("record: a fetch is counted by transport", "[broker][record]") {
  metrics::Registry registry;
  KvPathMetrics metrics(registry);
  FetchedKv fetched;
  fetched.transport = "shm";
  fetched.frame_bytes = 100;
  fetched.raw_bytes = 400;
  fetched.seconds = 0.01;
  record_fetched(metrics, fetched, "kv_int8", "int8", "plan-code");
  CHECK(metrics.wire_bytes.with({"fetched_shm", "kv_int8", "int8"}).value() == 100.0);
  CHECK(metrics.raw_bytes.with({"fetched_shm", "kv_int8"}).value() == 400.0);
  CHECK(metrics.fetch_seconds.with({"plan-code"}).count() == 1);
  CHECK(metrics.wire_bytes.with({"fetched", "kv_int8", "int8"}).value() == 0.0);
}

TEST_CASE("record: fetches feed the engine's link estimate", "[broker][record]") {
  auto engine = decision::engine_from_policy(parsed_policy(), decision::LinkPriors{});
  REQUIRE(engine);
  const auto found = engine.value().find_link("peer:node-b");
  REQUIRE(found);
  const auto link = found.value();
  const double before = engine.value().link_bytes_per_s(link);
  for (int i = 0; i < 8; ++i)
    feed_link(engine.value(), "node-b", 1e9, 0.01);  // 100 GB/s: far above any prior
  CHECK(engine.value().link_bytes_per_s(link) > before);
  feed_link(engine.value(), "no-such-peer", 1e9, 0.01);  // ignored
  // Raw KV has no codec cost; a lossy codec's sample is taken.
  feed_codec(engine.value(), {"raw", DType::kFloat32, 1000, 1000, 0.001, 0.001});
  feed_codec(engine.value(), {"int8", DType::kFloat32, 1000, 260, 0.001, std::nullopt});
  CHECK(fidelity_json(Fidelity::exact()) == "exact");
  CHECK(fidelity_json(Fidelity::lossy("int4", 16))["exact_tokens"] == 16);
}

TEST_CASE("record: a precision refresh is logged with its product, factor and floor, and counted",
          "[broker][record][precision]") {
  metrics::Registry registry;
  KvPathMetrics metrics(registry);
  DecisionLog log(4);
  const Policy policy = parsed_policy(R"(, "quality_floor": 0.75)");
  LookupPlan plan;
  plan.route = &policy.routes[0];
  plan.chain_product = 0.81;
  plan.choice.medium = "kv_raw";
  plan.choice.source = "refresh";
  plan.choice.refresh = PrecisionRefresh{ChainHop{0.81, 0.9, 0.75}, "kv_int8", RefreshForced::kLossless, true};
  nlohmann::json record{{"kind", "lookup"}};
  record_plan(record, plan, 1e-6, metrics);
  finish_lookup(std::move(record), "hit_local", 32, 1.0, metrics, log);
  const auto logged = log.recent(1).at(0);
  CHECK(logged["source"] == "refresh");
  CHECK(logged["chain_product"] == 0.81);
  const auto& refresh = logged["precision_refresh"];
  CHECK(refresh["chain_product"] == 0.81);
  CHECK(refresh["factor"] == 0.9);
  CHECK(refresh["floor"] == 0.75);
  CHECK(refresh["replaced"] == "kv_int8");
  CHECK(refresh["forced"] == "lossless");
  CHECK(refresh["exact_source"] == true);
  CHECK(metrics.precision_refreshes.with({"plan-code", "lossless"}).value() == 1.0);

  // Without an exact source: tokens, counted apart.
  plan.choice.medium = "tokens";
  plan.choice.refresh->forced = RefreshForced::kTokens;
  plan.choice.refresh->exact_source = false;
  nlohmann::json second{{"kind", "lookup"}};
  record_plan(second, plan, 1e-6, metrics);
  CHECK(second["precision_refresh"]["forced"] == "tokens");
  CHECK(second["precision_refresh"]["exact_source"] == false);
  CHECK(metrics.precision_refreshes.with({"plan-code", "tokens"}).value() == 1.0);
  CHECK(metrics.precision_refreshes.with({"plan-code", "lossless"}).value() == 1.0);
}

TEST_CASE("record: a stamped product reaches the fidelity record", "[broker][record][precision]") {
  CHECK_FALSE(fidelity_json(Fidelity::lossy("int8")).contains("product"));  // unstamped: 1
  CHECK(fidelity_json(Fidelity::lossy("int8", 0, 0.81))["product"] == 0.81);
}
