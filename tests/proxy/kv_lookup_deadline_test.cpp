// limits.kv_lookup_timeout_ms bounds a whole lookup, end to end: reference workers behind real
// sidecars, B's sidecar fetching A's KV through a relay that stalls one stage of the exchange.
// Each stall is slow progress (every piece meets its own read in time, the exchange as a whole
// does not), so only a deadline over connect, hello, request and every read turns it into a miss.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kv_path_fixture.h"
#include "refworker/skip.h"
#include "stalling_relay.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr int kAnswerTokens = 8;
// The lookup's deadline, and the relay's step: three steps (the held-back frame's pieces) are
// well past the deadline, one step is well inside B's per-read timeout (30 s).
constexpr int kLookupDeadlineMs = 400;
constexpr std::chrono::milliseconds kStallStep{250};

struct StallCase {
  StallingRelay::Stall stall;
  const char* stage;  // what B's fetch record names
};
constexpr StallCase kStalls[] = {{StallingRelay::Stall::kHello, "peer hello"},
                                 {StallingRelay::Stall::kFetchReply, "fetch reply"},
                                 {StallingRelay::Stall::kTransfer, "fetch transfer"}};

}  // namespace

TEST_CASE("a lookup's deadline ends a fetch stalled at the hello, the reply or mid-transfer: B misses and prefills",
          "[proxy][kv_path][e2e][process][deadline]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  Sidecar node_a("node-a");
  Sidecar node_b("node-b");
  RefworkerUnderTest worker_a({"--model", model->string()}, {"--kvrelay-socket", node_a.socket_path()});
  RefworkerUnderTest worker_b({"--model", model->string()}, {"--kvrelay-socket", node_b.socket_path()});
  RefworkerUnderTest reference({"--model", model->string()});
  const json routes =
      json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}, {"forced_medium", "kv_raw"}}});
  node_a.start(sidecar_policy(node_a,
                              json::array({agent_json("writer", "", worker_a.port(), stories_model_json()),
                                           agent_json("reader", "node-b", 1, stories_model_json())}),
                              routes, json::array({{{"id", "node-b"}, {"address", "127.0.0.1:1"}}})));
  StallingRelay relay(node_a.peer_port(), kStallStep);
  auto b_policy = sidecar_policy(
      node_b,
      json::array({agent_json("writer", "node-a", 1, stories_model_json()),
                   agent_json("reader", "", worker_b.port(), stories_model_json())}),
      routes, json::array({{{"id", "node-a"}, {"address", "127.0.0.1:" + std::to_string(relay.port())}}}));
  b_policy["limits"]["kv_lookup_timeout_ms"] = kLookupDeadlineMs;
  b_policy["limits"]["read_timeout_ms"] = 30'000;
  b_policy["limits"]["peer_summary_interval_ms"] = 0;  // only lookups talk to the relay
  node_b.start(b_policy);

  int seed = 300;
  for (const auto& [stall, stage] : kStalls) {
    INFO("stalled at " << stage);
    relay.stall(stall);
    const auto a_prompt = context_prompt(++seed);
    const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
    REQUIRE(a["kvrelay"]["published_tokens"].get<int>() >= 200);
    const auto b_prompt = handoff_prompt(a_prompt, a);
    const auto b = node_b.complete("reader", greedy(b_prompt, kAnswerTokens));
    // A miss: B's worker prefilled every token and answered as a tokens-only worker does.
    CHECK(b["kvrelay"]["cached_tokens"] == 0);
    CHECK(b["kvrelay"]["prefill_tokens"] == b_prompt.size());
    const auto reference_reply =
        http_request(reference.port(), "POST", "/v1/completions", greedy(b_prompt, kAnswerTokens).dump());
    REQUIRE(reference_reply.status == 200);
    CHECK(b["choices"][0]["token_ids"] == json::parse(reference_reply.body)["choices"][0]["token_ids"]);
    const auto decision = node_b.decisions(1).at(0);
    CHECK(decision.value("outcome", "") == "miss");
    CHECK(decision["served_tokens"] == 0);
    REQUIRE(decision.contains("fetch"));
    REQUIRE(decision["fetch"].size() == 1);
    const auto result = decision["fetch"][0]["result"].get<std::string>();
    INFO(result);
    CHECK(result.find("timeout") == 0);
    CHECK(result.find(stage) != std::string::npos);
    CHECK(result.find("deadline exceeded") != std::string::npos);
  }
  CHECK(node_b.metric_sum("kvrelay_kv_lookups_total", {"outcome=\"hit_peer\""}) == 0);

  // Nothing stalls now: the next lookup gets A's KV on a fresh connection, as every stalled
  // one was left mid-frame and dropped rather than reused.
  const auto a_prompt = context_prompt(++seed);
  const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
  const auto b = node_b.complete("reader", greedy(handoff_prompt(a_prompt, a), kAnswerTokens));
  CHECK(b["kvrelay"]["cached_tokens"] == 208);
  CHECK(node_b.decisions(1).at(0).value("kv_from", "") == "peer:node-a");
  CHECK(relay.connections() == 4);
}
