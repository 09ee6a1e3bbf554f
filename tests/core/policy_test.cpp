#include "kvrelay/core/policy.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

#include "support/test_paths.h"

using kvrelay::parse_policy;
using nlohmann::json;

namespace {

json minimal_policy() {
  return json::parse(R"({
    "schema_version": 1,
    "node": {"id": "node-a"},
    "listen": {"http": "127.0.0.1:0"},
    "peers": [{"id": "node-b", "address": "127.0.0.1:7071"}],
    "agents": [
      {"id": "a", "upstream": "http://127.0.0.1:9000",
       "model": {"architecture": "llama", "layers": 5, "kv_heads": 4, "head_dim": 8, "dtype": "fp32", "weights": "w"}},
      {"id": "b", "upstream": "http://127.0.0.1:9001/v1/", "node": "node-b",
       "model": {"architecture": "llama", "layers": 5, "kv_heads": 4, "head_dim": 8, "dtype": "fp32", "weights": "w"}}
    ],
    "routes": [
      {"id": "r0", "from": "a", "to": "b"},
      {"id": "r1", "from": "b", "to": "a", "priority": 3},
      {"id": "r2", "from": "a", "to": "b", "priority": 1}
    ]
  })");
}

std::string rejection(const json& document) {
  const auto result = parse_policy(document.dump(), "config/x.json");
  REQUIRE_FALSE(result);
  return result.error().message;
}

}  // namespace

TEST_CASE("every example policy in config/ loads", "[core][policy]") {
  int examples = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kvrelay::test::source_dir() / "config")) {
    const auto name = entry.path().filename().string();
    if (entry.path().extension() != ".json" || name.find("schema") != std::string::npos) continue;
    INFO(name);
    const auto policy = kvrelay::load_policy_file(entry.path().string());
    if (!policy) FAIL(policy.error().message);
    CHECK_FALSE(policy.value().node_id.empty());
    ++examples;
  }
  CHECK(examples >= 3);
}

TEST_CASE("a valid policy is parsed into typed fields with defaults", "[core][policy]") {
  const auto result = parse_policy(minimal_policy().dump(), "mem.json");
  REQUIRE(result);
  const auto& policy = result.value();
  CHECK(policy.node_id == "node-a");
  CHECK(policy.listen.http.port == 0);
  CHECK_FALSE(policy.listen.admin.has_value());
  REQUIRE(policy.agents.size() == 2);
  CHECK(policy.agents[1].upstream.host == "127.0.0.1");
  CHECK(policy.agents[1].upstream.port == 9001);
  CHECK(policy.agents[1].upstream.base_path == "/v1");
  CHECK(policy.agents[0].model.layout(1).bytes_per_token().value() == 1280);
  REQUIRE(policy.find_route("r1") != nullptr);
  CHECK(policy.find_route("r1")->priority == 3);
  CHECK(policy.find_route("r0")->enabled);
  CHECK(policy.find_route("r0")->hysteresis_threshold == Approx(0.15));
  CHECK(policy.limits.max_body_bytes == 16ULL * 1024 * 1024);
  CHECK(policy.find_peer("node-b")->address.port == 7071);
}

TEST_CASE("wrong type is rejected with file, pointer and expectation", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][2]["priority"] = "high";
  CHECK(rejection(document) == R"(config/x.json: /routes/2/priority: expected integer 0..7, got "high")");
}

TEST_CASE("out-of-range values are rejected with their pointer", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][0]["audit_fraction"] = 1.5;
  document["agents"][0]["model"]["layers"] = 0;
  document["limits"] = {{"max_connections", -3}};
  const auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains("config/x.json: /routes/0/audit_fraction: expected number 0..1, got 1.5"));
  CHECK_THAT(message, Catch::Contains("/agents/0/model/layers: expected integer 1..1024, got 0"));
  CHECK_THAT(message, Catch::Contains("/limits/max_connections: expected integer 1..1048576, got -3"));
}

TEST_CASE("unknown keys are rejected, listing what is allowed", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][1]["colour"] = "blue";
  document["surprise"] = true;
  const auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains("config/x.json: /routes/1/colour: unknown key (allowed here:"));
  CHECK_THAT(message, Catch::Contains("config/x.json: /surprise: unknown key"));
}

TEST_CASE("missing required keys are named by pointer", "[core][policy]") {
  auto document = minimal_policy();
  document.erase("schema_version");
  document["agents"][0].erase("upstream");
  const auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains("/schema_version: required key is missing"));
  CHECK_THAT(message, Catch::Contains("/agents/0/upstream: required key is missing"));
}

TEST_CASE("dangling references are rejected", "[core][policy]") {
  SECTION("route names an unknown agent") {
    auto document = minimal_policy();
    document["routes"][1]["to"] = "ghost";
    CHECK(rejection(document) == R"(config/x.json: /routes/1/to: expected an agent id from /agents, got "ghost")");
  }
  SECTION("agent on an unknown node") {
    auto document = minimal_policy();
    document["agents"][1]["node"] = "node-z";
    CHECK_THAT(rejection(document), Catch::Contains("/agents/1/node: expected this node's id or a peer id"));
  }
  SECTION("duplicate ids") {
    auto document = minimal_policy();
    document["routes"][2]["id"] = "r0";
    CHECK_THAT(rejection(document), Catch::Contains(R"(/routes/2/id: duplicate id "r0")"));
  }
  SECTION("forced medium outside the allowed media") {
    auto document = minimal_policy();
    document["routes"][0]["allowed_media"] = {"tokens", "kv_raw"};
    document["routes"][0]["forced_medium"] = "kv_int4";
    CHECK_THAT(rejection(document),
               Catch::Contains("/routes/0/forced_medium: expected a medium listed in allowed_media"));
  }
}

TEST_CASE("media, addresses, URLs and the schema version are validated", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][0]["allowed_media"] = {"tokens", "carrier_pigeon"};
  document["listen"]["http"] = "127.0.0.1:99999";
  document["agents"][0]["upstream"] = "https://example";
  document["schema_version"] = 2;
  const auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains(R"(/routes/0/allowed_media/1: expected a medium)"));
  CHECK_THAT(message,
             Catch::Contains(R"(/listen/http: expected "host:port" with port 0..65535, got "127.0.0.1:99999")"));
  CHECK_THAT(message, Catch::Contains("/agents/0/upstream: expected http://host[:port][/path] URL"));
  CHECK_THAT(message, Catch::Contains("/schema_version: expected 1, got 2"));
}

TEST_CASE("plugin codec media are accepted by name", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][0]["allowed_media"] = {"tokens", "codec:my_codec"};
  document["routes"][0]["forced_medium"] = "codec:my_codec";
  CHECK(parse_policy(document.dump(), "x"));
}

TEST_CASE("malformed JSON reports line and column", "[core][policy]") {
  const auto result = parse_policy("{\n  \"schema_version\": 1,\n  \"node\": {\"id\": \"a\",}\n}", "config/bad.json");
  REQUIRE_FALSE(result);
  CHECK_THAT(result.error().message, Catch::StartsWith("config/bad.json: malformed JSON at line 3, column"));
}

TEST_CASE("a missing file is reported with its path", "[core][policy]") {
  const auto result = kvrelay::load_policy_file("/nonexistent/kvrelay.json");
  REQUIRE_FALSE(result);
  CHECK(result.error().code == kvrelay::ErrorCode::kNotFound);
  CHECK_THAT(result.error().message, Catch::Contains("/nonexistent/kvrelay.json"));
}

TEST_CASE("host:port and URL parsing", "[core][policy]") {
  CHECK(kvrelay::parse_host_port("[::1]:80").value().host == "::1");
  CHECK(kvrelay::parse_host_port("localhost:0").value().port == 0);
  CHECK_FALSE(kvrelay::parse_host_port("nohost"));
  CHECK_FALSE(kvrelay::parse_host_port(":80"));
  CHECK_FALSE(kvrelay::parse_host_port("h:8x"));
  CHECK(kvrelay::parse_http_url("http://worker").value().port == 80);
  CHECK(kvrelay::parse_http_url("http://worker:8000/v1").value().base_path == "/v1");
  CHECK_FALSE(kvrelay::parse_http_url("http://worker:0"));
}
