// kv_transfer_params.kvrelay: what the front proxy writes is what the KV path reads.

#include "kvrelay/broker/request_context.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

using namespace kvrelay;
using namespace kvrelay::broker;

TEST_CASE("request context: written by the front proxy, read back by the KV path", "[broker][context]") {
  RequestContext context;
  context.request_id = "r-1";
  context.agent = "coder";
  context.node = "node-a";
  context.routes = {"plan-code"};
  context.treatment = Treatment{"T1", "kv_int8", KvSpan::kPrompt, 48};
  context.max_tokens = 64;
  const auto parsed = parse_request_context(request_context_json(context).dump());
  REQUIRE(parsed);
  CHECK(parsed.value().request_id == "r-1");
  CHECK(parsed.value().node == "node-a");
  CHECK(parsed.value().routes == context.routes);
  CHECK(parsed.value().treatment == context.treatment);
  CHECK(parsed.value().max_tokens == 64U);
  CHECK(parsed.value().next_agents.empty());
}

TEST_CASE("request context: next_agents, a hint of at most 16 agent ids", "[broker][context]") {
  RequestContext context;
  context.agent = "planner";
  context.next_agents = {"coder", "reviewer"};
  const auto parsed = parse_request_context(request_context_json(context).dump());
  REQUIRE(parsed);
  CHECK(parsed.value().next_agents == context.next_agents);
  CHECK(parse_request_context(R"({"next_agents": "coder"})").error().message.find("next_agents") != std::string::npos);
  CHECK(parse_request_context(R"({"next_agents": ["coder", 7]})").error().message.find("next_agents[]") !=
        std::string::npos);
  nlohmann::json many = nlohmann::json::array();
  for (int index = 0; index < 40; ++index)
    many.push_back("agent-" + std::to_string(index));
  const auto capped = parse_request_context(nlohmann::json{{"next_agents", many}}.dump());
  REQUIRE(capped);
  CHECK(capped.value().next_agents.size() == 16);
}

TEST_CASE("request context: fields are type-checked and a bare treatment keeps the route's medium",
          "[broker][context]") {
  CHECK(parse_request_context("").value().agent.empty());
  CHECK(parse_request_context("null").has_value());
  CHECK_FALSE(parse_request_context("{"));
  CHECK(parse_request_context(R"({"agent": 3})").error().message.find("agent") != std::string::npos);
  CHECK_FALSE(parse_request_context(R"({"treatment": {"span": "half"}})"));
  CHECK_FALSE(parse_request_context(R"({"treatment": {"medium": "carrier-pigeon"}})"));
  CHECK_FALSE(parse_request_context(R"({"max_tokens": -1})"));
  const auto bare = parse_request_context(R"({"treatment": {"name": "T3"}})");
  REQUIRE(bare);
  CHECK(bare.value().treatment->medium.empty());
  CHECK(bare.value().treatment->span == KvSpan::kAll);
  CHECK_FALSE(bare.value().treatment->decides_medium());
  const auto none = parse_request_context(R"({"treatment": {"name": "T0", "span": "none"}})");
  CHECK(none.value().treatment->decides_medium());
  CHECK(none.value().treatment->delivered_medium() == "tokens");
}

TEST_CASE("treatment spans have one name each", "[broker][context]") {
  for (const auto span : {KvSpan::kNone, KvSpan::kPrompt, KvSpan::kGenerated, KvSpan::kAll}) {
    CHECK(parse_span(span_name(span)) == span);
  }
  CHECK_FALSE(parse_span(""));
}

TEST_CASE("request context: the summary the front proxy put in place of A's context round-trips",
          "[broker][context][summary]") {
  RequestContext context;
  context.agent = "reviewer";
  context.treatment = Treatment{"S", "summary", KvSpan::kAll, std::nullopt};
  context.summary = SummaryApplied{144, 48, std::nullopt, "treatment"};
  const auto written = request_context_json(context);
  CHECK(written["summary"] == nlohmann::json{{"span_tokens", 144}, {"summary_tokens", 48}, {"source", "treatment"}});
  const auto parsed = parse_request_context(written.dump());
  REQUIRE(parsed);
  CHECK(parsed.value().summary == context.summary);
  CHECK(parsed.value().treatment == context.treatment);

  context.summary = SummaryApplied{30, 12, 120, "forced"};  // a text prompt: its characters too
  const auto text = parse_request_context(request_context_json(context).dump());
  REQUIRE(text);
  CHECK(text.value().summary == context.summary);
  CHECK_FALSE(parse_request_context("{}").value().summary);

  CHECK(parse_request_context(R"({"summary": 3})").error().message.find("summary") != std::string::npos);
  CHECK(parse_request_context(R"({"summary": {"span_tokens": 4}})").error().message.find("summary.summary_tokens") !=
        std::string::npos);
  CHECK(parse_request_context(R"({"summary": {"span_tokens": -4, "summary_tokens": 1}})")
            .error()
            .message.find("summary.span_tokens") != std::string::npos);
  CHECK_FALSE(parse_request_context(R"({"summary": {"span_tokens": 4, "summary_tokens": 1, "span_chars": "x"}})"));
}
