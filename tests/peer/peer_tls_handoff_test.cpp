// A cross-node handoff over TLS peers (issue #25): two real sidecars with mutual TLS, B's lookup
// fetches A's KV over the encrypted link, and B answers exactly as a worker that prefilled
// everything from tokens.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "support/dev_certs.h"
#include "support/kv_path_fixture.h"
#include "support/skip.h"

namespace kvrelay::test {

TEST_CASE("a handoff between TLS sidecars fetches KV over TLS and answers as the tokens run", "[peer][security][e2e]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  const DevCerts certs({"node-a", "node-b"});
  Sidecar node_a("node-a");
  Sidecar node_b("node-b");
  RefworkerUnderTest worker_a({"--model", model->string()}, {"--kvrelay-socket", node_a.socket_path()});
  RefworkerUnderTest worker_b({"--model", model->string()}, {"--kvrelay-socket", node_b.socket_path()});
  RefworkerUnderTest reference({"--model", model->string()});
  const nlohmann::json agents_a =
      nlohmann::json::array({agent_json("writer", "", worker_a.port(), stories_model_json()),
                             agent_json("reader", "node-b", 1, stories_model_json())});
  const nlohmann::json agents_b =
      nlohmann::json::array({agent_json("writer", "node-a", 1, stories_model_json()),
                             agent_json("reader", "", worker_b.port(), stories_model_json())});
  const nlohmann::json routes = nlohmann::json::array(
      {{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}, {"forced_medium", "kv_raw"}}});
  // Peers are named by their certificates' SPIFFE IDs; ports are the kernel's, so A learns B's by reload.
  const auto peer = [](const std::string& id, std::uint16_t port) {
    return nlohmann::json::array(
        {{{"id", id}, {"address", "127.0.0.1:" + std::to_string(port)}, {"identity", dev_spiffe_id(id)}}});
  };
  const auto with_tls = [&](nlohmann::json policy, const std::string& id) {
    policy["peer_tls"] = certs.peer_tls(id);
    return policy;
  };
  node_a.start(with_tls(sidecar_policy(node_a, agents_a, routes, peer("node-b", 1)), "node-a"));
  node_b.start(with_tls(sidecar_policy(node_b, agents_b, routes, peer("node-a", node_a.peer_port())), "node-b"));
  node_a.reload(with_tls(sidecar_policy(node_a, agents_a, routes, peer("node-b", node_b.peer_port())), "node-a"));

  const auto a_prompt = context_prompt(7);
  const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
  REQUIRE(a["kvrelay"]["published_tokens"].get<int>() >= 200);
  const auto b_prompt = handoff_prompt(a_prompt, a);
  const auto b = node_b.complete("reader", greedy(b_prompt, 16));
  const auto reply = http_request(reference.port(), "POST", "/v1/completions", greedy(b_prompt, 16).dump());
  REQUIRE(reply.status == 200);
  const auto tokens_run = nlohmann::json::parse(reply.body);

  INFO("B's decisions: " << http_request(node_b.admin_port(), "GET", "/admin/decisions?limit=1").body);
  INFO("B's log: " << node_b.process().stderr_text());
  INFO("A's log: " << node_a.process().stderr_text());
  const auto decision = node_b.decisions(1).at(0);
  CHECK(decision["kv_from"] == "peer:node-a");
  CHECK(b["kvrelay"]["cached_tokens"] == 208);
  CHECK(b["choices"][0]["token_ids"] == tokens_run["choices"][0]["token_ids"]);
  CHECK(node_b.metric_sum("kvrelay_kv_bytes_total", {"direction=\"fetched\"", "codec=\"raw\""}) > 0);
  // Over TLS: B's link to A verified A's certificate, which /admin/peers shows with its expiry.
  const auto peers = nlohmann::json::parse(http_request(node_b.admin_port(), "GET", "/admin/peers").body);
  INFO(peers.dump());
  CHECK(peers["tls"] == true);
  CHECK(peers["peers"][0].value("certificate_expires_in_s", 0.0) > 0);
  CHECK(node_b.metric_sum("kvrelay_peer_tls_certificate_expiry_seconds", {"certificate=\"self\""}) > 0);
}

}  // namespace kvrelay::test
