// The plan stage and the summary medium (issue #28, docs/summary.md): a lookup never serves KV
// for a request the front proxy summarised, and a forced or drawn summary the proxy did not make
// becomes tokens; neither asks the engine to commit.

#include <catch2/catch.hpp>

#include "kvrelay/codec_plugins/registry.h"

#include "plan.h"
#include "stage_fixture.h"

using namespace kvrelay;
using namespace kvrelay::broker;
using namespace kvrelay::broker::stage_testing;

namespace {

struct SummaryPlanBench {
  explicit SummaryPlanBench(const std::string& route_extra) : policy(parsed_policy(route_extra)) {}
  std::uint64_t model_id() const { return policy.agents[0].model.id(); }
  LookupPlan plan(const shm::ResolveRequest& request) {
    auto parsed = parse_request_context(request.params_json);
    REQUIRE(parsed);
    context = parsed.value();
    PlanInputs inputs{policy, request, context, store, codecs, engine};
    return plan_lookup(inputs, servable_blocks(request, context));
  }
  Policy policy;
  FixedEngine engine{"kv_raw"};
  kv_store::InMemoryEntryStore store{1 << 20};
  codec::CodecRegistry codecs = codec::CodecRegistry::with_builtins();
  RequestContext context;
};

}  // namespace

TEST_CASE("plan: a summarised request is served no KV, even where A's KV is held", "[broker][plan][summary]") {
  SummaryPlanBench bench(R"(, "allowed_media": ["tokens", "kv_raw", "summary"])");
  REQUIRE(bench.store.put({bench.model_id(), chain_of(4)[2]}, tiny_entry(3 * kBlockTokens)));
  const auto plan = bench.plan(lookup_of(
      bench.model_id(), 4, 70,
      R"({"agent": "coder", "request_id": "r1", "summary": {"span_tokens": 48, "summary_tokens": 20, "source": "engine"}})"));
  REQUIRE(plan.stop);
  CHECK(plan.stop->outcome == "summary");
  CHECK(plan.choice.medium == "summary");
  CHECK(plan.choice.source == "engine");
  CHECK(plan.choice.cost.is_object());  // priced for the record, not decided
  CHECK(bench.engine.commits == 0);
  CHECK(bench.engine.last_shape.tokens == 48);
  CHECK(bench.engine.last_shape.summary_possible);
}

TEST_CASE("plan: a forced summary the front proxy did not make is tokens, and the engine cannot pick one late",
          "[broker][plan][summary]") {
  SummaryPlanBench forced(R"(, "forced_medium": "summary")");
  REQUIRE(forced.store.put({forced.model_id(), chain_of(4)[2]}, tiny_entry(3 * kBlockTokens)));
  const auto plan = forced.plan(lookup_of(forced.model_id(), 4, 70, R"({"agent": "coder", "request_id": "r1"})"));
  REQUIRE(plan.stop);
  CHECK(plan.stop->outcome == "tokens");
  CHECK(plan.choice.medium == "tokens");
  CHECK_THAT(plan.choice.reason, Catch::Contains("did not summarise"));
  CHECK_FALSE(forced.engine.last_shape.summary_possible);

  // A drawn summary treatment the proxy could not deliver is tokens as well.
  SummaryPlanBench drawn(R"(, "allowed_media": ["tokens", "kv_raw", "summary"])");
  const auto treated = drawn.plan(lookup_of(
      drawn.model_id(), 4, 70,
      R"({"agent": "coder", "request_id": "r2", "treatment": {"name": "S", "medium": "summary", "span": "all"}})"));
  REQUIRE(treated.stop);
  CHECK(treated.choice.medium == "tokens");
  CHECK(treated.choice.source == "treatment");
}
