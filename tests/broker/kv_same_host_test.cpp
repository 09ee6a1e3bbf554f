// Same-host peers move KV over shared memory, as the decision engine prices them: two real
// sidecars on this host, B's policy marking A same_host. B's lookup takes A's entry from A's
// data plane (its Unix socket), encoded with the route's medium, and the byte counters and the
// decision record say so; a peer that offers no shared memory is fetched over TCP, and the
// record says why. The medium keeps its meaning: kv_int8 over shared memory answers as kv_int8
// over TCP does.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "refworker/skip.h"
#include "support/kv_path_fixture.h"
#include "support/stalling_relay.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr int kAnswerTokens = 16;
constexpr int kServedTokens = 208;                 // A's 219 published tokens as 13 full blocks
constexpr int kBytesPerToken = 5 * 2 * 4 * 8 * 4;  // stories260K: layers, K and V, kv_heads, head_dim, fp32

json reference_answer(std::uint16_t port, const json& prompt) {
  const auto reply = http_request(port, "POST", "/v1/completions", greedy(prompt, kAnswerTokens).dump());
  REQUIRE(reply.status == 200);
  return json::parse(reply.body);
}

json peer_entry(std::uint16_t port) {
  return json::array({{{"id", "node-a"}, {"address", "127.0.0.1:" + std::to_string(port)}, {"same_host", true}}});
}

}  // namespace

TEST_CASE("a same-host peer's KV arrives over shared memory, counted apart from TCP, and no offer falls back to TCP",
          "[proxy][kv_path][e2e][process][shm]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  Sidecar node_a("node-a");
  Sidecar node_b("node-b");
  RefworkerUnderTest worker_a({"--model", model->string()}, {"--kvrelay-socket", node_a.socket_path()});
  RefworkerUnderTest worker_b({"--model", model->string()}, {"--kvrelay-socket", node_b.socket_path()});
  RefworkerUnderTest reference({"--model", model->string()});
  const json routes = json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}}});
  // Node C (below) fetches from A over TCP: A's policy names it and its reader, as it must for
  // A to serve it (a hello that names no policy peer may fetch nothing).
  node_a.start(sidecar_policy(
      node_a,
      json::array({agent_json("writer", "", worker_a.port(), stories_model_json()),
                   agent_json("reader", "node-b", 1, stories_model_json()),
                   agent_json("reader-c", "node-c", 1, stories_model_json())}),
      routes,
      json::array({{{"id", "node-b"}, {"address", "127.0.0.1:1"}}, {{"id", "node-c"}, {"address", "127.0.0.1:1"}}})));
  const json b_agents = json::array({agent_json("writer", "node-a", 1, stories_model_json()),
                                     agent_json("reader", "", worker_b.port(), stories_model_json())});
  node_b.start(sidecar_policy(node_b, b_agents, routes, peer_entry(node_a.peer_port())));

  int seed = 500;
  struct Handoff {
    json b_prompt;
    json answer;  // B's token ids
    json fetch;   // the last fetch attempt of B's decision record
  };
  const auto handoff = [&](const std::string& medium, bool exact) {
    INFO("medium " << medium);
    node_b.force_medium("writer-to-reader", medium);
    const auto a_prompt = context_prompt(++seed);
    const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
    REQUIRE(a["kvrelay"]["published_tokens"].get<int>() >= 200);
    const auto b_prompt = handoff_prompt(a_prompt, a);
    const auto b = node_b.complete("reader", greedy(b_prompt, kAnswerTokens));
    CHECK(b["kvrelay"]["cached_tokens"] == kServedTokens);
    const auto reference_reply = reference_answer(reference.port(), b_prompt);
    if (exact) {
      CHECK(b["choices"][0]["token_ids"] == reference_reply["choices"][0]["token_ids"]);
    } else {
      WARN(medium << ": top-1 agreement with the tokens run " << top1_agreement(b, reference_reply));
    }
    const auto decision = node_b.decisions(1).at(0);
    CHECK(decision.value("medium", "") == medium);
    CHECK(decision.value("outcome", "") == "hit_peer");
    CHECK(decision.value("kv_from", "") == "peer:node-a");
    REQUIRE(decision.contains("fetch"));
    return Handoff{b_prompt, b["choices"][0]["token_ids"], decision["fetch"].back()};
  };

  for (const char* medium : {"kv_raw", "kv_lossless"}) {
    const auto fetch = handoff(medium, true).fetch;
    CHECK(fetch.value("result", "") == "fetched");
    CHECK(fetch.value("transport", "") == "shm");
    CHECK_FALSE(fetch.contains("transport_note"));
    CHECK(fetch.value("raw_bytes", 0) == kServedTokens * kBytesPerToken);
  }
  CHECK(node_b.metric_sum("kvrelay_kv_raw_bytes_total", {"direction=\"fetched_shm\""}) ==
        2 * kServedTokens * kBytesPerToken);
  CHECK(node_b.metric_sum("kvrelay_kv_bytes_total", {"direction=\"fetched_shm\"", "codec=\"raw\""}) > 0);
  CHECK(node_b.metric_sum("kvrelay_kv_bytes_total", {"direction=\"fetched_shm\"", "codec=\"lossless\""}) > 0);

  // A lossy medium over shared memory delivers what its codec delivers: encoded, then decoded.
  const auto int8 = handoff("kv_int8", false);
  {
    const auto& fetch = int8.fetch;
    CHECK(fetch.value("transport", "") == "shm");
    CHECK(fetch.value("raw_bytes", 0) == kServedTokens * kBytesPerToken);
    const double frame_bytes = fetch.value("frame_bytes", 0.0);
    CHECK(frame_bytes > 0);
    CHECK(frame_bytes < kServedTokens * kBytesPerToken);
    CHECK(node_b.metric_sum("kvrelay_kv_bytes_total", {"direction=\"fetched_shm\"", "codec=\"int8\""}) == frame_bytes);
  }
  // Nothing of this crossed TCP: B fetched nothing over it and A's peer server served nothing.
  CHECK(node_b.metric_sum("kvrelay_kv_bytes_total", {"direction=\"fetched\""}) == 0);
  CHECK(node_b.metric_sum("kvrelay_kv_raw_bytes_total", {"direction=\"fetched\""}) == 0);
  CHECK(node_a.metric_sum("kvrelay_kv_bytes_total", {"direction=\"served\""}) == 0);

  {  // Node C, A's peer over TCP only, gets the same kv_int8 answer for the same context.
    Sidecar node_c("node-c");
    RefworkerUnderTest worker_c({"--model", model->string()}, {"--kvrelay-socket", node_c.socket_path()});
    const json c_agents = json::array({agent_json("writer", "node-a", 1, stories_model_json()),
                                       agent_json("reader", "", worker_c.port(), stories_model_json())});
    node_c.start(sidecar_policy(
        node_c, c_agents, routes,
        json::array({{{"id", "node-a"}, {"address", "127.0.0.1:" + std::to_string(node_a.peer_port())}}})));
    node_c.force_medium("writer-to-reader", "kv_int8");
    const auto c = node_c.complete("reader", greedy(int8.b_prompt, kAnswerTokens));
    CHECK(c["kvrelay"]["cached_tokens"] == kServedTokens);
    CHECK(c["choices"][0]["token_ids"] == int8.answer);
    const auto decision = node_c.decisions(1).at(0);
    REQUIRE(decision.contains("fetch"));
    CHECK(decision["fetch"].back().value("transport", "") == "tcp");
  }

  {  // A same-host peer whose hello offers no shared memory: TCP, and the record says why.
    const double served_before = node_a.metric_sum("kvrelay_kv_raw_bytes_total", {"direction=\"served\""});
    StallingRelay no_offer(node_a.peer_port(), std::chrono::milliseconds(0));
    no_offer.offer_shared_memory("");
    node_b.reload(sidecar_policy(node_b, b_agents, routes, peer_entry(no_offer.port())));
    const auto fetch = handoff("kv_raw", true).fetch;
    CHECK(fetch.value("transport", "") == "tcp");
    CHECK(fetch.value("transport_note", "").find("no shared-memory socket") != std::string::npos);
    CHECK(node_b.metric_sum("kvrelay_kv_raw_bytes_total", {"direction=\"fetched\""}) == kServedTokens * kBytesPerToken);
    // A counts what it served once the reply's last acknowledgement is in, which can be after B
    // has answered: wait for it (bounded), then check the count.
    const auto served = [&] {
      return node_a.metric_sum("kvrelay_kv_raw_bytes_total", {"direction=\"served\""}) - served_before;
    };
    wait_until([&] { return served() > 0; }, std::chrono::seconds(10));
    CHECK(served() == kServedTokens * kBytesPerToken);
    CHECK(no_offer.connections() >= 1);
  }
}
