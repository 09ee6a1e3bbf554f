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
  plan.choice = {"kv_int8", "engine", "cheapest", nlohmann::json{{"chosen", "kv_int8"}}, false};
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
