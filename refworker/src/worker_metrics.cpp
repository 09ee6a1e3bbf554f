#include "kvrelay/refworker/worker_metrics.h"

#include <fmt/format.h>

namespace kvrelay::refworker {

void WorkerMetrics::set_waiting(std::uint64_t waiting) {
  std::lock_guard lock(mutex_);
  waiting_ = waiting;
}

void WorkerMetrics::set_running(std::uint64_t running) {
  std::lock_guard lock(mutex_);
  running_ = running;
}

void LatencyHistogram::observe(double seconds) {
  for (std::size_t i = 0; i < bounds_.size(); ++i) {
    if (seconds <= bounds_[i]) ++counts_[i];
  }
  ++count_;
  sum_ += seconds;
}

void LatencyHistogram::render(std::string& out, std::string_view name, std::string_view help,
                              std::string_view label) const {
  out += fmt::format("# HELP {0} {1}\n# TYPE {0} histogram\n", name, help);
  for (std::size_t i = 0; i < bounds_.size(); ++i) {
    out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, label, bounds_[i], counts_[i]);
  }
  out += fmt::format("{}_bucket{{{},le=\"+Inf\"}} {}\n", name, label, count_);
  out += fmt::format("{}_sum{{{}}} {}\n", name, label, sum_);
  out += fmt::format("{}_count{{{}}} {}\n", name, label, count_);
}

void WorkerMetrics::observe_ttft(double seconds) {
  std::lock_guard lock(mutex_);
  ttft_.observe(seconds);
}

void WorkerMetrics::observe_time_per_output_token(double seconds) {
  std::lock_guard lock(mutex_);
  tpot_.observe(seconds);
}

void WorkerMetrics::add_request(std::uint64_t prompt_tokens, std::uint64_t generation_tokens,
                                std::uint64_t cached_tokens, std::string_view finished_reason) {
  std::lock_guard lock(mutex_);
  prompt_tokens_ += prompt_tokens;
  generation_tokens_ += generation_tokens;
  cached_tokens_ += cached_tokens;
  if (finished_reason == "stop") {
    ++finished_stop_;
  } else if (finished_reason == "length") {
    ++finished_length_;
  } else {
    ++failed_;
  }
}

std::string WorkerMetrics::render(const std::string& model_name) const {
  std::lock_guard lock(mutex_);
  const std::string label = fmt::format("model_name=\"{}\"", model_name);
  std::string out;
  auto gauge = [&](const char* name, const char* help, std::uint64_t value) {
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} gauge\n{0}{{{2}}} {3}\n", name, help, label, value);
  };
  auto counter = [&](const char* name, const char* help, std::uint64_t value) {
    out += fmt::format("# HELP {0} {1}\n# TYPE {0} counter\n{0}{{{2}}} {3}\n", name, help, label, value);
  };
  gauge("vllm:num_requests_running", "Requests being run by the model thread.", running_);
  gauge("vllm:num_requests_waiting", "Requests queued for the model thread.", waiting_);
  counter("vllm:prompt_tokens_total", "Prompt tokens of finished requests.", prompt_tokens_);
  counter("vllm:generation_tokens_total", "Generated tokens of finished requests.", generation_tokens_);
  counter("vllm:prefix_cache_hits_total", "Prompt tokens whose KV was imported rather than computed.", cached_tokens_);
  out += fmt::format(
      "# HELP vllm:request_success_total Finished requests by finish reason.\n"
      "# TYPE vllm:request_success_total counter\n"
      "vllm:request_success_total{{{0},finished_reason=\"stop\"}} {1}\n"
      "vllm:request_success_total{{{0},finished_reason=\"length\"}} {2}\n",
      label, finished_stop_, finished_length_);
  counter("refworker:request_failure_total", "Requests that failed or were cancelled.", failed_);
  ttft_.render(out, "vllm:time_to_first_token_seconds", "Time from request arrival to its first token.", label);
  tpot_.render(out, "vllm:time_per_output_token_seconds", "Time between two consecutive output tokens.", label);
  return out;
}

}  // namespace kvrelay::refworker
