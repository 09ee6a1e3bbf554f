// The summariser's request when it is A's own worker (issue #28 review): A's kvrelay fields and
// B's cache_salt go with it, so the KV A's worker publishes for the span is filed in A's tenant
// scope, salted as B's request was; another summariser gets the request as it is.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kvrelay/broker/tenant_chain.h"
#include "kvrelay/core/block_hash.h"
#include "kvrelay/proxy/front_proxy.h"

using namespace kvrelay;
using namespace kvrelay::proxy;
using nlohmann::json;

namespace {

Policy tenant_policy() {
  Policy policy;
  policy.node_id = "node-1";
  AgentPolicy a;
  a.id = "planner";
  a.upstream = HttpUrl{"127.0.0.1", 9000, ""};
  a.kv_connector = true;
  a.tenant = "acme";
  AgentPolicy b = a;
  b.id = "coder";
  b.upstream.port = 9001;
  policy.agents = {a, b};
  policy.tenants = {TenantPolicy{"acme", "/salt", "acme-salt"}};
  policy.signing.node_key = "node-key";
  RoutePolicy route;
  route.id = "plan-code";
  route.from_agent = "planner";
  route.to_agent = "coder";
  policy.routes = {route};
  return policy;
}

}  // namespace

TEST_CASE("the summariser request from A's own worker is scoped to A's tenant and B's salt",
          "[proxy][summary][security]") {
  const Policy policy = tenant_policy();
  const RoutePolicy& route = policy.routes[0];
  const std::string b_body = json{{"prompt", {1, 2, 3}}, {"cache_salt", "user-7"}}.dump();
  const std::string asked = json{{"prompt", {1, 2}}, {"max_tokens", 8}}.dump();
  const auto scoped = summariser_scoped_body(policy, route, policy.agents[0].upstream, "req-1", b_body, asked);
  REQUIRE(scoped);
  const auto document = json::parse(scoped.value());
  CHECK(document["prompt"] == json({1, 2}));
  CHECK(document["cache_salt"] == "user-7");
  const auto& kvrelay = document["kv_transfer_params"]["kvrelay"];
  CHECK(kvrelay["agent"] == "planner");
  CHECK(kvrelay["tenant"] == "acme");
  CHECK(kvrelay["request_id"] == "req-1-summary");
  // The chain root A's worker hashes from: acme's salt with B's cache salt, never the default root.
  CHECK(kvrelay["chain_root"] == block_hash_hex(broker::derive_chain_root("acme-salt", "user-7")));
  CHECK(kvrelay.contains("signature"));

  // Another summariser (not A's worker) gets the request as it was built.
  const auto other = summariser_scoped_body(policy, route, HttpUrl{"10.0.0.9", 8000, ""}, "req-1", b_body, asked);
  REQUIRE(other);
  CHECK(other.value() == asked);
}
