// The policy's tenants and signing sections: references, and the secret files read at load.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <string>

#include "kvrelay/core/policy.h"

#include "support/test_paths.h"

using nlohmann::json;

namespace {

json tenancy_policy(const kvrelay::test::TempDir& dir) {
  return {{"schema_version", 1},
          {"node", {{"id", "n"}}},
          {"listen", {{"http", "127.0.0.1:0"}}},
          {"tenants", json::array({{{"id", "acme"}, {"salt_file", (dir / "acme.salt").string()}},
                                   {{"id", "globex"}, {"salt_file", (dir / "globex.salt").string()}}})},
          {"signing", {{"node_key_file", (dir / "node.key").string()}}},
          {"agents", json::array({{{"id", "a"},
                                   {"upstream", "http://127.0.0.1:9000"},
                                   {"tenant", "acme"},
                                   {"model",
                                    {{"architecture", "llama"},
                                     {"layers", 5},
                                     {"kv_heads", 4},
                                     {"head_dim", 8},
                                     {"dtype", "fp32"},
                                     {"weights", "w"}}}}})}};
}

kvrelay::Result<kvrelay::Policy> load(const kvrelay::test::TempDir& dir, const json& policy) {
  kvrelay::test::write_file(dir / "policy.json", policy.dump());
  return kvrelay::load_policy_file((dir / "policy.json").string());
}

void write_secrets(const kvrelay::test::TempDir& dir) {
  kvrelay::test::write_file(dir / "acme.salt", "acme-salt-0123456789");
  kvrelay::test::write_file(dir / "globex.salt", "globex-salt-0123456789");
  kvrelay::test::write_file(dir / "node.key", "node-key-0123456789");
}

}  // namespace

TEST_CASE("tenants' salts and the node key are read from their files at load", "[core][policy][security]") {
  kvrelay::test::TempDir dir;
  write_secrets(dir);
  const auto loaded = load(dir, tenancy_policy(dir));
  REQUIRE(loaded);
  const auto& policy = loaded.value();
  REQUIRE(policy.tenants.size() == 2);
  CHECK(policy.find_tenant("acme")->salt == "acme-salt-0123456789");
  CHECK(policy.find_tenant("nobody") == nullptr);
  CHECK(policy.signing.enabled());
  CHECK(policy.signing.node_key == "node-key-0123456789");
  CHECK(policy.agents[0].tenant == "acme");
  // parse_policy alone (fuzzers, editors) reads no file.
  const auto parsed = kvrelay::parse_policy(tenancy_policy(dir).dump(), "mem.json");
  REQUIRE(parsed);
  CHECK(parsed.value().tenants[0].salt.empty());
}

TEST_CASE("a missing, short or unreadable secret file fails with its pointer, never its contents",
          "[core][policy][security]") {
  kvrelay::test::TempDir dir;
  write_secrets(dir);
  kvrelay::test::write_file(dir / "globex.salt", "short-secret");  // 12 bytes
  std::filesystem::remove(dir / "node.key");
  const auto loaded = load(dir, tenancy_policy(dir));
  REQUIRE_FALSE(loaded);
  const auto& message = loaded.error().message;
  CHECK_THAT(message, Catch::Contains("/tenants/1/salt_file: ") && Catch::Contains("holds 12 bytes"));
  CHECK_THAT(message, Catch::Contains("/signing/node_key_file: cannot open"));
  CHECK_THAT(message, !Catch::Contains("short-secret"));
  CHECK_THAT(message, !Catch::Contains("/tenants/0"));

  write_secrets(dir);
  auto directory = tenancy_policy(dir);
  directory["signing"]["node_key_file"] = dir.path().string();
  const auto not_a_file = load(dir, directory);
  REQUIRE_FALSE(not_a_file);
  CHECK_THAT(not_a_file.error().message,
             Catch::Contains("/signing/node_key_file: ") && Catch::Contains("is not a regular file"));
}

TEST_CASE("tenancy references are checked: known tenants, a node key, routes inside one tenant",
          "[core][policy][security]") {
  kvrelay::test::TempDir dir;
  auto policy = tenancy_policy(dir);
  policy["agents"][0]["tenant"] = "initech";
  auto rejected = kvrelay::parse_policy(policy.dump(), "x.json");
  REQUIRE_FALSE(rejected);
  CHECK_THAT(rejected.error().message, Catch::Contains("x.json: /agents/0/tenant: expected a tenant id from /tenants"));

  policy = tenancy_policy(dir);
  policy.erase("signing");
  rejected = kvrelay::parse_policy(policy.dump(), "x.json");
  REQUIRE_FALSE(rejected);
  CHECK_THAT(rejected.error().message, Catch::Contains("/signing/node_key_file: tenants need a node key"));

  policy = tenancy_policy(dir);
  auto other = policy["agents"][0];
  other["id"] = "b";
  other["tenant"] = "globex";
  policy["agents"].push_back(other);
  policy["routes"] = json::array({{{"id", "a-to-b"}, {"from", "a"}, {"to", "b"}}});
  rejected = kvrelay::parse_policy(policy.dump(), "x.json");
  REQUIRE_FALSE(rejected);
  CHECK_THAT(rejected.error().message, Catch::Contains("/routes/0/to: a route connects agents of one tenant"));

  policy = tenancy_policy(dir);
  policy["tenants"][1]["id"] = "acme";
  rejected = kvrelay::parse_policy(policy.dump(), "x.json");
  REQUIRE_FALSE(rejected);
  CHECK_THAT(rejected.error().message, Catch::Contains("/tenants/1/id: duplicate id"));

  policy = tenancy_policy(dir);
  policy["tenants"][0]["salt"] = "inline secrets are not accepted";
  rejected = kvrelay::parse_policy(policy.dump(), "x.json");
  REQUIRE_FALSE(rejected);
  CHECK_THAT(rejected.error().message, Catch::Contains("/tenants/0/salt: unknown key"));
}

TEST_CASE("a route's audit may allow client-chosen treatments", "[core][policy]") {
  kvrelay::test::TempDir dir;
  auto policy = tenancy_policy(dir);
  auto other = policy["agents"][0];
  other["id"] = "b";
  policy["agents"].push_back(other);
  policy["routes"] = json::array(
      {{{"id", "a-to-b"}, {"from", "a"}, {"to", "b"}},
       {{"id", "b-to-a"}, {"from", "b"}, {"to", "a"}, {"audit", {{"fraction", 0}, {"client_treatments", true}}}}});
  const auto parsed = kvrelay::parse_policy(policy.dump(), "x.json");
  REQUIRE(parsed);
  CHECK_FALSE(parsed.value().routes[0].audit.client_treatments);
  CHECK(parsed.value().routes[1].audit.client_treatments);
}
