// routes[].summary and the summary medium in a policy (issue #28, docs/summary.md).

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <string>

#include "kvrelay/core/policy.h"

using kvrelay::parse_policy;
using nlohmann::json;

namespace {

json summary_policy() {
  return json::parse(R"({
    "schema_version": 1,
    "node": {"id": "node-a"},
    "listen": {"http": "127.0.0.1:0"},
    "agents": [
      {"id": "a", "upstream": "http://127.0.0.1:9000",
       "model": {"architecture": "llama", "layers": 5, "kv_heads": 4, "head_dim": 8, "dtype": "fp32", "weights": "w"}},
      {"id": "b", "upstream": "http://127.0.0.1:9001",
       "model": {"architecture": "llama", "layers": 2, "kv_heads": 2, "head_dim": 16, "dtype": "fp32", "weights": "v"}}
    ],
    "routes": [
      {"id": "r0", "from": "a", "to": "b"},
      {"id": "r1", "from": "a", "to": "b", "allowed_media": ["tokens", "summary"]},
      {"id": "r2", "from": "a", "to": "b", "forced_medium": "summary"}
    ]
  })");
}

std::string summary_rejection(const json& document) {
  const auto result = parse_policy(document.dump(), "config/x.json");
  REQUIRE_FALSE(result);
  return result.error().message;
}

}  // namespace

TEST_CASE("a route's summary settings: defaults, values, and summary only where a route names it",
          "[core][policy][summary]") {
  auto document = summary_policy();
  document["routes"][1]["summary"] = json::parse(R"({"summariser": "http://127.0.0.1:8100/base/", "max_tokens": 128,
      "template": "Earlier: {summary}\n", "instruction": "", "model": "summariser-7b", "timeout_ms": 2500})");
  const auto parsed = parse_policy(document.dump(), "config/x.json");
  if (!parsed) FAIL(parsed.error().message);
  const auto& policy = parsed.value();

  const auto& defaults = policy.routes[0].summary;
  CHECK_FALSE(defaults.summariser);  // the from-agent's own upstream
  CHECK(defaults.max_tokens == 64);
  CHECK(defaults.prompt_template == "Summary of the earlier context: {summary}\n\n");
  CHECK(defaults.model.empty());
  CHECK(defaults.timeout == std::chrono::milliseconds(30'000));

  const auto& set = policy.routes[1].summary;
  REQUIRE(set.summariser);
  CHECK(set.summariser->host == "127.0.0.1");
  CHECK(set.summariser->port == 8100);
  CHECK(set.summariser->base_path == "/base");
  CHECK(set.max_tokens == 128);
  CHECK(set.prompt_template == "Earlier: {summary}\n");
  CHECK(set.instruction.empty());
  CHECK(set.model == "summariser-7b");
  CHECK(set.timeout == std::chrono::milliseconds(2500));

  // Every medium (no allowed_media) is every way to move the context: not a summary of it.
  CHECK_FALSE(kvrelay::route_allows_summary(policy.routes[0]));
  CHECK(kvrelay::route_allows_summary(policy.routes[1]));
  CHECK(kvrelay::route_allows_summary(policy.routes[2]));
  CHECK(kvrelay::is_known_medium("summary"));
}

TEST_CASE("bad summary settings are rejected with their JSON pointers", "[core][policy][summary]") {
  auto document = summary_policy();
  document["routes"][1]["summary"] = json::parse(R"({"summariser": "ftp://host", "max_tokens": 0,
      "template": "no placeholder", "timeout_ms": 0, "colour": "blue"})");
  document["routes"][2]["summary"] = json::parse(R"({"max_tokens": 100000, "model": 7})");
  document["routes"][0]["summary"] = "short";
  const auto message = summary_rejection(document);
  using Catch::Contains;
  CHECK_THAT(message, Contains("config/x.json: /routes/1/summary/summariser: expected http://host[:port][/path] URL"));
  CHECK_THAT(message, Contains("/routes/1/summary/max_tokens: expected integer 1..8192, got 0"));
  CHECK_THAT(message,
             Contains("/routes/1/summary/template: expected text containing {summary}, got \"no placeholder\""));
  CHECK_THAT(message, Contains("/routes/1/summary/timeout_ms: expected"));
  CHECK_THAT(message, Contains("/routes/1/summary/colour: unknown key"));
  CHECK_THAT(message, Contains("/routes/2/summary/max_tokens: expected integer 1..8192, got 100000"));
  CHECK_THAT(message, Contains("/routes/2/summary/model: expected"));
  CHECK_THAT(message, Contains("/routes/0/summary: expected"));
}

TEST_CASE("a summary treatment replaces all of A's context, and summary is no spill medium",
          "[core][policy][summary]") {
  auto document = summary_policy();
  document["routes"][0]["audit"] = json::parse(R"({"fraction": 1,
      "treatments": [{"name": "T0", "medium": "tokens", "span": "none"},
                     {"name": "S", "medium": "summary", "span": "all"}]})");
  const auto parsed = parse_policy(document.dump(), "config/x.json");
  if (!parsed) FAIL(parsed.error().message);
  REQUIRE(parsed.value().routes[0].audit.treatments.size() == 2);
  CHECK(parsed.value().routes[0].audit.treatments[1].medium == "summary");

  document["routes"][0]["audit"]["treatments"][1]["span"] = "prompt";
  document["routes"][1]["audit"] =
      json::parse(R"({"fraction": 1, "treatments": [{"name": "S", "medium": "summary", "span": "none"}]})");
  document["kv_store"] = {{"spill_medium", "summary"}};
  const auto message = summary_rejection(document);
  using Catch::Contains;
  CHECK_THAT(message, Contains("/routes/0/audit/treatments/1/span: span \"prompt\" with medium summary"));
  CHECK_THAT(message, Contains("/routes/1/audit/treatments/0/span: span \"none\" with medium summary"));
  CHECK_THAT(message, Contains("/kv_store/spill_medium: expected a KV medium"));
  // A route that lists its media must list summary to be audited with it.
  document = summary_policy();
  document["routes"][1]["allowed_media"] = json::array({"tokens", "kv_raw"});
  document["routes"][1]["audit"] =
      json::parse(R"({"fraction": 1, "treatments": [{"name": "S", "medium": "summary", "span": "all"}]})");
  CHECK_THAT(
      summary_rejection(document),
      Contains("/routes/1/audit/treatments/0/medium: expected a medium listed in allowed_media, got \"summary\""));
}
