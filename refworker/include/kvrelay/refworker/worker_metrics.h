#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvrelay::refworker {

// A Prometheus histogram: cumulative counts per upper bound, total count and sum.
class LatencyHistogram {
 public:
  explicit LatencyHistogram(std::span<const double> bounds) : bounds_(bounds), counts_(bounds.size()) {}
  void observe(double seconds);
  // The `_bucket`, `_sum` and `_count` series of `name`, each labelled with `label`.
  void render(std::string& out, std::string_view name, std::string_view help, std::string_view label) const;

 private:
  std::span<const double> bounds_;
  std::vector<std::uint64_t> counts_;
  std::uint64_t count_ = 0;
  double sum_ = 0.0;
};

// This process's user + system CPU time in seconds (getrusage(RUSAGE_SELF)): the
// process_cpu_seconds_total counter that Prometheus client libraries (vLLM's among them) export.
[[nodiscard]] double process_cpu_seconds() noexcept;

// The subset of vLLM's Prometheus metrics this worker has, under vLLM's names, so dashboards
// and the sidecar's load probes read a refworker like a vLLM worker.
class WorkerMetrics {
 public:
  // vLLM's time_to_first_token_seconds buckets.
  static constexpr std::array<double, 18> kTtftBuckets = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,
                                                          0.5,   0.75,  1.0,  2.5,  5.0,  7.5,  10.0, 20.0, 40.0};
  // vLLM's time_per_output_token_seconds buckets.
  static constexpr std::array<double, 15> kTpotBuckets = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                                                          0.4,  0.5,   0.75, 1.0,   2.5, 5.0,  7.5};

  void set_waiting(std::uint64_t waiting);
  void set_running(std::uint64_t running);
  // KV bytes the sessions hold now, over the most KV the worker lets them hold at once
  // (vllm:kv_cache_usage_perc, 0..1); the model thread updates it as its session grows.
  void set_kv_cache(std::uint64_t held_bytes, std::uint64_t capacity_bytes);
  void observe_ttft(double seconds);
  // One gap between two consecutive output tokens of a request (vLLM observes the same).
  void observe_time_per_output_token(double seconds);
  // `finished_reason` "stop" or "length" for a served request, empty for a failed one.
  void add_request(std::uint64_t prompt_tokens, std::uint64_t generation_tokens, std::uint64_t cached_tokens,
                   std::string_view finished_reason);

  // Prometheus text exposition format, every series labelled model_name="<model_name>".
  [[nodiscard]] std::string render(const std::string& model_name) const;

 private:
  mutable std::mutex mutex_;
  std::uint64_t waiting_ = 0;
  std::uint64_t running_ = 0;
  std::uint64_t kv_held_bytes_ = 0;
  std::uint64_t kv_capacity_bytes_ = 0;
  LatencyHistogram ttft_{kTtftBuckets};
  LatencyHistogram tpot_{kTpotBuckets};
  std::uint64_t prompt_tokens_ = 0;
  std::uint64_t generation_tokens_ = 0;
  std::uint64_t cached_tokens_ = 0;
  std::uint64_t finished_stop_ = 0;
  std::uint64_t finished_length_ = 0;
  std::uint64_t failed_ = 0;
};

}  // namespace kvrelay::refworker
