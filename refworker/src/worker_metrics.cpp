#include "kvrelay/refworker/worker_metrics.h"

#include <sys/resource.h>

#include <fmt/format.h>

#include <algorithm>

namespace kvrelay::refworker {

void WorkerMetrics::set_waiting(std::uint64_t waiting) {
  std::lock_guard lock(mutex_);
  waiting_ = waiting;
}

void WorkerMetrics::set_running(std::uint64_t running) {
  std::lock_guard lock(mutex_);
  running_ = running;
}

void WorkerMetrics::set_kv_cache(std::uint64_t held_bytes, std::uint64_t capacity_bytes) {
  std::lock_guard lock(mutex_);
  kv_held_bytes_ = held_bytes;
  kv_capacity_bytes_ = capacity_bytes;
}

double process_cpu_seconds() noexcept {
  rusage usage{};
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return 0.0;  // cannot fail for RUSAGE_SELF; 0 is no claim
  // Summed in whole microseconds, so the page shows 0.012671 rather than 0.012671000000000002.
  const auto micros = [](const timeval& time) { return std::int64_t{time.tv_sec} * 1'000'000 + time.tv_usec; };
  return static_cast<double>(micros(usage.ru_utime) + micros(usage.ru_stime)) / 1e6;
}

namespace {

// A worker without a capacity holds nothing it can be full of.
double usage_ratio(std::uint64_t held, std::uint64_t capacity) noexcept {
  if (capacity == 0) return 0.0;
  return std::min(1.0, static_cast<double>(held) / static_cast<double>(capacity));
}

}  // namespace

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
  out += fmt::format(
      "# HELP vllm:kv_cache_usage_perc KV cache usage, 0..1: the KV bytes sessions hold over the "
      "worker's KV capacity.\n# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{}}} {}\n",
      label, usage_ratio(kv_held_bytes_, kv_capacity_bytes_));
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
  // Unlabelled, as Prometheus client libraries export it: it is the process's, not the model's.
  out += fmt::format(
      "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.\n"
      "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total {}\n",
      process_cpu_seconds());
  return out;
}

}  // namespace kvrelay::refworker
