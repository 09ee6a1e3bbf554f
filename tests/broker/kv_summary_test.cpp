// Issue #28, the summary medium (docs/summary.md), end to end: the front proxy asks A's own
// worker for a summary of the handed-off span and B prefills it in place of A's context; the
// decision log and kvrelay_summaries_total record it; it crosses models whose fingerprints
// differ; the online audit randomises it. Real processes: reference workers behind one sidecar.
// On the tokenizer-less stories260K a "summary" is a greedy continuation of the span's token
// ids: these tests prove the mechanics, not summary quality.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "support/kv_path_fixture.h"
#include "support/skip.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr int kSummaryPromptTokens = 100;  // A's prompt
constexpr int kSummaryAnswerTokens = 60;   // A's answer: its published KV covers 159 tokens, 9 whole blocks
constexpr int kSummarySpanTokens = 144;    // what a summary replaces
constexpr int kSummaryBudget = 24;
constexpr const char* kSummaryRoute = "writer-to-reader";

// Prometheus counter of a worker's metrics page (one sample, the model's label).
double worker_counter(std::uint16_t port, const std::string& name) {
  const auto reply = http_request(port, "GET", "/metrics");
  REQUIRE(reply.status == 200);
  std::istringstream lines(reply.body);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name + "{", 0) == 0) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  FAIL("no " << name << " on the worker's metrics page");
  return 0.0;
}

// The newest {"kind": "summary"} record of the request, null when none.
json summary_record(const Sidecar& node, const std::string& request_id = "") {
  for (const auto& decision : node.decisions(200)) {
    if (decision.value("kind", "") != "summary") continue;
    if (request_id.empty() || decision.value("request_id", "") == request_id) return decision;
  }
  return nullptr;
}

json summary_route_json(json extra) {
  json route{
      {"id", kSummaryRoute}, {"from", "writer"}, {"to", "reader"}, {"summary", {{"max_tokens", kSummaryBudget}}}};
  for (const auto& [key, value] : extra.items())
    route[key] = value;
  return route;
}

json lookup_record(const Sidecar& node, const std::string& agent) {
  for (const auto& decision : node.decisions(200)) {
    if (decision.value("kind", "") == "lookup" && decision.value("agent", "") == agent) return decision;
  }
  return nullptr;
}

// A's turn, then B's request through the front proxy with A's context and a follow-up; the
// summary record of B's request.
struct Handoff {
  json b_prompt;
  json answer;
  json record;
};
Handoff hand_off(const Sidecar& node, int seed) {
  const auto a_prompt = context_prompt(seed, kSummaryPromptTokens);
  const auto a = node.complete("writer", greedy(a_prompt, kSummaryAnswerTokens, true));
  Handoff handoff;
  handoff.b_prompt = handoff_prompt(a_prompt, a);
  handoff.answer = node.complete("reader", greedy(handoff.b_prompt, 6, true));
  handoff.record = summary_record(node);
  return handoff;
}

// An OpenAI-style upstream in the test process that answers every completion with the text
// "the plan ships" and keeps each request body: A's worker (the summariser) and B's at once.
class TextUpstream {
 public:
  TextUpstream() {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
        ::listen(listener_, 16) != 0 || ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      throw std::runtime_error("text upstream: cannot listen");
    }
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~TextUpstream() {
    stopping_ = true;
    thread_.join();
    ::close(listener_);
  }
  TextUpstream(const TextUpstream&) = delete;
  TextUpstream& operator=(const TextUpstream&) = delete;

  [[nodiscard]] std::uint16_t port() const { return port_; }
  [[nodiscard]] std::vector<json> bodies() {
    std::lock_guard lock(mutex_);
    std::vector<json> parsed;
    for (const auto& body : bodies_)
      parsed.push_back(json::parse(body));
    return parsed;
  }

 private:
  void serve() {
    while (!stopping_) {
      pollfd ready{listener_, POLLIN, 0};
      if (::poll(&ready, 1, 50) <= 0) continue;
      const int connection = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (connection < 0) continue;
      answer(connection);
      ::close(connection);
    }
  }
  void answer(int connection) {
    std::string request;
    char buffer[4096];
    std::size_t body_start = std::string::npos;
    std::size_t content_length = 0;
    while (body_start == std::string::npos || request.size() < body_start + content_length) {
      const auto got = ::recv(connection, buffer, sizeof(buffer), 0);
      if (got <= 0) return;
      request.append(buffer, static_cast<std::size_t>(got));
      if (body_start == std::string::npos) {
        const auto end = request.find("\r\n\r\n");
        if (end == std::string::npos) continue;
        body_start = end + 4;
        std::string headers = request.substr(0, end);
        for (auto& c : headers)
          c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        if (const auto at = headers.find("content-length:"); at != std::string::npos) {
          content_length = std::stoul(headers.substr(at + 15));
        }
      }
    }
    {
      std::lock_guard lock(mutex_);
      bodies_.push_back(request.substr(body_start, content_length));
    }
    const std::string reply_body = R"({"choices":[{"text":"the plan ships"}],"usage":{"completion_tokens":3}})";
    const std::string reply =
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
        "Content-Length: " +
        std::to_string(reply_body.size()) + "\r\n\r\n" + reply_body;
    [[maybe_unused]] const auto sent = ::send(connection, reply.data(), reply.size(), MSG_NOSIGNAL);
  }

  int listener_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::mutex mutex_;
  std::vector<std::string> bodies_;
  std::thread thread_;
};

}  // namespace

TEST_CASE("summary forced: A's worker summarises the span and B prefills the summary and its follow-up",
          "[proxy][kv_path][summary][process][audit_live]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  Sidecar node{"node-1"};
  RefworkerUnderTest writer({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  RefworkerUnderTest reader({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  const json agents = json::array({agent_json("writer", "", writer.port(), stories_model_json()),
                                   agent_json("reader", "", reader.port(), stories_model_json())});
  node.start(sidecar_policy(node, agents, json::array({summary_route_json({{"forced_medium", "summary"}})})));

  const auto a_prompt = context_prompt(700, kSummaryPromptTokens);
  const auto a = node.complete("writer", greedy(a_prompt, kSummaryAnswerTokens, true));
  const double writer_prompts_before = worker_counter(writer.port(), "vllm:prompt_tokens_total");
  const auto b_prompt = handoff_prompt(a_prompt, a);
  const auto answer = node.complete("reader", greedy(b_prompt, 6, true));
  CHECK(answer["choices"][0]["token_ids"].size() == 6);

  const auto record = summary_record(node);
  INFO(record.dump());
  REQUIRE(record.is_object());
  CHECK(record["outcome"] == "summarised");
  CHECK(record["source"] == "forced");
  CHECK(record["route"] == kSummaryRoute);
  CHECK(record["prompt"] == "token_ids");
  CHECK(record["span_from"] == "published_kv");
  CHECK(record["span_tokens"] == kSummarySpanTokens);
  const auto summary_tokens = record["summary_tokens"].get<int>();
  CHECK(summary_tokens >= 1);
  CHECK(summary_tokens <= kSummaryBudget);
  CHECK(record["bytes"] == 4 * summary_tokens);
  CHECK(record["summariser_ms"].get<double>() > 0.0);
  // The summariser was A's own worker: its upstream, and the span's ids reached it.
  CHECK(record["summariser"] == "http://127.0.0.1:" + std::to_string(writer.port()) + "/v1/completions");
  CHECK(worker_counter(writer.port(), "vllm:prompt_tokens_total") - writer_prompts_before == kSummarySpanTokens);
  // The engine priced it beside the others (the forced medium is the route's, not the engine's).
  REQUIRE(record["cost"].is_object());
  bool priced = false;
  for (const auto& candidate : record["cost"]["candidates"]) {
    if (candidate["medium"] == "summary") {
      priced = true;
      CHECK(candidate["wire_bytes"] == 4.0 * kSummaryBudget);
      CHECK(candidate["c_comp_s"].get<double>() > 0.0);
    }
  }
  CHECK(priced);

  // B prefilled the summary and the rest of its prompt (A's last partial block and the follow-up).
  const int rest = static_cast<int>(b_prompt.size()) - kSummarySpanTokens;
  CHECK(answer["usage"]["prompt_tokens"] == summary_tokens + rest);
  CHECK(answer["kvrelay"]["cached_tokens"] == 0);
  CHECK(record["b_prompt_tokens"] == summary_tokens + rest);
  // B's lookup knew: no KV for a summarised request.
  const auto lookup = lookup_record(node, "reader");
  INFO(lookup.dump());
  REQUIRE(lookup.is_object());
  CHECK(lookup["outcome"] == "summary");
  CHECK(lookup["medium"] == "summary");
  CHECK(lookup["summary"]["summary_tokens"] == summary_tokens);
  CHECK(node.metric_sum("kvrelay_summaries_total", {"route=\"writer-to-reader\"", "outcome=\"summarised\""}) == 1.0);
  CHECK(node.metric_sum("kvrelay_kv_lookups_total", {"outcome=\"summary\""}) == 1.0);

  // A summariser that cannot answer: B gets its original request (the tokens medium), logged.
  auto broken = summary_route_json({{"forced_medium", "summary"}});
  broken["summary"]["summariser"] = "http://127.0.0.1:1";
  node.reload(sidecar_policy(node, agents, json::array({broken})));
  const auto handoff = hand_off(node, 701);
  INFO(handoff.record.dump());
  REQUIRE(handoff.record.is_object());
  CHECK(handoff.record["outcome"] == "failed");
  CHECK_THAT(handoff.record["error"].get<std::string>(), Catch::Contains("connect"));
  CHECK(handoff.answer["usage"]["prompt_tokens"] == handoff.b_prompt.size());
  CHECK(node.metric_sum("kvrelay_summaries_total", {"outcome=\"failed\""}) == 1.0);
}

TEST_CASE("summary crosses models whose fingerprints differ, where the engine excludes every KV medium",
          "[proxy][kv_path][summary][process][audit_live]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  Sidecar node{"node-1"};
  RefworkerUnderTest writer({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  // vocab 512, as stories260K's: the summary's ids are B's too.
  RefworkerUnderTest reader({"--synthetic", kTinySyntheticShape, "--seed", "3"},
                            {"--kvrelay-socket", node.socket_path()});
  const json agents = json::array({agent_json("writer", "", writer.port(), stories_model_json()),
                                   agent_json("reader", "", reader.port(), tiny_synthetic_model_json())});
  auto policy = sidecar_policy(
      node, agents, json::array({summary_route_json({{"allowed_media", {"tokens", "kv_raw", "kv_int8", "summary"}}})}));
  // The engine's priors make B's re-prefill dear and A's decoding cheap: it picks the summary itself.
  policy["cost_model"] = {
      {"agents",
       {{"reader", {{"prefill_s", {{"a", 0.01}, {"b", 0.01}, {"c", 0.0}}}, {"decode_s_per_token", 0.001}}},
        {"writer", {{"decode_s_per_token", 0.001}}}}}};
  node.start(policy);

  const auto handoff = hand_off(node, 710);
  const auto& record = handoff.record;
  INFO(record.dump());
  REQUIRE(record.is_object());
  CHECK(record["outcome"] == "summarised");
  CHECK(record["source"] == "engine");
  CHECK(record["span_tokens"] == kSummarySpanTokens);
  std::map<std::string, std::string> lost;
  for (const auto& candidate : record["cost"]["candidates"]) {
    lost[candidate["medium"].get<std::string>()] = candidate.value("lost_because", std::string());
  }
  CHECK(lost["kv_raw"] == "fingerprint_mismatch");
  CHECK(lost["kv_int8"] == "fingerprint_mismatch");
  CHECK(lost["summary"].empty());  // chosen
  CHECK(handoff.answer["choices"][0]["token_ids"].size() == 6);
  const int rest = static_cast<int>(handoff.b_prompt.size()) - kSummarySpanTokens;
  CHECK(handoff.answer["usage"]["prompt_tokens"] == record["summary_tokens"].get<int>() + rest);
  const auto lookup = lookup_record(node, "reader");
  INFO(lookup.dump());
  CHECK(lookup["medium"] == "summary");
  CHECK(lookup["source"] == "engine");
}

TEST_CASE("the online audit randomises summary against tokens, and trials are delivered as assigned",
          "[proxy][audit][kv_path][summary][process][audit_live]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  Sidecar node{"node-1"};
  RefworkerUnderTest writer({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  RefworkerUnderTest reader({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  TempDir dir;
  const auto trials_file = dir / "trials.jsonl";
  const json agents = json::array({agent_json("writer", "", writer.port(), stories_model_json()),
                                   agent_json("reader", "", reader.port(), stories_model_json())});
  const json audit{{"fraction", 1.0},
                   {"trials_file", trials_file.string()},
                   {"treatments", json::array({{{"name", "T0"}, {"medium", "tokens"}, {"span", "none"}},
                                               {{"name", "S"}, {"medium", "summary"}, {"span", "all"}}})}};
  node.start(sidecar_policy(node, agents, json::array({summary_route_json({{"audit", audit}})})));

  for (int seed = 0; seed < 10; ++seed)
    CHECK(hand_off(node, 720 + seed).answer["choices"][0]["token_ids"].size() == 6);
  std::map<std::string, std::string> assigned;
  std::map<std::string, json> outcomes;
  std::istringstream lines(trials_with_outcomes(trials_file, 10));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    const auto entry = json::parse(line);
    if (entry.value("event", "") == "assignment") assigned[entry["request_id"]] = entry["treatment"];
    if (entry.value("event", "") == "outcome") outcomes[entry["request_id"]] = entry;
  }
  REQUIRE(assigned.size() == 10);
  REQUIRE(outcomes.size() == 10);
  std::map<std::string, int> counts;
  for (const auto& [request_id, treatment] : assigned) {
    INFO(request_id << " assigned " << treatment);
    const auto& outcome = outcomes.at(request_id);
    INFO(outcome.dump());
    ++counts[treatment];
    CHECK(outcome.value("delivered_treatment", std::string("(none recorded)")) == treatment);
    CHECK(outcome.value("delivery_reason", std::string()).empty());
    CHECK(outcome["cached_tokens"] == 0);
    const auto record = summary_record(node, request_id);
    if (treatment == "S") {
      REQUIRE(record.is_object());
      CHECK(record["source"] == "treatment");
      CHECK(record["outcome"] == "summarised");
      CHECK(outcome["prompt_tokens"] == record["b_prompt_tokens"]);
      // The client waited for the summariser: the trial's time to first token includes it.
      CHECK(outcome["ttft_ms"].get<double>() >= record["summariser_ms"].get<double>());
    } else {
      CHECK(record.is_null());
    }
  }
  CHECK(counts["T0"] >= 1);
  CHECK(counts["S"] >= 1);
}

TEST_CASE("summary of a text prompt: the client's handoff_chars names A's context, the route's template carries it",
          "[proxy][summary][process]") {
  TextUpstream upstream;
  Sidecar node{"node-1"};
  const json agents = json::array({agent_json("writer", "", upstream.port(), stories_model_json()),
                                   agent_json("reader", "", upstream.port(), tiny_synthetic_model_json())});
  auto route = summary_route_json({{"forced_medium", "summary"}});
  route["summary"]["template"] = "[Earlier: {summary}]";
  route["summary"]["instruction"] = "\nIn short:";
  node.start(sidecar_policy(node, agents, json::array({route})));

  const std::string context = "The planner wrote a long plan. ";  // 31 characters, A's context
  const json request{{"prompt", context + "Review it."},
                     {"max_tokens", 4},
                     {"kv_transfer_params", {{"kvrelay", {{"handoff_chars", context.size()}}}}}};
  const auto reply = http_request(node.http_port(), "POST", "/agents/reader/v1/completions", request.dump());
  REQUIRE(reply.status == 200);
  auto bodies = upstream.bodies();
  REQUIRE(bodies.size() == 2);
  // First the summariser (A's upstream): the span and the route's instruction, greedy, the budget.
  CHECK(bodies[0]["prompt"] == context + "\nIn short:");
  CHECK(bodies[0]["max_tokens"] == kSummaryBudget);
  CHECK(bodies[0]["temperature"] == 0);
  // Then B: the template with the summary in place of the span, and kvrelay fields saying so.
  CHECK(bodies[1]["prompt"] == "[Earlier: the plan ships]Review it.");
  CHECK(bodies[1]["max_tokens"] == 4);
  const auto& summary = bodies[1]["kv_transfer_params"]["kvrelay"]["summary"];
  CHECK(summary["span_chars"] == context.size());
  CHECK(summary["summary_tokens"] == 3);
  CHECK(summary["source"] == "forced");
  const auto record = summary_record(node);
  INFO(record.dump());
  CHECK(record["outcome"] == "summarised");
  CHECK(record["prompt"] == "text");
  CHECK(record["bytes"] == std::string("the plan ships").size());

  // Without the hint a text prompt is not summarised: B gets it as sent, and the log says why.
  const json plain{{"prompt", context + "Review it."}, {"max_tokens", 4}};
  REQUIRE(http_request(node.http_port(), "POST", "/agents/reader/v1/completions", plain.dump()).status == 200);
  bodies = upstream.bodies();
  REQUIRE(bodies.size() == 3);
  CHECK(bodies[2]["prompt"] == context + "Review it.");
  const auto skipped = summary_record(node);
  CHECK(skipped["outcome"] == "skipped");
  CHECK_THAT(skipped["error"].get<std::string>(), Catch::Contains("handoff_chars"));
  CHECK(node.metric_sum("kvrelay_summaries_total", {"outcome=\"skipped\""}) == 1.0);
}
