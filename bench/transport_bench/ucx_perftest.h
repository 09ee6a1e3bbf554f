#pragma once

// ucx_perftest (ucx-utils) as the UCX-level limit of kvrelay's UCX peer transport (issue #29):
// per sample one server process (no host) and one client (127.0.0.1), UCX_TLS in their
// environment, UCP tag bandwidth (-t tag_bw) of one message size. The figure is perftest's own
// overall bandwidth over its measured iterations: its warm-up, process start and connection
// setup are outside it.

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace kvrelay::bench {

// `preferred` when it is an executable file, else the first ucx_perftest on PATH; "" for none.
[[nodiscard]] std::string find_ucx_perftest(const std::string& preferred);

// perftest's overall bandwidth in bytes per second, from its output: the last line of eight
// numbers (its final summary; with -f the only one, without it the one after "Final:"), whose
// columns are iterations, overhead (usec: percentile, average, overall), bandwidth (MB/s, where
// UCX's MB is 2^20 bytes: average, overall) and message rate (average, overall). The overall
// bandwidth must agree with `message_bytes` / overall overhead of the same line within 2 %, so a
// change of columns is reported rather than read wrongly; nullopt and `error` otherwise.
[[nodiscard]] std::optional<double> parse_perftest_bandwidth(std::string_view output, std::size_t message_bytes,
                                                             std::string& error);

struct PerftestSample {
  double gbps = 0;  // 1e9 bytes per second; 0 when `error` says why not
  std::string error;
};

class UcxPerftest {
 public:
  // Logs of the last run go to `dir` (perftest-server.log, perftest-client.log); `environment`
  // ("UCX_NAME=value") is added to both sides' after UCX_TLS; `wait_mode` is the client's -E
  // (poll: both sides spin in ucp_worker_progress; sleep: they wait for UCX's wake-up events).
  UcxPerftest(std::string binary, std::filesystem::path dir, std::vector<std::string> environment = {},
              std::string wait_mode = "poll");

  // One tag_bw run: `warmup` unmeasured messages of `bytes`, then `iterations` measured, with
  // UCX_TLS=`tls` and the constructor's `environment` (no other UCX_ variable of this process) on both sides.
  [[nodiscard]] PerftestSample run(const std::string& tls, std::size_t bytes, int iterations, int warmup,
                                   std::chrono::seconds timeout) const;
  // The client's arguments after the binary (each as given: numbers, or placeholders for the report).
  [[nodiscard]] static std::vector<std::string> client_arguments(std::string port, std::string bytes,
                                                                 std::string iterations, std::string warmup,
                                                                 std::string wait_mode);
  [[nodiscard]] const std::string& binary() const noexcept { return binary_; }
  [[nodiscard]] const std::vector<std::string>& environment() const noexcept { return environment_; }

 private:
  std::string binary_;
  std::filesystem::path dir_;
  std::vector<std::string> environment_;
  std::string wait_mode_;
};

}  // namespace kvrelay::bench
