// The KV path end to end with real processes: reference workers running stories260K, each
// behind its own kvrelay sidecar, sidecars peered over TCP on loopback (and one sidecar for
// both workers on one node). For every medium a route can be forced to, B's answer after A's
// handoff is compared with a worker that re-prefills everything from tokens.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "support/kv_path_fixture.h"
#include "support/skip.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr int kAnswerTokens = 16;
// Top-1 agreement is positional over B's 16 greedy tokens, so one divergence carries on to the
// end. Measured on stories260K (head_dim 8) with these prompts: int8 kept all 16 tokens in every
// run; int4 (7.9-10 % attention-output error at the time, see docs/codecs.md) kept the first
// 1-3 tokens. The int4 floor is that first token: raise it as the codec improves.
constexpr double kInt8AgreementFloor = 0.9;
constexpr double kInt4AgreementFloor = 1.0 / 16.0;

struct MediumCase {
  const char* medium;
  bool exact;
  double agreement_floor;
};
constexpr MediumCase kMedia[] = {{"tokens", true, 1.0},
                                 {"kv_raw", true, 1.0},
                                 {"kv_lossless", true, 1.0},
                                 {"kv_int8", false, kInt8AgreementFloor},
                                 {"kv_int4", false, kInt4AgreementFloor}};

// B's greedy answer from a worker without a sidecar: the tokens medium, everything re-prefilled.
json reference_answer(std::uint16_t reference_port, const json& b_prompt) {
  const auto reply = http_request(reference_port, "POST", "/v1/completions", greedy(b_prompt, kAnswerTokens).dump());
  REQUIRE(reply.status == 200);
  return json::parse(reply.body);
}

// Runs A then B for one context under `medium` and checks B against the tokens-only reference.
void check_handoff(const Sidecar& a_side, const std::string& a_agent, const Sidecar& b_side, const std::string& b_agent,
                   const std::string& route, const MediumCase& medium, int seed, std::uint16_t reference_port) {
  INFO("medium " << medium.medium);
  b_side.force_medium(route, medium.medium);
  const auto a_prompt = context_prompt(seed);
  const auto a = a_side.complete(a_agent, greedy(a_prompt, 20, true));
  REQUIRE(a["kvrelay"]["published_tokens"].get<int>() >= 200);
  const auto b_prompt = handoff_prompt(a_prompt, a);
  const auto b = b_side.complete(b_agent, greedy(b_prompt, kAnswerTokens));
  const auto reference = reference_answer(reference_port, b_prompt);

  const auto decision = b_side.decisions(1).at(0);
  CHECK(decision["route"] == route);
  CHECK(decision["medium"] == medium.medium);
  CHECK(decision["source"] == "forced");
  CHECK(decision.contains("cost"));
  const int prompt_tokens = static_cast<int>(b_prompt.size());
  if (std::string(medium.medium) == "tokens") {
    CHECK(decision["outcome"] == "tokens");
    CHECK(b["kvrelay"]["cached_tokens"] == 0);
    CHECK(b["kvrelay"]["prefill_tokens"] == prompt_tokens);
  } else {
    // A published 219 tokens of KV as 13 full 16-token blocks; B prefills only what follows them.
    CHECK(b["kvrelay"]["cached_tokens"] == 208);
    CHECK(decision["kv_from"] == (&a_side == &b_side ? std::string("local") : "peer:" + a_side.node_id()));
    CHECK(b["kvrelay"]["prefill_tokens"] == prompt_tokens - 208);
  }
  const double agreement = top1_agreement(b, reference);
  WARN(medium.medium << ": top-1 agreement with the tokens run " << agreement);
  if (medium.exact) {
    CHECK(b["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]);
  } else {
    CHECK(agreement >= medium.agreement_floor);
  }
}

// Writer and reader workers behind one sidecar, plus a reference worker without one.
struct SameNode {
  explicit SameNode(const std::filesystem::path& model)
      : worker_a({"--model", model.string()}, {"--kvrelay-socket", node.socket_path()}),
        worker_b({"--model", model.string()}, {"--kvrelay-socket", node.socket_path()}),
        reference({"--model", model.string()}) {}
  [[nodiscard]] json agents() const {
    return json::array({agent_json("writer", "", worker_a.port(), stories_model_json()),
                        agent_json("reader", "", worker_b.port(), stories_model_json())});
  }
  Sidecar node{"node-1"};
  RefworkerUnderTest worker_a;
  RefworkerUnderTest worker_b;
  RefworkerUnderTest reference;
};

// A writer worker behind node A's sidecar, a reader behind node B's, and a reference worker
// without a sidecar (the tokens medium).
struct CrossNode {
  explicit CrossNode(const std::filesystem::path& model)
      : worker_a({"--model", model.string()}, {"--kvrelay-socket", node_a.socket_path()}),
        worker_b({"--model", model.string()}, {"--kvrelay-socket", node_b.socket_path()}),
        reference({"--model", model.string()}) {}
  [[nodiscard]] json a_agents() const {
    return json::array({agent_json("writer", "", worker_a.port(), stories_model_json()),
                        agent_json("reader", "node-b", 1, stories_model_json())});
  }
  [[nodiscard]] json b_agents() const {
    return json::array({agent_json("writer", "node-a", 1, stories_model_json()),
                        agent_json("reader", "", worker_b.port(), stories_model_json())});
  }
  Sidecar node_a{"node-a"};
  Sidecar node_b{"node-b"};
  RefworkerUnderTest worker_a;
  RefworkerUnderTest worker_b;
  RefworkerUnderTest reference;
};

json peer_list(const std::string& id, std::uint16_t port) {
  return json::array({{{"id", id}, {"address", "127.0.0.1:" + std::to_string(port)}}});
}

}  // namespace

TEST_CASE("cross-node handoff: B's sidecar fetches A's KV from A's sidecar with the route's medium",
          "[proxy][kv_path][e2e][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  CrossNode pair(*model);
  Sidecar& node_a = pair.node_a;
  Sidecar& node_b = pair.node_b;
  const RefworkerUnderTest& reference = pair.reference;
  // A third agent on node B with another model.
  RefworkerUnderTest worker_c({"--synthetic", kTinySyntheticShape, "--seed", "3"},
                              {"--kvrelay-socket", node_b.socket_path()});
  json a_agents = pair.a_agents();
  a_agents.push_back(agent_json("other", "node-b", 1, tiny_synthetic_model_json()));
  json b_agents = pair.b_agents();
  b_agents.push_back(agent_json("other", "", worker_c.port(), tiny_synthetic_model_json()));
  json routes = json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}},
                             {{"id", "writer-to-other"}, {"from", "writer"}, {"to", "other"}}});
  const auto peer_json = peer_list;
  // Ports are the kernel's choice: A starts with a placeholder address for B, learns B's real
  // one by reload once B listens.
  node_a.start(sidecar_policy(node_a, a_agents, routes, peer_json("node-b", 1)));
  node_b.start(sidecar_policy(node_b, b_agents, routes, peer_json("node-a", node_a.peer_port())));
  node_a.reload(sidecar_policy(node_a, a_agents, routes, peer_json("node-b", node_b.peer_port())));

  int seed = 0;
  for (const auto& medium : kMedia) {
    check_handoff(node_a, "writer", node_b, "reader", "writer-to-reader", medium, ++seed, reference.port());
  }
  // KV crossed the link encoded: every KV medium was fetched from A and counted by codec.
  CHECK(node_b.metric_sum("kvrelay_kv_bytes_total", {"direction=\"fetched\"", "codec=\"raw\""}) > 0);
  CHECK(node_b.metric_sum("kvrelay_kv_bytes_total", {"direction=\"fetched\"", "codec=\"int4\""}) > 0);
  CHECK(node_a.metric_sum("kvrelay_kv_bytes_total", {"direction=\"served\"", "codec=\"int8\""}) > 0);
  const double raw_bytes = node_b.metric_sum("kvrelay_kv_bytes_total", {"direction=\"fetched\"", "codec=\"raw\""});
  const double int4_bytes = node_b.metric_sum("kvrelay_kv_bytes_total", {"direction=\"fetched\"", "codec=\"int4\""});
  CHECK(int4_bytes < raw_bytes);
  CHECK(node_b.metric_sum("kvrelay_kv_lookups_total", {"outcome=\"hit_peer\""}) == 4);

  {  // A pair of different models never moves KV, even when a KV medium is forced.
    const double served_before = node_a.metric_sum("kvrelay_kv_bytes_total", {"direction=\"served\""});
    node_b.force_medium("writer-to-other", "kv_raw");
    const auto a_prompt = context_prompt(++seed);
    const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
    json c_prompt = a_prompt;
    for (const auto& id : a["choices"][0]["token_ids"])
      c_prompt.push_back(id);
    const auto c = node_b.complete("other", greedy(c_prompt, 4));
    CHECK(c["kvrelay"]["cached_tokens"] == 0);
    const auto decision = node_b.decisions(1).at(0);
    CHECK(decision["route"] == "writer-to-other");
    CHECK(decision["medium"] == "tokens");
    CHECK(decision["reason"].get<std::string>().find("fingerprints") != std::string::npos);
    CHECK(node_a.metric_sum("kvrelay_kv_bytes_total", {"direction=\"served\""}) == served_before);
  }

  {  // B already holds the opening of A's context (say a shared preamble): only the blocks after
     // it cross the link, joined to B's own prefix.
    node_b.force_medium("writer-to-reader", "kv_raw");
    const auto a_prompt = context_prompt(++seed);
    const json opening(a_prompt.begin(), a_prompt.begin() + 100);
    const auto b_opening = node_b.complete("reader", greedy(opening, 1));
    REQUIRE(b_opening["kvrelay"]["published_tokens"].get<int>() >= 96);  // 6 full blocks in B's store
    const double served_before = node_a.metric_sum("kvrelay_kv_raw_bytes_total", {"direction=\"served\""});
    const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
    const auto b_prompt = handoff_prompt(a_prompt, a);
    const auto b = node_b.complete("reader", greedy(b_prompt, kAnswerTokens));
    CHECK(b["choices"][0]["token_ids"] == reference_answer(reference.port(), b_prompt)["choices"][0]["token_ids"]);
    CHECK(b["kvrelay"]["cached_tokens"] == 208);
    const auto decision = node_b.decisions(1).at(0);
    CHECK(decision["kv_from"] == "local+peer:node-a");
    CHECK(decision["outcome"] == "hit_peer");
    const auto fetch = decision["fetch"].back();
    CHECK(fetch["result"] == "fetched");
    CHECK(fetch["held_tokens"] == 96);
    CHECK(fetch["fetched_tokens"] == 208 - 96);
    // Every step of the fetch is timed; a delta is filed by the join, not as an entry of its own.
    for (const char* step :
         {"connect_and_request_ms", "reply_wait_ms", "transfer_ms", "decode_ms", "entry_ms", "join_ms"}) {
      INFO(step);
      REQUIRE(fetch["steps"].contains(step));
      CHECK(fetch["steps"][step].get<double>() >= 0);
    }
    CHECK(fetch["steps"]["entry_ms"] == 0.0);
    CHECK(fetch["steps"]["join_ms"].get<double>() > 0);
    constexpr int kBytesPerToken = 5 * 2 * 4 * 8 * 4;  // stories260K, fp32
    CHECK(fetch["raw_bytes"] == (208 - 96) * kBytesPerToken);
    CHECK(node_a.metric_sum("kvrelay_kv_raw_bytes_total", {"direction=\"served\""}) - served_before ==
          (208 - 96) * kBytesPerToken);
  }

  {  // A push route sends A's KV ahead on publish; B's lookup then finds it locally.
    json push_routes = routes;
    push_routes[0]["push"] = true;
    push_routes[0]["forced_medium"] = "kv_lossless";
    node_a.reload(sidecar_policy(node_a, a_agents, push_routes, peer_json("node-b", node_b.peer_port())));
    node_b.force_medium("writer-to-reader", "kv_raw");
    const auto a_prompt = context_prompt(++seed);
    const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
    REQUIRE(wait_until([&] { return node_b.metric_sum("kvrelay_kv_bytes_total", {"direction=\"received\""}) > 0; },
                       std::chrono::seconds(10)));
    const auto b_prompt = handoff_prompt(a_prompt, a);
    const auto b = node_b.complete("reader", greedy(b_prompt, kAnswerTokens));
    CHECK(b["choices"][0]["token_ids"] == reference_answer(reference.port(), b_prompt)["choices"][0]["token_ids"]);
    CHECK(b["kvrelay"]["cached_tokens"] == 208);
    const auto decision = node_b.decisions(1).at(0);
    CHECK(decision["kv_from"] == "local");
    CHECK(decision["outcome"] == "hit_local");
    const auto pushed = node_a.decisions(5);
    bool found_push = false;
    for (const auto& record : pushed)
      found_push = found_push || (record["kind"] == "push" && record["outcome"] == "pushed");
    CHECK(found_push);
    // The prefill B reported reached B's sidecar's cost model.
    CHECK(node_b.metric_sum("kvrelay_kv_prefill_reports_total", {"agent=\"reader\""}) > 0);
  }
}

TEST_CASE("cross-node handoff with the quantizers on the GPU (codecs.device): B answers as with the CPU codecs",
          "[proxy][kv_path][e2e][process][cuda]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  CrossNode pair(*model);
  Sidecar& node_a = pair.node_a;
  Sidecar& node_b = pair.node_b;
  const json a_agents = pair.a_agents();
  const json b_agents = pair.b_agents();
  const json routes = json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}}});
  auto policy = [&](const Sidecar& side, const json& agents, const std::string& peer_id, std::uint16_t peer_port) {
    auto document = sidecar_policy(side, agents, routes, peer_list(peer_id, peer_port));
    document["codecs"]["device"] = "auto";
    return document;
  };
  // Where a sidecar runs int8 and int4, from its /admin/codecs.
  const auto quantizers_on_gpu = [](const Sidecar& side) {
    const auto codecs = json::parse(http_request(side.admin_port(), "GET", "/admin/codecs").body);
    int on_gpu = 0;
    for (const auto& codec : codecs["codecs"]) {
      if ((codec["name"] == "int8" || codec["name"] == "int4") && codec["device"] == "cuda") ++on_gpu;
    }
    return on_gpu == 2;
  };
  node_a.start(policy(node_a, a_agents, "node-b", 1));
  if (!quantizers_on_gpu(node_a)) KVRELAY_SKIP_NO_GPU("no CUDA device: the quantizers stay on the CPU");
  node_b.start(policy(node_b, b_agents, "node-a", node_a.peer_port()));
  REQUIRE(quantizers_on_gpu(node_b));
  node_a.reload(policy(node_a, a_agents, "node-b", node_b.peer_port()));
  // A encodes on its GPU, B decodes on its GPU; the frames are the CPU's, so B's answer meets
  // the same floors as in the CPU run above.
  int seed = 40;
  for (const auto& medium : kMedia) {
    check_handoff(node_a, "writer", node_b, "reader", "writer-to-reader", medium, ++seed, pair.reference.port());
  }
  CHECK(node_a.metric_sum("kvrelay_kv_bytes_total", {"direction=\"served\"", "codec=\"int8\""}) > 0);
  CHECK(node_b.metric_sum("kvrelay_kv_bytes_total", {"direction=\"fetched\"", "codec=\"int4\""}) > 0);
}

TEST_CASE("same-node handoff: one sidecar serves B A's KV over shared memory with the route's medium",
          "[proxy][kv_path][e2e][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  SameNode pair(*model);
  auto& node = pair.node;
  auto& worker_b = pair.worker_b;
  auto& reference = pair.reference;
  const json agents = pair.agents();
  node.start(
      sidecar_policy(node, agents, json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}}})));
  int seed = 100;
  for (const auto& medium : kMedia) {
    check_handoff(node, "writer", node, "reader", "writer-to-reader", medium, ++seed, reference.port());
  }
  CHECK(node.metric_sum("kvrelay_kv_lookups_total", {"outcome=\"hit_local\""}) >= 4);
  CHECK(node.metric_sum("kvrelay_kv_bytes_total", {"direction=\"shm\"", "codec=\"int8\""}) > 0);

  {  // An audit treatment overrides the route: T0 is a miss, a prompt span serves only A's prompt.
    node.force_medium("writer-to-reader", "kv_raw");
    const auto a_prompt = context_prompt(++seed);
    const auto a = node.complete("writer", greedy(a_prompt, 20, true));
    const auto b_prompt = handoff_prompt(a_prompt, a);
    // Straight to B's worker with the params a front proxy would inject, treatment included.
    auto with_treatment = [&](const json& treatment) {
      json body = greedy(b_prompt, 4);
      body["kv_transfer_params"]["kvrelay"] = {
          {"request_id", "audit-1"}, {"agent", "reader"}, {"routes", {"writer-to-reader"}}, {"treatment", treatment}};
      const auto reply = http_request(worker_b.port(), "POST", "/v1/completions", body.dump());
      REQUIRE(reply.status == 200);
      return json::parse(reply.body);
    };
    CHECK(with_treatment({{"name", "T0"}, {"medium", "tokens"}, {"span", "none"}})["kvrelay"]["cached_tokens"] == 0);
    const auto t0 = node.decisions(1).at(0);
    CHECK(t0["source"] == "treatment");
    CHECK(t0["request_id"] == "audit-1");
    CHECK(t0["treatment"]["name"] == "T0");
    // A's 200-token prompt holds 12 full blocks: only those are served.
    const auto t1 =
        with_treatment({{"name", "T1"}, {"medium", "kv_raw"}, {"span", "prompt"}, {"prompt_tokens", a_prompt.size()}});
    CHECK(t1["kvrelay"]["cached_tokens"] == 192);
    const auto t3 = with_treatment({{"name", "T3"}, {"medium", "kv_raw"}, {"span", "all"}});
    CHECK(t3["kvrelay"]["cached_tokens"] >= 208);  // A's 13 blocks, or B's own 14 published by the T0 run
    // A malformed treatment is refused with a clear reason and B still answers, from tokens.
    const auto bad = with_treatment({{"name", "T9"}, {"medium", "carrier_pigeon"}});
    CHECK(bad["kvrelay"]["cached_tokens"] == 0);
    CHECK(node.decisions(1).at(0)["error"].get<std::string>().find("treatment.medium") != std::string::npos);
  }

  {  // DELETE /admin/kv drops what the sidecar stores: the same handoff then finds nothing to import.
    const auto a_prompt = context_prompt(++seed);
    const auto a = node.complete("writer", greedy(a_prompt, 20, true));
    const auto dropped = json::parse(admin_request(node.admin_port(), "DELETE", "/admin/kv").body);
    CHECK(dropped["dropped_entries"].get<int>() >= 1);
    CHECK(dropped["dropped_bytes"].get<double>() > 0);
    const auto b = node.complete("reader", greedy(handoff_prompt(a_prompt, a), 4));
    CHECK(b["kvrelay"]["cached_tokens"] == 0);
    CHECK(json::parse(admin_request(node.admin_port(), "DELETE", "/admin/kv").body)["dropped_entries"] >=
          1);  // B's own
  }
}

TEST_CASE("the engine prices only what B lacks: tokens for the rest still serve the prefix B's node holds",
          "[proxy][kv_path][e2e][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  SameNode pair(*model);
  auto& node = pair.node;
  auto& reference = pair.reference;
  const json agents = pair.agents();
  auto policy =
      sidecar_policy(node, agents, json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}}}));
  // A receiver whose prefill the operator calibrated as nearly free: re-prefilling B's 16 missing
  // tokens beats moving their KV, so the engine picks tokens for them.
  policy["cost_model"] = {{"agents", {{"reader", {{"prefill_s", {{"a", 0.0}, {"b", 1e-9}, {"c", 0.0}}}}}}}};
  node.start(policy);

  const auto a_prompt = context_prompt(7);
  const auto a = node.complete("writer", greedy(a_prompt, 20, true));
  const auto b_prompt = handoff_prompt(a_prompt, a);
  const auto b = node.complete("reader", greedy(b_prompt, kAnswerTokens));
  const auto decision = node.decisions(1).at(0);
  CHECK(decision["source"] == "engine");
  CHECK(decision["medium"] == "tokens");
  // The request's answer budget reached the engine (it prices a lossy medium's extra decode).
  CHECK(decision["max_tokens"] == kAnswerTokens);
  // 14 blocks may be served, the node holds A's 13: the engine weighed moving one block.
  CHECK(decision["cost"]["missing_tokens"] == 16);
  CHECK(decision["held_prefix_served"] == true);
  CHECK(decision["outcome"] == "hit_local");
  CHECK(b["kvrelay"]["cached_tokens"] == 208);
  CHECK(b["choices"][0]["token_ids"] == reference_answer(reference.port(), b_prompt)["choices"][0]["token_ids"]);

  // Forced tokens stay tokens only: nothing held is served.
  node.force_medium("writer-to-reader", "tokens");
  const auto forced = node.complete("reader", greedy(b_prompt, 4));
  CHECK(forced["kvrelay"]["cached_tokens"] == 0);
  CHECK(node.decisions(1).at(0)["outcome"] == "tokens");
}

TEST_CASE("a peer that never answers costs a lookup at most its time bound, then B prefills",
          "[proxy][kv_path][e2e][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  // A listener that completes TCP handshakes (kernel backlog) but never reads or answers.
  const int silent = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(silent >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  REQUIRE(::bind(silent, reinterpret_cast<sockaddr*>(&address), length) == 0);
  REQUIRE(::listen(silent, 16) == 0);
  REQUIRE(::getsockname(silent, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  const auto silent_port = ntohs(address.sin_port);

  Sidecar node_b("node-b");
  RefworkerUnderTest worker_b({"--model", model->string()}, {"--kvrelay-socket", node_b.socket_path()});
  RefworkerUnderTest reference({"--model", model->string()});
  const json agents = json::array({agent_json("writer", "node-a", 1, stories_model_json()),
                                   agent_json("reader", "", worker_b.port(), stories_model_json())});
  auto policy = sidecar_policy(
      node_b, agents,
      json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}, {"forced_medium", "kv_raw"}}}),
      json::array({{{"id", "node-a"}, {"address", "127.0.0.1:" + std::to_string(silent_port)}}}));
  policy["limits"]["kv_lookup_timeout_ms"] = 300;
  policy["limits"]["peer_summary_interval_ms"] = 0;
  node_b.start(policy);

  const auto prompt = context_prompt(7, 120);
  const auto b = node_b.complete("reader", greedy(prompt, 8));
  const auto reference_reply = http_request(reference.port(), "POST", "/v1/completions", greedy(prompt, 8).dump());
  CHECK(b["choices"][0]["token_ids"] == json::parse(reference_reply.body)["choices"][0]["token_ids"]);
  CHECK(b["kvrelay"]["cached_tokens"] == 0);
  const auto decision = node_b.decisions(1).at(0);
  CHECK(decision["outcome"] == "miss");
  REQUIRE(decision["fetch"].size() == 1);
  CHECK(decision["fetch"][0]["result"].get<std::string>().find("timeout") != std::string::npos);
  const auto peers = http_request(node_b.admin_port(), "GET", "/admin/peers");
  REQUIRE(peers.status == 200);
  CHECK(json::parse(peers.body)["peers"][0]["state"] == "unreachable");
  ::close(silent);
}
