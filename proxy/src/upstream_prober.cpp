#include "kvrelay/proxy/upstream_prober.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <thread>

namespace kvrelay::proxy {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = asio::ip::tcp;

namespace {

// vLLM's page with every histogram is ~100 KiB; anything far larger is not a metrics page.
constexpr std::uint64_t kMaxMetricsBytes = 8ULL << 20;

// One scrape: resolve, connect, GET, read with a deadline, hand the body to `done`.
class ProbeSession : public std::enable_shared_from_this<ProbeSession> {
 public:
  using Done = std::function<void(std::string_view reason, std::string detail, std::string body)>;

  ProbeSession(asio::io_context& io, HttpUrl url, std::chrono::milliseconds timeout, Done done)
      : resolver_(io), stream_(io), url_(std::move(url)), timeout_(timeout), done_(std::move(done)) {}

  void run() {
    stream_.expires_after(timeout_);
    resolver_.async_resolve(url_.host, std::to_string(url_.port),
                            [self = shared_from_this()](beast::error_code ec, tcp::resolver::results_type results) {
                              if (ec) return self->finish("resolve", ec.message());
                              self->connect(results);
                            });
  }

 private:
  void connect(const tcp::resolver::results_type& results) {
    stream_.async_connect(results, [self = shared_from_this()](beast::error_code ec, const tcp::endpoint&) {
      if (ec) return self->finish("connect", ec.message());
      self->send();
    });
  }

  void send() {
    request_.method(http::verb::get);
    request_.target(url_.base_path.empty() ? "/" : url_.base_path);
    request_.version(11);
    request_.set(http::field::host, fmt::format("{}:{}", url_.host, url_.port));
    request_.set(http::field::accept, "text/plain");
    request_.set(http::field::connection, "close");
    http::async_write(stream_, request_, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (ec) return self->finish("write", ec.message());
      self->receive();
    });
  }

  void receive() {
    parser_.body_limit(kMaxMetricsBytes);
    http::async_read(stream_, buffer_, parser_, [self = shared_from_this()](beast::error_code ec, std::size_t) {
      if (ec) return self->finish(ec == beast::error::timeout ? "timeout" : "read", ec.message());
      const auto& response = self->parser_.get();
      if (response.result() != http::status::ok) {
        return self->finish("status", fmt::format("HTTP {}", response.result_int()));
      }
      self->finish({}, {}, std::move(self->parser_.get().body()));
    });
  }

  void finish(std::string_view reason, std::string detail, std::string body = {}) {
    beast::error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    if (done_) std::exchange(done_, nullptr)(reason, std::move(detail), std::move(body));
  }

  tcp::resolver resolver_;
  beast::tcp_stream stream_;
  HttpUrl url_;
  std::chrono::milliseconds timeout_;
  Done done_;
  http::request<http::empty_body> request_;
  beast::flat_buffer buffer_;
  http::response_parser<http::string_body> parser_;
};

}  // namespace

UpstreamProber::UpstreamProber(asio::io_context& io, std::shared_ptr<RuntimePolicy> policy, metrics::Registry& registry,
                               Listener listener)
    : io_(io),
      policy_(std::move(policy)),
      listener_(std::move(listener)),
      strand_(asio::make_strand(io)),
      timer_(strand_),
      cores_(std::thread::hardware_concurrency()),
      waiting_(registry.gauge("kvrelay_upstream_requests_waiting",
                              "Requests waiting at the agent's engine (vllm:num_requests_waiting, tgi_queue_size)",
                              {"agent"})),
      running_(registry.gauge("kvrelay_upstream_requests_running",
                              "Requests running at the agent's engine (vllm:num_requests_running, "
                              "tgi_batch_current_size)",
                              {"agent"})),
      kv_usage_(registry.gauge("kvrelay_upstream_kv_cache_usage_ratio",
                               "KV cache usage of the agent's engine, 0..1 (vllm:kv_cache_usage_perc)", {"agent"})),
      ttft_(registry.gauge("kvrelay_upstream_time_to_first_token_seconds",
                           "Mean time to first token at the agent's engine between the last two probes", {"agent"})),
      tpot_(registry.gauge("kvrelay_upstream_time_per_output_token_seconds",
                           "Mean time per output token at the agent's engine between the last two probes", {"agent"})),
      compute_(registry.gauge("kvrelay_upstream_compute_load_ratio",
                              "CPU use of the agent's engine between the last two probes over this host's cores "
                              "(process_cpu_seconds_total)",
                              {"agent"})),
      up_(registry.gauge("kvrelay_upstream_probe_up", "1 if the last probe of the agent's metrics page succeeded",
                         {"agent"})),
      failures_(registry.counter("kvrelay_upstream_probe_failures_total",
                                 "Failed probes of upstream metrics pages by agent and reason", {"agent", "reason"})) {}

void UpstreamProber::start() {
  asio::post(strand_, [self = shared_from_this()] {
    self->probe_all();
    self->schedule_next();
  });
}

void UpstreamProber::stop() {
  asio::post(strand_, [self = shared_from_this()] {
    self->stopped_ = true;
    self->timer_.cancel();
  });
}

void UpstreamProber::schedule_next() {
  timer_.expires_after(policy_->current()->limits.probe_interval);
  timer_.async_wait([self = shared_from_this()](beast::error_code ec) {
    if (ec || self->stopped_) return;
    self->probe_all();
    self->schedule_next();
  });
}

void UpstreamProber::probe_all() {
  const auto policy = policy_->current();
  const auto timeout = std::min(policy->limits.probe_interval, policy->limits.read_timeout);
  for (const auto& agent : policy->agents) {
    if (!agent.metrics_url) continue;
    auto session = std::make_shared<ProbeSession>(
        io_, *agent.metrics_url, timeout,
        [self = shared_from_this(), id = agent.id](std::string_view reason, std::string detail, std::string body) {
          if (!reason.empty()) return self->record_failure(id, std::string(reason), detail);
          auto parsed = parse_upstream_metrics(body);
          if (!parsed) return self->record_failure(id, "parse", parsed.error().message);
          if (!parsed.value().recognised_anything()) {
            return self->record_failure(id, "unrecognised", "no vLLM or TGI load metric on the page");
          }
          self->record_success(id, std::move(parsed).value());
        });
    session->run();
  }
}

void UpstreamProber::record_success(const std::string& agent, UpstreamLoad load) {
  {
    const std::lock_guard lock(mutex_);
    auto& reading = readings_[agent];
    const auto recent_mean = [](const std::optional<HistogramTotals>& before, const std::optional<HistogramTotals>& now,
                                const std::optional<double>& last) -> std::optional<double> {
      if (!now) return std::nullopt;
      // First page from this engine: its lifetime mean stands in until two probes bracket new
      // requests (an engine that served everything before the first probe would show none).
      auto mean = mean_between(before.value_or(HistogramTotals{}), *now);
      // Between two quiet probes there is nothing new; keep showing the last one measured.
      return mean ? mean : last;
    };
    load.recent_ttft_s =
        recent_mean(reading.load.time_to_first_token, load.time_to_first_token, reading.load.recent_ttft_s);
    load.recent_tpot_s =
        recent_mean(reading.load.time_per_output_token, load.time_per_output_token, reading.load.recent_tpot_s);
    const auto now = std::chrono::steady_clock::now();
    load.compute_load = compute_load(reading, load, now);
    reading.load = load;
    reading.scraped_at = now;
    reading.up = true;
    reading.last_error.clear();
    reading.last_success = std::chrono::system_clock::now();
    ++reading.probes;
  }
  // An engine that does not export a figure gets no series for it rather than a made-up value.
  if (load.requests_waiting) waiting_.with({agent}).set(*load.requests_waiting);
  if (load.requests_running) running_.with({agent}).set(*load.requests_running);
  if (load.kv_cache_usage) kv_usage_.with({agent}).set(*load.kv_cache_usage);
  if (load.recent_ttft_s) ttft_.with({agent}).set(*load.recent_ttft_s);
  if (load.recent_tpot_s) tpot_.with({agent}).set(*load.recent_tpot_s);
  if (load.compute_load) compute_.with({agent}).set(*load.compute_load);
  up_.with({agent}).set(1.0);
  if (listener_) listener_(agent, load);
}

std::optional<double> UpstreamProber::compute_load(const AgentLoadReading& before, const UpstreamLoad& now,
                                                   std::chrono::steady_clock::time_point scraped_at) const noexcept {
  if (!now.cpu_seconds) return std::nullopt;
  // The first page has no interval to take a rate over.
  if (!before.load.cpu_seconds) return std::nullopt;
  const double wall = std::chrono::duration<double>(scraped_at - before.scraped_at).count();
  const auto rate = cpu_load_between(*before.load.cpu_seconds, *now.cpu_seconds, wall, cores_);
  // A restarted engine's counter went backwards: keep the last figure for one interval.
  return rate ? rate : before.load.compute_load;
}

void UpstreamProber::record_failure(const std::string& agent, const std::string& reason, const std::string& detail) {
  bool first_of_streak = false;
  {
    const std::lock_guard lock(mutex_);
    auto& reading = readings_[agent];
    first_of_streak = reading.up || reading.probes == 0;
    reading.up = false;
    reading.last_error = fmt::format("{}: {}", reason, detail);
    ++reading.probes;
    ++reading.failures;
  }
  up_.with({agent}).set(0.0);
  failures_.with({agent, reason}).inc();
  // One log line per outage, not one per probe interval.
  if (first_of_streak) spdlog::warn("probe of agent '{}' metrics failed: {}: {}", agent, reason, detail);
}

std::map<std::string, AgentLoadReading> UpstreamProber::snapshot() const {
  const std::lock_guard lock(mutex_);
  return readings_;
}

nlohmann::json UpstreamProber::snapshot_json() const {
  nlohmann::json agents = nlohmann::json::object();
  const auto optional_json = [](const std::optional<double>& value) {
    return value ? nlohmann::json(*value) : nlohmann::json(nullptr);
  };
  for (const auto& [agent, reading] : snapshot()) {
    agents[agent] = {
        {"up", reading.up},
        {"probes", reading.probes},
        {"failures", reading.failures},
        {"last_error", reading.last_error},
        {"requests_waiting", optional_json(reading.load.requests_waiting)},
        {"requests_running", optional_json(reading.load.requests_running)},
        {"kv_cache_usage", optional_json(reading.load.kv_cache_usage)},
        {"compute_load", optional_json(reading.load.compute_load)},
        {"time_to_first_token_s", optional_json(reading.load.recent_ttft_s)},
        {"time_per_output_token_s", optional_json(reading.load.recent_tpot_s)},
        {"last_success_unix_s",
         reading.last_success == std::chrono::system_clock::time_point{}
             ? nlohmann::json(nullptr)
             : nlohmann::json(std::chrono::duration<double>(reading.last_success.time_since_epoch()).count())},
    };
  }
  return nlohmann::json{{"agents", agents}};
}

}  // namespace kvrelay::proxy
