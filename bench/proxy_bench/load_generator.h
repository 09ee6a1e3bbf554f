#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvrelay::bench {

struct LoadResult {
  double requests_per_second = 0;
  double p50_us = 0;
  double p99_us = 0;
  std::uint64_t requests = 0;
  std::uint64_t errors = 0;
  std::uint64_t response_bytes = 0;
  double seconds = 0;
  std::vector<double> latencies_us;  // every request's, sorted
};

// Closed-loop load: `connections` keep-alive connections to 127.0.0.1:port, each sending the
// request (with `headers` added) and reading the whole response before the next, for `duration`.
[[nodiscard]] LoadResult run_load(std::uint16_t port, const std::string& target, const std::string& body,
                                  const std::map<std::string, std::string>& headers, unsigned connections,
                                  std::chrono::milliseconds duration);

// One result from several runs against the same endpoint (rates over their summed time,
// percentiles over all their requests).
[[nodiscard]] LoadResult merge_runs(const std::vector<LoadResult>& runs);

}  // namespace kvrelay::bench
