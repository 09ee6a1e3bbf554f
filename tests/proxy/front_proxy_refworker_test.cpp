// The front proxy in front of a real upstream: the reference worker in its own process.
#include <nlohmann/json.hpp>

#include <future>
#include <sstream>

#include "support/daemon_fixture.h"
#include "support/refworker_process.h"
#include "support/skip.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

json model_fingerprint() {
  return {{"architecture", "llama"}, {"layers", 5},     {"kv_heads", 4},
          {"head_dim", 8},           {"dtype", "fp32"}, {"weights", "stories260K"}};
}

json proxy_policy(std::uint16_t upstream_port) {
  auto policy = basic_daemon_policy();
  policy["limits"]["read_timeout_ms"] = 10000;
  const auto upstream = "http://127.0.0.1:" + std::to_string(upstream_port);
  policy["agents"] = {
      {{"id", "plain"}, {"upstream", upstream}, {"model", model_fingerprint()}},
      {{"id", "connected"}, {"upstream", upstream}, {"model", model_fingerprint()}, {"kv_connector", true}}};
  return policy;
}

// SSE events with the fields that differ between any two runs (ids, clocks, timings) removed.
std::vector<std::string> stable_events(const std::string& body) {
  std::vector<std::string> events;
  std::istringstream lines(body);
  std::string line;
  while (std::getline(lines, line)) {
    if (line.rfind("data: ", 0) != 0) continue;
    const auto payload = line.substr(6);
    if (payload == "[DONE]") {
      events.push_back(payload);
      continue;
    }
    auto event = json::parse(payload);
    event.erase("id");
    event.erase("created");
    event.erase("kvrelay");
    events.push_back(event.dump());
  }
  return events;
}

}  // namespace

TEST_CASE("streamed completions pass through kvrelay event for event", "[proxy][front][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  RefworkerUnderTest worker({"--model", model->string()});
  DaemonUnderTest daemon(proxy_policy(worker.port()));
  const std::string request = R"({"prompt": [1], "max_tokens": 24, "stream": true, "temperature": 0})";

  const auto direct = http_request(worker.port(), "POST", "/v1/completions", request);
  const auto relayed = http_request(daemon.http_port(), "POST", "/agents/plain/v1/completions", request);
  REQUIRE(direct.status == 200);
  REQUIRE(relayed.status == 200);
  CHECK(relayed.headers.at("content-type") == direct.headers.at("content-type"));
  const auto direct_events = stable_events(direct.body);
  CHECK(direct_events.size() == 24 + 2);  // one per token, the closing usage event, [DONE]
  CHECK(stable_events(relayed.body) == direct_events);
  // Same framing byte for byte: only the volatile values differ in length, nothing else.
  CHECK(std::count(relayed.body.begin(), relayed.body.end(), '\n') ==
        std::count(direct.body.begin(), direct.body.end(), '\n'));
}

TEST_CASE("non-streamed completions, models and kv_transfer_params reach the upstream", "[proxy][front][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  RefworkerUnderTest worker({"--model", model->string()});
  DaemonUnderTest daemon(proxy_policy(worker.port()));
  // The connected agent's body gains kv_transfer_params; the worker must still answer normally
  // and greedily reproduce the trained model's reference continuation.
  const auto reply =
      http_request(daemon.http_port(), "POST", "/agents/connected/v1/completions",
                   R"({"prompt": [1], "max_tokens": 8, "temperature": 0})", {{"X-Request-Id", "req-42"}});
  REQUIRE(reply.status == 200);
  const auto body = json::parse(reply.body);
  CHECK(body["choices"][0]["token_ids"] == json::array({461, 461, 401, 401, 401, 461, 378, 455}));
  CHECK(http_request(daemon.http_port(), "GET", "/agents/plain/v1/models").status == 200);
  // Upstream errors pass back with their status.
  const auto bad = http_request(daemon.http_port(), "POST", "/agents/plain/v1/completions", R"({"prompt": "text"})");
  CHECK(bad.status == http_request(worker.port(), "POST", "/v1/completions", R"({"prompt": "text"})").status);
  CHECK(bad.status >= 400);
}

TEST_CASE("SIGTERM drains: a streaming request already accepted completes", "[proxy][front][process]") {
  // A synthetic model slow enough (about 2 ms per token here) that the request is still
  // streaming when the signal arrives.
  RefworkerUnderTest worker({"--synthetic", "layers=4,dim=256,heads=8,kv_heads=4,ffn=688,vocab=512", "--seed", "7"});
  DaemonUnderTest daemon(proxy_policy(worker.port()));
  auto pending = std::async(std::launch::async, [&] {
    return http_request(daemon.http_port(), "POST", "/agents/plain/v1/completions",
                        R"({"prompt": [1, 2, 3], "max_tokens": 400, "stream": true, "ignore_eos": true})", {},
                        std::chrono::seconds(60));
  });
  // Wait until the worker is generating for this request, then ask kvrelay to stop.
  const auto running = [&] {
    const auto metrics = http_request(worker.port(), "GET", "/metrics").body;
    const auto at = metrics.find("\nvllm:num_requests_running{");
    if (at == std::string::npos) return false;
    const auto value = metrics.find("} ", at);
    return value != std::string::npos && metrics.compare(value + 2, 2, "1\n") == 0;
  };
  REQUIRE(wait_until(running, std::chrono::seconds(20)));
  daemon.process().send_signal(SIGTERM);
  const auto reply = pending.get();
  CHECK(reply.status == 200);
  CHECK_THAT(reply.body, Catch::EndsWith("data: [DONE]\n\n"));
  const auto status = daemon.process().wait_for_exit(std::chrono::seconds(10));
  REQUIRE(status.has_value());
  CHECK(*status == 0);
}
