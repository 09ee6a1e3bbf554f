// A plugin codec as a KV medium end to end: two sidecars loading the xor test plugin, reference
// workers on stories260K, the route forced to codec:xor. B's sidecar fetches A's KV from A's
// sidecar encoded with the plugin, and B answers exactly as a worker that prefills from tokens
// (xor is lossless).
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "refworker/skip.h"
#include "support/kv_path_fixture.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr int kAnswerTokens = 16;

std::filesystem::path plugin_dir() {
  return binary_dir() / "tests" / "codec_plugins" / "plugins" / "good";
}

json with_plugins(json policy) {
  policy["codecs"]["plugin_dirs"] = {plugin_dir().string()};
  return policy;
}

json peer_list(const std::string& id, std::uint16_t port) {
  return json::array({{{"id", id}, {"address", "127.0.0.1:" + std::to_string(port)}}});
}

}  // namespace

TEST_CASE("a plugin codec is a medium: forced on a route, B's sidecar fetches A's KV encoded with it",
          "[proxy][kv_path][plugin][e2e][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  REQUIRE(std::filesystem::exists(plugin_dir() / "xor_plugin.so"));
  Sidecar node_a("node-a");
  Sidecar node_b("node-b");
  RefworkerUnderTest worker_a({"--model", model->string()}, {"--kvrelay-socket", node_a.socket_path()});
  RefworkerUnderTest worker_b({"--model", model->string()}, {"--kvrelay-socket", node_b.socket_path()});
  RefworkerUnderTest reference({"--model", model->string()});
  const json a_agents = json::array({agent_json("writer", "", worker_a.port(), stories_model_json()),
                                     agent_json("reader", "node-b", 1, stories_model_json())});
  const json b_agents = json::array({agent_json("writer", "node-a", 1, stories_model_json()),
                                     agent_json("reader", "", worker_b.port(), stories_model_json())});
  // Plugin media in allowed_media, one of them not installed anywhere: the engine must still be
  // built (it prices every listed medium).
  const json routes = json::array({{{"id", "writer-to-reader"},
                                    {"from", "writer"},
                                    {"to", "reader"},
                                    {"allowed_media", {"tokens", "kv_raw", "codec:xor", "codec:absent"}}}});
  node_a.start(with_plugins(sidecar_policy(node_a, a_agents, routes, peer_list("node-b", 1))));
  node_b.start(with_plugins(sidecar_policy(node_b, b_agents, routes, peer_list("node-a", node_a.peer_port()))));
  node_a.reload(with_plugins(sidecar_policy(node_a, a_agents, routes, peer_list("node-b", node_b.peer_port()))));

  node_b.force_medium("writer-to-reader", "codec:xor");
  const auto a_prompt = context_prompt(7);
  const auto a = node_a.complete("writer", greedy(a_prompt, 20, true));
  REQUIRE(a["kvrelay"]["published_tokens"].get<int>() >= 200);
  const auto b_prompt = handoff_prompt(a_prompt, a);
  const auto b = node_b.complete("reader", greedy(b_prompt, kAnswerTokens));
  const auto reply = http_request(reference.port(), "POST", "/v1/completions", greedy(b_prompt, kAnswerTokens).dump());
  REQUIRE(reply.status == 200);
  const auto expected = json::parse(reply.body);

  auto decision = node_b.decisions(1).at(0);
  INFO(decision.dump());
  CHECK(decision["medium"] == "codec:xor");
  CHECK(decision["source"] == "forced");
  CHECK(decision["outcome"] == "hit_peer");
  CHECK(decision["kv_from"] == "peer:node-a");
  CHECK(decision["fetch"].back()["result"] == "fetched");
  // The engine ran (a failed build leaves no cost breakdown) and lists the plugin as a candidate.
  REQUIRE(decision.contains("cost"));
  std::map<std::string, json> candidates;
  for (const auto& candidate : decision["cost"]["candidates"])
    candidates[candidate["medium"].get<std::string>()] = candidate;
  REQUIRE(candidates.count("codec:xor") == 1);
  CHECK(candidates["codec:xor"]["eligible"] == true);
  REQUIRE(candidates.count("codec:absent") == 1);
  CHECK(candidates["codec:absent"]["eligible"] == false);
  CHECK(candidates["codec:absent"]["lost_because"] == "codec_unavailable");
  CHECK(b["kvrelay"]["cached_tokens"] == 208);
  CHECK(b["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]);
  // The bytes crossed the link as xor frames, counted on both sides under the plugin medium.
  CHECK(node_b.metric_sum("kvrelay_kv_bytes_total",
                          {"direction=\"fetched\"", "medium=\"codec:xor\"", "codec=\"xor\""}) > 0);
  CHECK(node_a.metric_sum("kvrelay_kv_bytes_total", {"direction=\"served\"", "codec=\"xor\""}) > 0);
  CHECK(node_b.metric_sum("kvrelay_kv_bytes_total", {"direction=\"fetched\"", "codec=\"raw\""}) == 0);

  // A plugin this sidecar has not loaded cannot be forced: the route would claim what it cannot do.
  const auto refused = admin_request(node_b.admin_port(), "PUT", "/admin/routes/writer-to-reader",
                                     json{{"forced_medium", "codec:absent"}}.dump());
  CHECK(refused.status == 400);
  CHECK_THAT(refused.body, Catch::Contains("not loaded"));
}
