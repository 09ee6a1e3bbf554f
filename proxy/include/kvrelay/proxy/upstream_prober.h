#pragma once

// Scrapes each agent's upstream metrics page (policy: agents[].metrics_url) every
// limits.probe_interval_ms, keeps the latest load per agent, exports it as kvrelay_upstream_*
// gauges and hands every fresh reading to a listener (the decision engine's load input).
// A probe that fails marks the agent's reading stale; it never blocks or fails a request.

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>
#include <nlohmann/json_fwd.hpp>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "kvrelay/core/metrics.h"
#include "kvrelay/proxy/runtime_policy.h"
#include "kvrelay/proxy/upstream_load.h"

namespace kvrelay::proxy {

struct AgentLoadReading {
  UpstreamLoad load;
  bool up = false;  // the last probe succeeded
  std::string last_error;
  std::chrono::system_clock::time_point last_success{};
  std::chrono::steady_clock::time_point scraped_at{};  // of the last success: the interval of CPU rates
  std::uint64_t probes = 0;
  std::uint64_t failures = 0;
};

class UpstreamProber : public std::enable_shared_from_this<UpstreamProber> {
 public:
  using Listener = std::function<void(const std::string& agent, const UpstreamLoad& load)>;

  UpstreamProber(boost::asio::io_context& io, std::shared_ptr<RuntimePolicy> policy, metrics::Registry& registry,
                 Listener listener = {});

  void start();
  void stop();

  [[nodiscard]] std::map<std::string, AgentLoadReading> snapshot() const;
  [[nodiscard]] nlohmann::json snapshot_json() const;

 private:
  void schedule_next();
  void probe_all();
  void record_success(const std::string& agent, UpstreamLoad load);
  // compute_load from the CPU counter's rate since the agent's last good scrape.
  [[nodiscard]] std::optional<double> compute_load(const AgentLoadReading& before, const UpstreamLoad& now,
                                                   std::chrono::steady_clock::time_point scraped_at) const noexcept;
  void record_failure(const std::string& agent, const std::string& reason, const std::string& detail);

  boost::asio::io_context& io_;
  std::shared_ptr<RuntimePolicy> policy_;
  Listener listener_;
  // The timer and the stop flag are touched only on this strand; the daemon may run several I/O threads.
  boost::asio::strand<boost::asio::io_context::executor_type> strand_;
  boost::asio::steady_timer timer_;
  bool stopped_ = false;
  // The sidecar runs on its engine's node, so this host's cores are the engine's (cgroup CPU
  // limits are not seen: a capped engine shows a lower load than it bears).
  unsigned cores_;

  mutable std::mutex mutex_;
  std::map<std::string, AgentLoadReading> readings_;

  metrics::Family<metrics::Gauge>& waiting_;
  metrics::Family<metrics::Gauge>& running_;
  metrics::Family<metrics::Gauge>& kv_usage_;
  metrics::Family<metrics::Gauge>& ttft_;
  metrics::Family<metrics::Gauge>& tpot_;
  metrics::Family<metrics::Gauge>& compute_;
  metrics::Family<metrics::Gauge>& up_;
  metrics::Family<metrics::Counter>& failures_;
};

}  // namespace kvrelay::proxy
