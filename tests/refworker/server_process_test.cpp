// The real kvrelay-refworker serving over loopback.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <csignal>
#include <future>
#include <regex>

#include "kvrelay/refworker/completion_api.h"

#include "skip.h"
#include "support/http_client.h"
#include "support/refworker_process.h"

using kvrelay::test::http_request;
using kvrelay::test::RefworkerUnderTest;
using nlohmann::json;

namespace {

const std::vector<std::int32_t> kReference = {461, 461, 401, 401, 401, 461, 378, 455, 473, 456, 435,
                                              299, 362, 409, 283, 264, 283, 452, 288, 13,  431, 431,
                                              431, 431, 431, 431, 431, 431, 431, 431, 431, 431};

json post_completion(std::uint16_t port, const json& body, int expected_status = 200) {
  const auto response = http_request(port, "POST", "/v1/completions", body.dump(),
                                     {{"content-type", "application/json"}}, std::chrono::seconds(60));
  INFO(response.error << " " << response.body);
  REQUIRE(response.status == expected_status);
  return json::parse(response.body);
}

// Reads one Prometheus sample, e.g. vllm:prompt_tokens_total{model_name="x"}.
double metric(std::uint16_t port, const std::string& series) {
  const auto response = http_request(port, "GET", "/metrics");
  REQUIRE(response.status == 200);
  const auto at = response.body.find(series + " ");
  INFO(response.body);
  REQUIRE(at != std::string::npos);
  return std::stod(response.body.substr(at + series.size() + 1));
}

std::vector<json> sse_events(const std::string& body) {
  std::vector<json> events;
  std::size_t at = 0;
  while ((at = body.find("data: ", at)) != std::string::npos) {
    const auto end = body.find("\n\n", at);
    REQUIRE(end != std::string::npos);
    const auto payload = body.substr(at + 6, end - at - 6);
    events.push_back(payload == "[DONE]" ? json("[DONE]") : json::parse(payload));
    at = end + 2;
  }
  return events;
}

struct StoriesServer {
  std::optional<std::filesystem::path> path = kvrelay::test::stories_model_path();
  std::unique_ptr<RefworkerUnderTest> server;
  StoriesServer() {
    if (path) server = std::make_unique<RefworkerUnderTest>(std::vector<std::string>{"--model", path->string()});
  }
};

}  // namespace

TEST_CASE("refworker server: greedy completion reproduces the reference and reports prefill", "[refworker][server]") {
  StoriesServer stories;
  if (!stories.server) KVRELAY_SKIP("stories260K.bin not found");
  const auto port = stories.server->port();
  const json response =
      post_completion(port, {{"prompt", {1}}, {"max_tokens", 32}, {"temperature", 0}, {"ignore_eos", true}});
  const auto& choice = response["choices"][0];
  CHECK(choice["token_ids"].get<std::vector<std::int32_t>>() == kReference);
  CHECK(choice["finish_reason"] == "length");
  CHECK(response["object"] == "text_completion");
  CHECK(response["model"] == "stories260K");
  // Token 13 is byte 0x0A; merges render as <id>.
  std::string expected_text;
  for (const auto id : kReference)
    expected_text += id == 13 ? std::string("\n") : "<" + std::to_string(id) + ">";
  CHECK(choice["text"] == expected_text);
  CHECK(response["usage"]["prompt_tokens"] == 1);
  CHECK(response["usage"]["completion_tokens"] == 32);
  CHECK(response["usage"]["total_tokens"] == 33);
  CHECK(response["kvrelay"]["prefill_tokens"] == 1);
  CHECK(response["kvrelay"]["cached_tokens"] == 0);
  CHECK(response["kvrelay"]["prefill_ms"].get<double>() >= 0.0);

  // A longer prompt continues consistently: prompt = BOS + first 10 reference ids.
  std::vector<std::int32_t> prompt{1};
  prompt.insert(prompt.end(), kReference.begin(), kReference.begin() + 10);
  const json continued =
      post_completion(port, {{"prompt", prompt},
                             {"max_tokens", 8},
                             {"temperature", 0},
                             {"ignore_eos", true},
                             {"kv_transfer_params", {{"kvrelay", {{"request_id", "r-1"}, {"agent", "b"}}}}}});
  CHECK(continued["choices"][0]["token_ids"].get<std::vector<std::int32_t>>() ==
        std::vector<std::int32_t>(kReference.begin() + 10, kReference.begin() + 18));
  CHECK(continued["kvrelay"]["prefill_tokens"] == 11);
}

TEST_CASE("refworker server: streaming sends one event per token, then usage and [DONE]", "[refworker][server]") {
  StoriesServer stories;
  if (!stories.server) KVRELAY_SKIP("stories260K.bin not found");
  const auto port = stories.server->port();
  const json request = {{"prompt", {1}}, {"max_tokens", 12}, {"temperature", 0}, {"stream", true}};
  const auto response = http_request(port, "POST", "/v1/completions", request.dump());
  REQUIRE(response.status == 200);
  CHECK(response.headers.at("content-type") == "text/event-stream");
  const auto events = sse_events(response.body);
  REQUIRE(events.size() == 12 + 2);
  std::vector<std::int32_t> streamed;
  for (std::size_t i = 0; i < 12; ++i) {
    const auto& choice = events[i]["choices"][0];
    REQUIRE(choice["token_ids"].size() == 1);
    CHECK(choice["finish_reason"].is_null());
    streamed.push_back(choice["token_ids"][0].get<std::int32_t>());
  }
  CHECK(streamed == std::vector<std::int32_t>(kReference.begin(), kReference.begin() + 12));
  CHECK(events[12]["choices"][0]["finish_reason"] == "length");
  CHECK(events[12]["usage"]["completion_tokens"] == 12);
  CHECK(events[12]["kvrelay"]["prefill_tokens"] == 1);
  CHECK(events[13] == "[DONE]");
  CHECK(response.body.substr(response.body.size() - 14) == "data: [DONE]\n\n");

  // The connection is still usable after a stream: the server speaks keep-alive chunked SSE.
  CHECK(http_request(port, "GET", "/healthz").status == 200);
}

TEST_CASE("refworker server: seeded sampling is reproducible per seed", "[refworker][server]") {
  StoriesServer stories;
  if (!stories.server) KVRELAY_SKIP("stories260K.bin not found");
  const auto port = stories.server->port();
  auto sample = [&](int seed) {
    const json response = post_completion(
        port, {{"prompt", {1}}, {"max_tokens", 24}, {"temperature", 1.0}, {"seed", seed}, {"ignore_eos", true}});
    return response["choices"][0]["token_ids"].get<std::vector<std::int32_t>>();
  };
  CHECK(sample(11) == sample(11));
  CHECK(sample(11) != sample(12));
}

TEST_CASE("refworker server: bad requests get OpenAI-style errors", "[refworker][server]") {
  StoriesServer stories;
  if (!stories.server) KVRELAY_SKIP("stories260K.bin not found");
  const auto port = stories.server->port();
  auto error_of = [&](const std::string& body, int status) {
    const auto response = http_request(port, "POST", "/v1/completions", body);
    INFO(response.body);
    CHECK(response.status == status);
    const auto parsed = json::parse(response.body);
    CHECK(parsed["error"]["code"] == status);
    return parsed["error"]["message"].get<std::string>();
  };
  CHECK(error_of("{not json", 400).find("JSON") != std::string::npos);
  CHECK(error_of(R"({"prompt":"hello"})", 400).find("prompt") != std::string::npos);
  CHECK(error_of(R"({"prompt":[1,9999]})", 400).find("vocabulary") != std::string::npos);
  CHECK(error_of(R"({"prompt":[1],"max_tokens":600})", 400).find("max_tokens") != std::string::npos);
  CHECK(error_of(R"({"prompt":[1],"model":"other"})", 404).find("other") != std::string::npos);
  CHECK(http_request(port, "GET", "/v1/completions").status == 405);
  CHECK(http_request(port, "GET", "/nope").status == 404);
  const auto models = json::parse(http_request(port, "GET", "/v1/models").body);
  CHECK(models["data"][0]["id"] == "stories260K");
  CHECK(models["data"][0]["kvrelay"]["layers"] == 5);
  CHECK(models["data"][0]["kvrelay"]["fingerprint_id"] == stories.server->ready()["fingerprint_id"]);
  CHECK(kvrelay::test::raw_exchange(port, "GARBAGE\r\n\r\n").rfind("HTTP/1.1 400", 0) == 0);
  CHECK(kvrelay::test::raw_exchange(port, "GET /healthz HTTP/1.1\r\nX-Big: " + std::string(20000, 'a') + "\r\n\r\n")
            .rfind("HTTP/1.1 431", 0) == 0);
  // curl's "Expect: 100-continue" gets an immediate go-ahead, then the answer.
  const std::string body = R"({"prompt":[1],"max_tokens":2,"temperature":0})";
  const auto expect = kvrelay::test::raw_exchange(
      port,
      "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nExpect: 100-continue\r\n"
      "Content-Length: " +
          std::to_string(body.size()) + "\r\n\r\n" + body);
  CHECK(expect.rfind("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK", 0) == 0);
  CHECK(expect.find("\"token_ids\":[461,461]") != std::string::npos);
  // The server survived all of it.
  CHECK(post_completion(port, {{"prompt", {1}}, {"max_tokens", 2}})["usage"]["completion_tokens"] == 2);
}

TEST_CASE("refworker server: metrics count tokens and first-token latencies, and SIGTERM exits 0",
          "[refworker][server]") {
  StoriesServer stories;
  if (!stories.server) KVRELAY_SKIP("stories260K.bin not found");
  const auto port = stories.server->port();
  std::uint64_t prompt_tokens = 0;
  std::uint64_t generated = 0;
  for (int i = 1; i <= 3; ++i) {
    const json response = post_completion(
        port,
        {{"prompt", std::vector<int>(static_cast<std::size_t>(i * 5), 1)}, {"max_tokens", i}, {"temperature", 0}});
    prompt_tokens += response["usage"]["prompt_tokens"].get<std::uint64_t>();
    generated += response["usage"]["completion_tokens"].get<std::uint64_t>();
  }
  const std::string label = "{model_name=\"stories260K\"}";
  CHECK(metric(port, "vllm:prompt_tokens_total" + label) == static_cast<double>(prompt_tokens));
  CHECK(metric(port, "vllm:generation_tokens_total" + label) == static_cast<double>(generated));
  CHECK(metric(port, "vllm:time_to_first_token_seconds_count" + label) == 3.0);
  CHECK(metric(port, "vllm:num_requests_waiting" + label) == 0.0);
  CHECK(metric(port, "vllm:num_requests_running" + label) == 0.0);
  CHECK(metric(port, "vllm:kv_cache_usage_perc" + label) == 0.0);  // no request holds KV now
  CHECK(metric(port, "\nprocess_cpu_seconds_total") > 0.0);        // unlabelled; three requests cost CPU
  stories.server->process().send_signal(SIGTERM);
  CHECK(stories.server->process().wait_for_exit(std::chrono::seconds(10)) == 0);
}

TEST_CASE("refworker server: requests queue behind the model thread and are all served", "[refworker][server]") {
  // Big enough that one request runs long enough for others to be seen waiting.
  RefworkerUnderTest server(
      {"--synthetic", "layers=4,dim=256,heads=8,kv_heads=2,ffn=688,vocab=1000,seq_len=1024", "--seed", "3"});
  const auto port = server.port();
  const std::string waiting = "vllm:num_requests_waiting{model_name=\"synthetic\"}";
  std::vector<std::future<json>> requests;
  for (int i = 0; i < 4; ++i) {
    requests.push_back(std::async(std::launch::async, [port] {
      const auto response = http_request(
          port, "POST", "/v1/completions",
          json{{"prompt", std::vector<int>(64, 7)}, {"max_tokens", 300}, {"temperature", 0}, {"ignore_eos", true}}
              .dump(),
          {}, std::chrono::seconds(120));
      return response.status == 200 ? json::parse(response.body) : json{{"status", response.status}};
    }));
  }
  const bool saw_waiting =
      kvrelay::test::wait_until([&] { return metric(port, waiting) >= 1.0; }, std::chrono::seconds(30));
  CHECK(saw_waiting);
  // While a request runs its session holds 64 to 363 tokens of the 1024 one session may hold.
  const std::string kv_usage = "vllm:kv_cache_usage_perc{model_name=\"synthetic\"}";
  double usage = 0.0;
  const bool saw_usage = kvrelay::test::wait_until(
      [&] {
        usage = metric(port, kv_usage);
        return usage > 0.0;
      },
      std::chrono::seconds(30));
  CHECK(saw_usage);
  CHECK(usage >= 64.0 / 1024.0);
  CHECK(usage <= 364.0 / 1024.0);
  std::vector<std::int32_t> first;
  for (auto& request : requests) {
    const json response = request.get();
    INFO(response.dump());
    REQUIRE(response.contains("choices"));
    const auto ids = response["choices"][0]["token_ids"].get<std::vector<std::int32_t>>();
    CHECK(ids.size() == 300);
    if (first.empty()) first = ids;
    CHECK(ids == first);  // same greedy request, same answer, whatever the queueing
  }
  CHECK(metric(port, waiting) == 0.0);
  CHECK(metric(port, kv_usage) == 0.0);
}
