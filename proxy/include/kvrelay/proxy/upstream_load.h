#pragma once

// What an upstream engine's own Prometheus endpoint says about its load. vLLM and TGI name the
// same quantities differently; both are read into one shape so the decision engine does not care
// which engine sits behind an agent.

#include <cstdint>
#include <optional>
#include <string_view>

#include "kvrelay/core/result.h"

namespace kvrelay::proxy {

// Cumulative counters of a histogram, kept so that two scrapes give the recent mean.
struct HistogramTotals {
  double sum = 0.0;
  double count = 0.0;
};

struct UpstreamLoad {
  std::optional<double> requests_waiting;              // vllm:num_requests_waiting, tgi_queue_size
  std::optional<double> requests_running;              // vllm:num_requests_running, tgi_batch_current_size
  std::optional<double> kv_cache_usage;                // vllm:kv_cache_usage_perc (0..1)
  std::optional<HistogramTotals> time_to_first_token;  // vllm:time_to_first_token_seconds
  std::optional<double> recent_ttft_s;                 // mean over the scrape interval; filled by the prober
  // vllm:time_per_output_token_seconds (vllm:inter_token_latency_seconds since its rename),
  // tgi_request_mean_time_per_token_duration: how long one more answer token costs.
  std::optional<HistogramTotals> time_per_output_token;
  std::optional<double> recent_tpot_s;  // mean over the scrape interval; filled by the prober
  std::optional<double> cpu_seconds;    // process_cpu_seconds_total: the engine process's user + system CPU
  // CPU seconds per second over the scrape interval, over the cores; filled by the prober.
  std::optional<double> compute_load;
  // Only engine figures count: process_cpu_seconds_total alone is on any instrumented process's page.
  [[nodiscard]] bool recognised_anything() const noexcept {
    return requests_waiting || requests_running || kv_cache_usage || time_to_first_token || time_per_output_token;
  }
};

// Reads the load figures from a Prometheus text exposition. Samples with several label sets (one
// per model, say) are summed. Unknown metrics are ignored; a line that is not valid exposition
// syntax is an error naming its line number, because a half-read page would feed the engine a
// wrong load.
[[nodiscard]] Result<UpstreamLoad> parse_upstream_metrics(std::string_view exposition);

// The mean of a histogram (time to first token, time per output token) between two scrapes;
// nullopt when nothing was observed in between or the counters went backwards (the engine
// restarted).
[[nodiscard]] std::optional<double> mean_between(const HistogramTotals& before, const HistogramTotals& after) noexcept;

// The engine's CPU use between two scrapes `wall_seconds` apart, as a share of `cores` cores (1:
// all busy; more when the engine's host has more cores than `cores`); nullopt without an
// interval or cores, or when the counter went backwards (the engine restarted).
[[nodiscard]] std::optional<double> cpu_load_between(double cpu_before, double cpu_after, double wall_seconds,
                                                     unsigned cores) noexcept;

}  // namespace kvrelay::proxy
