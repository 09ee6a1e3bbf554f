// Agent A's KV reaches agent B through one kvrelay sidecar's shared-memory data plane: real
// sidecar, real workers, real memfd segments. B must answer exactly as it does when it
// re-prefills A's context from tokens, while prefilling only what A's KV does not cover.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "skip.h"
#include "support/child_process.h"
#include "support/http_client.h"
#include "support/refworker_process.h"
#include "support/test_paths.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

json complete(std::uint16_t port, const json& body) {
  const auto reply = http_request(port, "POST", "/v1/completions", body.dump());
  REQUIRE(reply.status == 200);
  return json::parse(reply.body);
}

}  // namespace

TEST_CASE("same-node handoff: B imports A's KV from the sidecar and answers identically", "[refworker][e2e][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  TempDir dir;
  const auto socket = (dir / "kvrelay.sock").string();
  write_file(dir / "policy.json",
             json{{"schema_version", 1},
                  {"node", {{"id", "n"}}},
                  {"listen", {{"http", "127.0.0.1:0"}, {"admin", "127.0.0.1:0"}, {"unix_socket", socket}}}}
                 .dump());
  ChildProcess sidecar({kvrelay_binary().string(), "serve", "--config", (dir / "policy.json").string(), "--ready-file",
                        (dir / "ready.json").string()},
                       dir.path());
  REQUIRE(wait_until([&] { return std::filesystem::exists(dir / "ready.json"); }, std::chrono::seconds(20)));

  RefworkerUnderTest agent_a({"--model", model->string()}, {"--kvrelay-socket", socket});
  RefworkerUnderTest agent_b({"--model", model->string()}, {"--kvrelay-socket", socket});
  RefworkerUnderTest cold({"--model", model->string()});  // no sidecar: the tokens medium

  json prompt = json::array({1});
  for (int index = 1; index < 200; ++index)
    prompt.push_back(3 + (index * 37) % 500);
  const auto a =
      complete(agent_a.port(), {{"prompt", prompt}, {"max_tokens", 20}, {"temperature", 0}, {"ignore_eos", true}});
  CHECK(a["kvrelay"]["published_tokens"].get<int>() >= 200);

  json b_prompt = prompt;
  for (const auto& id : a["choices"][0]["token_ids"])
    b_prompt.push_back(id);
  for (const int id : {300, 301, 302, 303, 304})
    b_prompt.push_back(id);  // B's follow-up
  const json b_request{{"prompt", b_prompt}, {"max_tokens", 16}, {"temperature", 0}};
  const auto b = complete(agent_b.port(), b_request);
  const auto reference = complete(cold.port(), b_request);

  CHECK(b["choices"][0]["token_ids"] == reference["choices"][0]["token_ids"]);
  // A published its 219 tokens of KV as 13 full 16-token blocks (208 tokens); B's 225-token
  // prompt shares them, so B prefills only the 17 tokens after them.
  CHECK(b["kvrelay"]["cached_tokens"] == 208);
  CHECK(b["kvrelay"]["prefill_tokens"] == 225 - 208);
  CHECK(reference["kvrelay"]["prefill_tokens"] == 225);
  CHECK(reference["kvrelay"]["cached_tokens"] == 0);

  // A prompt sharing nothing with A's context misses and is prefilled in full.
  const auto unrelated = complete(agent_b.port(), {{"prompt", json::array({1, 7, 8, 9})}, {"max_tokens", 2}});
  CHECK(unrelated["kvrelay"]["cached_tokens"] == 0);

  // The sidecar's /metrics shows its shared-memory data plane: both workers connected, A's
  // KV stored in the (default, 256 MiB) arena.
  const auto ready = json::parse(read_file(dir / "ready.json"));
  const auto metrics = http_request(ready["admin"].get<std::uint16_t>(), "GET", "/metrics").body;
  const auto sample = [&](const std::string& name) {
    const auto at = metrics.find("\n" + name + " ");
    REQUIRE(at != std::string::npos);
    return std::stod(metrics.substr(at + name.size() + 2));
  };
  CHECK(sample("kvrelay_shm_connections") >= 2);
  CHECK(sample("kvrelay_shm_entries") >= 1);
  CHECK(sample("kvrelay_shm_entry_bytes") > 0);
  CHECK(sample("kvrelay_shm_arena_bytes") == 256.0 * 1024 * 1024);
  CHECK(sample("kvrelay_shm_arena_bytes_in_use") >= sample("kvrelay_shm_entry_bytes"));
  CHECK(sample("kvrelay_shm_arena_bytes_in_use") <= sample("kvrelay_shm_arena_bytes"));
}

TEST_CASE("a worker whose sidecar is gone still answers, from tokens", "[refworker][e2e][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  TempDir dir;
  RefworkerUnderTest worker({"--model", model->string()}, {"--kvrelay-socket", (dir / "missing.sock").string()});
  const auto reply =
      complete(worker.port(), {{"prompt", json::array({1, 2, 3})}, {"max_tokens", 4}, {"temperature", 0}});
  CHECK(reply["choices"][0]["token_ids"].size() == 4);
  CHECK(reply["kvrelay"]["cached_tokens"] == 0);
}
