// Tenant isolation end to end (docs/security.md): real sidecars and reference workers
// (stories260K). Identical prompts of two tenants share no KV while one tenant's agents do, on
// one node and across two; and a lookup whose kvrelay fields were written by the client itself,
// straight to the worker around the front proxy (a forged signature or none), is served as if it
// carried none: it reaches no tenant's KV even with the tenant's real chain root, and is counted.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <string>

#include "kvrelay/broker/tenant_chain.h"
#include "kvrelay/core/block_hash.h"

#include "support/kv_path_fixture.h"
#include "support/skip.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr const char* kAcmeSalt = "acme-tenant-salt-0123456789abcdef";
constexpr const char* kGlobexSalt = "globex-tenant-salt-0123456789abcdef";

// Tenants acme and globex and a node key for `sidecar`, their files in `dir`.
json with_tenants(json policy, const TempDir& dir, const std::string& node_key) {
  write_file(dir / "acme.salt", kAcmeSalt);
  write_file(dir / "globex.salt", kGlobexSalt);
  write_file(dir / (node_key + ".key"), node_key + "-0123456789abcdef");
  policy["tenants"] = json::array({{{"id", "acme"}, {"salt_file", (dir / "acme.salt").string()}},
                                   {{"id", "globex"}, {"salt_file", (dir / "globex.salt").string()}}});
  policy["signing"] = {{"node_key_file", (dir / (node_key + ".key")).string()}};
  return policy;
}

json tenant_agent(const std::string& id, const std::string& tenant, const std::string& node, std::uint16_t port) {
  json agent = agent_json(id, node, port, stories_model_json());
  if (!tenant.empty()) agent["tenant"] = tenant;
  return agent;
}

std::uint64_t cached_tokens(const json& reply) {
  return reply["kvrelay"]["cached_tokens"].get<std::uint64_t>();
}

}  // namespace

TEST_CASE("two tenants with identical prompts share no KV, one tenant's agents do",
          "[broker][tenant][security][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  TempDir secrets;
  Sidecar node("node-1");
  // One worker serves every agent: only the kvrelay fields its sidecar's front proxy signs tell
  // the requests apart.
  RefworkerUnderTest worker({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  const json agents = json::array({tenant_agent("acme-writer", "acme", "", worker.port()),
                                   tenant_agent("acme-reader", "acme", "", worker.port()),
                                   tenant_agent("globex-reader", "globex", "", worker.port()),
                                   tenant_agent("default-reader", "", "", worker.port())});
  node.start(with_tenants(
      sidecar_policy(node, agents,
                     json::array({{{"id", "acme-handoff"}, {"from", "acme-writer"}, {"to", "acme-reader"}}})),
      secrets, "node-1"));

  const auto a_prompt = context_prompt(7);
  const auto a = node.complete("acme-writer", greedy(a_prompt, 20, true));
  const auto b_prompt = handoff_prompt(a_prompt, a);

  // The same prompt under another tenant, and under the default tenant: nothing is served.
  CHECK(cached_tokens(node.complete("globex-reader", greedy(b_prompt, 4))) == 0);
  const auto globex = node.decisions(1).at(0);
  CHECK(globex["tenant"] == "globex");
  CHECK(globex["outcome"] == "miss");
  CHECK(cached_tokens(node.complete("default-reader", greedy(b_prompt, 4))) == 0);
  CHECK(node.decisions(1).at(0)["outcome"] == "miss");
  CHECK_FALSE(node.decisions(1).at(0).contains("tenant"));
  CHECK(node.metric_sum("kvrelay_kv_lookups_total", {"outcome=\"hit_local\""}) == 0);

  // The same tenant's reader gets A's 13 whole blocks (A's 200 + 20 tokens).
  CHECK(cached_tokens(node.complete("acme-reader", greedy(b_prompt, 4))) == 208);
  const auto acme = node.decisions(1).at(0);
  CHECK(acme["tenant"] == "acme");
  CHECK(acme["outcome"] == "hit_local");
  // A cache_salt is a chain of its own inside the tenant.
  json salted = greedy(b_prompt, 4);
  salted["cache_salt"] = "conversation-42";
  CHECK(cached_tokens(node.complete("acme-reader", salted)) == 0);
  CHECK(node.metric_sum("kvrelay_kv_ignored_params_total") == 0);  // everything went through the proxy
}

TEST_CASE("a lookup with forged or unsigned kvrelay fields is served as if it had none, and counted",
          "[broker][tenant][security][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  TempDir secrets;
  Sidecar node("node-1");
  RefworkerUnderTest worker({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  const json agents = json::array(
      {tenant_agent("acme-writer", "acme", "", worker.port()), tenant_agent("acme-reader", "acme", "", worker.port())});
  node.start(with_tenants(
      sidecar_policy(node, agents,
                     json::array({{{"id", "acme-handoff"}, {"from", "acme-writer"}, {"to", "acme-reader"}}})),
      secrets, "node-1"));
  const auto b_prompt_of = [&](int seed) {
    const auto a_prompt = context_prompt(seed);
    return handoff_prompt(a_prompt, node.complete("acme-writer", greedy(a_prompt, 20, true)));
  };
  const auto b_prompt = b_prompt_of(11);
  const auto other_b_prompt = b_prompt_of(12);

  // A client that talks to the worker itself and claims to be acme's reader, with acme's real
  // chain root (as if it had leaked): its worker hashes acme's chain, yet nothing is served.
  const auto around_the_proxy = [&](const json& prompt, const json& signature) {
    json body = greedy(prompt, 4);
    json fields{{"agent", "acme-reader"},
                {"tenant", "acme"},
                {"route", "acme-handoff"},
                {"request_id", "forged-1"},
                {"node", "node-1"},
                {"chain_root", kvrelay::block_hash_hex(kvrelay::broker::derive_chain_root(kAcmeSalt, ""))}};
    if (!signature.is_null()) fields["signature"] = signature;
    body["kv_transfer_params"]["kvrelay"] = fields;
    const auto reply = http_request(worker.port(), "POST", "/v1/completions", body.dump());
    REQUIRE(reply.status == 200);
    return json::parse(reply.body);
  };
  CHECK(cached_tokens(around_the_proxy(b_prompt, std::string(64, 'a'))) == 0);
  const auto forged = node.decisions(1).at(0);
  CHECK(forged["kvrelay_params"] == "ignored: forged");
  CHECK(forged["outcome"] == "miss");
  CHECK(forged["route"].is_null());  // as if it had none: no route, no agent, no tenant
  CHECK(forged["agent"] == "");
  CHECK(forged["request_id"] == "");
  CHECK_FALSE(forged.contains("tenant"));
  CHECK(node.metric_sum("kvrelay_kv_ignored_params_total", {"message=\"lookup\"", "reason=\"forged\""}) == 1);
  // Its publish is not believed either (filed in the default tenant's scope, not acme's).
  CHECK(wait_until(
      [&] {
        return node.metric_sum("kvrelay_kv_ignored_params_total", {"message=\"publish\"", "reason=\"forged\""}) == 1;
      },
      std::chrono::seconds(10)));

  CHECK(cached_tokens(around_the_proxy(other_b_prompt, nullptr)) == 0);
  CHECK(node.decisions(1).at(0)["kvrelay_params"] == "ignored: unsigned");
  CHECK(node.metric_sum("kvrelay_kv_ignored_params_total", {"message=\"lookup\"", "reason=\"unsigned\""}) == 1);

  // Through the front proxy the same request is acme's, and gets acme's KV.
  CHECK(cached_tokens(node.complete("acme-reader", greedy(b_prompt, 4))) == 208);
  CHECK_FALSE(node.decisions(1).at(0).contains("kvrelay_params"));
}

TEST_CASE("a tenant's KV crosses nodes that hold its salt, and no other tenant's reader gets it",
          "[broker][tenant][security][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  TempDir secrets;
  Sidecar node_a("node-a");
  Sidecar node_b("node-b");
  RefworkerUnderTest worker_a({"--model", model->string()}, {"--kvrelay-socket", node_a.socket_path()});
  RefworkerUnderTest worker_b({"--model", model->string()}, {"--kvrelay-socket", node_b.socket_path()});
  // Writers on node-a, readers on node-b: acme's pair, and globex's, with routes inside each tenant.
  const auto agents_on = [&](bool on_a) {
    const auto port = [&](bool here, const RefworkerUnderTest& worker) -> std::uint16_t {
      return here ? worker.port() : 1;
    };
    return json::array({tenant_agent("writer", "acme", on_a ? "" : "node-a", port(on_a, worker_a)),
                        tenant_agent("rival-writer", "globex", on_a ? "" : "node-a", port(on_a, worker_a)),
                        tenant_agent("reader", "acme", on_a ? "node-b" : "", port(!on_a, worker_b)),
                        tenant_agent("rival", "globex", on_a ? "node-b" : "", port(!on_a, worker_b))});
  };
  const json routes = json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}},
                                   {{"id", "rival-handoff"}, {"from", "rival-writer"}, {"to", "rival"}}});
  const auto peer = [](const std::string& id, std::uint16_t port) {
    return json::array({{{"id", id}, {"address", "127.0.0.1:" + std::to_string(port)}}});
  };
  // Each node signs with a key of its own; both hold the tenants' salts.
  node_a.start(with_tenants(sidecar_policy(node_a, agents_on(true), routes, peer("node-b", 1)), secrets, "node-a"));
  node_b.start(with_tenants(sidecar_policy(node_b, agents_on(false), routes, peer("node-a", node_a.peer_port())),
                            secrets, "node-b"));
  node_a.reload(with_tenants(sidecar_policy(node_a, agents_on(true), routes, peer("node-b", node_b.peer_port())),
                             secrets, "node-a"));
  node_b.force_medium("writer-to-reader", "kv_raw");
  node_b.force_medium("rival-handoff", "kv_raw");

  const auto a_prompt = context_prompt(13);
  const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
  const auto b_prompt = handoff_prompt(a_prompt, a);
  // globex's reader asks node-a too (its route says so), for the identical prompt: a miss.
  CHECK(cached_tokens(node_b.complete("rival", greedy(b_prompt, 4))) == 0);
  const auto rival = node_b.decisions(1).at(0);
  CHECK(rival["route"] == "rival-handoff");
  CHECK(rival["outcome"] == "miss");
  CHECK(cached_tokens(node_b.complete("reader", greedy(b_prompt, 4))) == 208);
  const auto fetched = node_b.decisions(1).at(0);
  CHECK(fetched["outcome"] == "hit_peer");
  CHECK(fetched["tenant"] == "acme");
}
