// Issue #29 on the path a real handoff takes: two sidecars whose policies name each other with
// transport "ucx", reference workers (stories260K) behind them. B's KV lookup fetches A's KV over
// UCX (the lookup record says so), B answers exactly as a worker that prefilled from tokens, and
// /admin/peers shows the transport and UCX's lanes. Once with UCX_TLS=tcp, once with posix.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kvrelay/peer/ucx_transport.h"

#include "support/kv_path_fixture.h"
#include "support/skip.h"

namespace kvrelay::test {

TEST_CASE("a handoff between sidecars with ucx peers fetches KV over UCX and answers as the tokens run", "[ucx][e2e]") {
  if (!peer::ucx_built()) KVRELAY_SKIP("built without UCX (libucx-dev)");
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  for (const std::string tls : {"tcp", "posix"}) {
    INFO("UCX_TLS=" << tls);
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
    const auto peer = [](const std::string& id, std::uint16_t port) {
      return nlohmann::json::array(
          {{{"id", id}, {"address", "127.0.0.1:" + std::to_string(port)}, {"transport", "ucx"}}});
    };
    const auto with_ucx = [&](nlohmann::json policy) {
      policy["ucx"] = {{"tls", tls}};
      return policy;
    };
    node_a.start(with_ucx(sidecar_policy(node_a, agents_a, routes, peer("node-b", 1))));
    node_b.start(with_ucx(sidecar_policy(node_b, agents_b, routes, peer("node-a", node_a.peer_port()))));
    node_a.reload(with_ucx(sidecar_policy(node_a, agents_a, routes, peer("node-b", node_b.peer_port()))));

    const auto a_prompt = context_prompt(7);
    const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
    REQUIRE(a["kvrelay"]["published_tokens"].get<int>() >= 200);
    const auto b_prompt = handoff_prompt(a_prompt, a);
    const auto b = node_b.complete("reader", greedy(b_prompt, 16));
    const auto reply = http_request(reference.port(), "POST", "/v1/completions", greedy(b_prompt, 16).dump());
    REQUIRE(reply.status == 200);
    const auto tokens_run = nlohmann::json::parse(reply.body);

    INFO("B's log: " << node_b.process().stderr_text());
    INFO("A's log: " << node_a.process().stderr_text());
    const auto decision = node_b.decisions(1).at(0);
    INFO("B's decision: " << decision.dump());
    CHECK(decision["kv_from"] == "peer:node-a");
    REQUIRE(decision["fetch"].is_array());
    REQUIRE_FALSE(decision["fetch"].empty());
    CHECK(decision["fetch"].back()["result"] == "fetched");
    CHECK(decision["fetch"].back()["transport"] == "ucx");
    CHECK(b["kvrelay"]["cached_tokens"] == 208);
    CHECK(b["choices"][0]["token_ids"] == tokens_run["choices"][0]["token_ids"]);
    // The operator's view: B's link to A runs over UCX, on lanes of the transport asked for.
    const auto peers = nlohmann::json::parse(http_request(node_b.admin_port(), "GET", "/admin/peers").body);
    INFO(peers.dump());
    const auto& link = peers["peers"][0];
    CHECK(link["transport"] == "ucx");
    REQUIRE(link.contains("ucx_lanes"));
    REQUIRE_FALSE(link["ucx_lanes"].empty());
    CHECK(link["ucx_lanes"][0].get<std::string>().find(tls) != std::string::npos);
  }
}

}  // namespace kvrelay::test
