#include "kvrelay/refworker/completion_api.h"

#include <catch2/catch.hpp>

#include <chrono>

#include "kvrelay/refworker/worker_metrics.h"

namespace kr = kvrelay::refworker;
using kvrelay::ErrorCode;

namespace {

const kr::CompletionLimits kLimits{512, 512};

ErrorCode parse_error(const std::string& body) {
  auto parsed = kr::parse_completion_request(body, kLimits);
  REQUIRE_FALSE(parsed);
  INFO(parsed.error().message);
  CHECK_FALSE(parsed.error().message.empty());
  return parsed.error().code;
}

}  // namespace

TEST_CASE("refworker completion request: fields are read and defaults are OpenAI's", "[refworker][api]") {
  auto parsed = kr::parse_completion_request(
      R"({"model":"m","prompt":[1,5,511],"max_tokens":7,"temperature":0,"seed":9,"stream":true,"top_k":40,
          "ignore_eos":true,"kv_transfer_params":{"kvrelay":{"request_id":"r1","agent":"b"}}})",
      kLimits);
  REQUIRE(parsed);
  const auto& request = parsed.value();
  CHECK(request.model == "m");
  CHECK(request.prompt == std::vector<std::int32_t>{1, 5, 511});
  CHECK(request.generation.max_tokens == 7);
  CHECK(request.generation.sampling.temperature == 0.0F);
  CHECK(request.generation.sampling.seed == 9);
  CHECK(request.generation.sampling.top_k == 40);
  CHECK_FALSE(request.generation.stop_at_eos);
  CHECK(request.stream);
  CHECK(request.kvrelay_params["agent"] == "b");

  auto defaults = kr::parse_completion_request(R"({"prompt":[[1,2]]})", kLimits);
  REQUIRE(defaults);
  CHECK(defaults.value().prompt == std::vector<std::int32_t>{1, 2});
  CHECK(defaults.value().generation.max_tokens == 16);
  CHECK(defaults.value().generation.sampling.temperature == 1.0F);
  CHECK(defaults.value().generation.stop_at_eos);
  CHECK_FALSE(defaults.value().stream);
  CHECK(defaults.value().kvrelay_params.is_null());
}

TEST_CASE("refworker completion request: malformed input is rejected field by field", "[refworker][api]") {
  CHECK(parse_error("{") == ErrorCode::kInvalidArgument);
  CHECK(parse_error("[1,2]") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"max_tokens":3})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":"hello"})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[]})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[1,"2"]})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[1,2.5]})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[1,512]})") == ErrorCode::kOutOfRange);
  CHECK(parse_error(R"({"prompt":[-1]})") == ErrorCode::kOutOfRange);
  CHECK(parse_error(R"({"prompt":[[1],[2]]})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[1],"max_tokens":0})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[1],"max_tokens":"5"})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[1,2,3],"max_tokens":510})") == ErrorCode::kOutOfRange);
  CHECK(parse_error(R"({"prompt":[1],"temperature":-0.5})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[1],"temperature":"hot"})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[1],"seed":-3})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[1],"stream":"yes"})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[1],"top_k":-5})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[1],"kv_transfer_params":3})") == ErrorCode::kInvalidArgument);
  CHECK(parse_error(R"({"prompt":[1],"model":5})") == ErrorCode::kInvalidArgument);
}

TEST_CASE("refworker text is a byte-level rendering of the ids", "[refworker][api]") {
  const std::vector<std::int32_t> ids = {1, 'H' + 3, 'i' + 3, 2, 300, 3 + 0xC3, 3 + 0xA9};
  CHECK(kr::render_tokens(ids) == "Hi<300>\xC3\xA9");
  // Raw bytes that are not UTF-8 must still serialize.
  const std::vector<std::int32_t> invalid = {3 + 0xFF, 3 + 'a'};
  kr::CompletionOutcome outcome;
  outcome.generation.tokens = invalid;
  const auto body = kr::dump_json(kr::completion_response({"cmpl-1", 1, "m"}, outcome));
  CHECK(body.find("\"token_ids\":[258,100]") != std::string::npos);
  CHECK(kr::sse_event(kr::stream_token_event({"cmpl-1", 1, "m"}, 258)).rfind("data: {", 0) == 0);
}

TEST_CASE("refworker metrics render vLLM's names with cumulative TTFT buckets", "[refworker][api]") {
  kr::WorkerMetrics metrics;
  metrics.set_waiting(3);
  metrics.observe_ttft(0.003);
  metrics.observe_ttft(0.3);
  metrics.observe_time_per_output_token(0.02);
  metrics.observe_time_per_output_token(0.2);
  metrics.add_request(10, 4, 2, "length");
  metrics.add_request(5, 1, 0, "stop");
  metrics.add_request(0, 0, 0, "");
  const auto text = metrics.render("m");
  CHECK(text.find("vllm:num_requests_waiting{model_name=\"m\"} 3\n") != std::string::npos);
  CHECK(text.find("vllm:num_requests_running{model_name=\"m\"} 0\n") != std::string::npos);
  CHECK(text.find("vllm:prompt_tokens_total{model_name=\"m\"} 15\n") != std::string::npos);
  CHECK(text.find("vllm:generation_tokens_total{model_name=\"m\"} 5\n") != std::string::npos);
  CHECK(text.find("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.001\"} 0\n") != std::string::npos);
  CHECK(text.find("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.005\"} 1\n") != std::string::npos);
  CHECK(text.find("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"0.5\"} 2\n") != std::string::npos);
  CHECK(text.find("vllm:time_to_first_token_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 2\n") != std::string::npos);
  CHECK(text.find("vllm:time_to_first_token_seconds_count{model_name=\"m\"} 2\n") != std::string::npos);
  CHECK(text.find("vllm:time_per_output_token_seconds_bucket{model_name=\"m\",le=\"0.01\"} 0\n") != std::string::npos);
  CHECK(text.find("vllm:time_per_output_token_seconds_bucket{model_name=\"m\",le=\"0.025\"} 1\n") != std::string::npos);
  CHECK(text.find("vllm:time_per_output_token_seconds_bucket{model_name=\"m\",le=\"0.2\"} 2\n") != std::string::npos);
  CHECK(text.find("vllm:time_per_output_token_seconds_count{model_name=\"m\"} 2\n") != std::string::npos);
  CHECK(text.find("vllm:request_success_total{model_name=\"m\",finished_reason=\"length\"} 1\n") != std::string::npos);
  CHECK(text.find("refworker:request_failure_total{model_name=\"m\"} 1\n") != std::string::npos);
  // No capacity reported yet: nothing held, and the series is there for probes all the same.
  CHECK(text.find("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name=\"m\"} 0\n") !=
        std::string::npos);
  CHECK(text.find("# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total ") != std::string::npos);
}

TEST_CASE("refworker metrics: kv_cache_usage_perc is held over capacity, within 0..1", "[refworker][api]") {
  kr::WorkerMetrics metrics;
  metrics.set_kv_cache(1024, 4096);
  CHECK(metrics.render("m").find("vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n") != std::string::npos);
  metrics.set_kv_cache(8192, 4096);  // never claims more than full
  CHECK(metrics.render("m").find("vllm:kv_cache_usage_perc{model_name=\"m\"} 1\n") != std::string::npos);
  metrics.set_kv_cache(0, 4096);
  CHECK(metrics.render("m").find("vllm:kv_cache_usage_perc{model_name=\"m\"} 0\n") != std::string::npos);
}

TEST_CASE("refworker metrics: process_cpu_seconds_total counts this process's CPU time", "[refworker][api]") {
  const double before = kr::process_cpu_seconds();
  // Burn ~50 ms of CPU (bounded by wall time, in case the clock is coarse).
  volatile double sink = 0.0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (kr::process_cpu_seconds() < before + 0.05 && std::chrono::steady_clock::now() < deadline) {
    for (int i = 0; i < 100000; ++i)
      sink = sink + 1.0;
  }
  const double after = kr::process_cpu_seconds();
  CHECK(after >= before + 0.05);
  // The page carries the same counter, unlabelled as client libraries export it.
  const auto page = kr::WorkerMetrics{}.render("m");
  const std::string series = "\nprocess_cpu_seconds_total ";
  const auto at = page.find(series);
  REQUIRE(at != std::string::npos);
  CHECK(std::stod(page.substr(at + series.size())) >= after);
}
