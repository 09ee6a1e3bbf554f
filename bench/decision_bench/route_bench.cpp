#include "route_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvrelay/decision/decision_engine.h"

#include "bench_host.h"

namespace kvrelay::bench {

namespace {

using RouteClock = std::chrono::steady_clock;

double route_ns_between(RouteClock::time_point a, RouteClock::time_point b) {
  return std::chrono::duration<double, std::nano>(b - a).count();
}

}  // namespace

nlohmann::json run_route_bench(const RouteBenchOptions& options) {
  using namespace kvrelay::decision;
  std::mt19937_64 rng(1);
  DecisionEngine engine;
  constexpr std::size_t kNodes = 100;
  std::vector<LinkId> links;
  for (std::size_t n = 0; n < kNodes; ++n) {
    const bool shm = n == 0;
    links.push_back(
        engine.add_link(LinkParams{"node" + std::to_string(n), shm, shm ? 10e9 : 1.25e9, shm ? 2e-5 : 2e-4}).value());
  }
  std::uniform_int_distribution<std::size_t> any_agent(0, options.agents - 1);
  for (std::size_t a = 0; a < options.agents; ++a) {
    AgentParams p;
    p.id = "agent" + std::to_string(a);
    p.fingerprint_id = a % 4;
    p.kv_bytes_per_token = 131072;
    p.accepts_sparse = a % 5 == 0;
    (void)engine.add_agent(p).value();
  }
  std::vector<RouteId> routes;
  routes.reserve(options.routes);
  for (std::size_t r = 0; r < options.routes; ++r) {
    kvrelay::RoutePolicy policy;
    policy.id = "route" + std::to_string(r);
    const std::size_t from = any_agent(rng);
    const std::size_t to = any_agent(rng);
    policy.from_agent = "agent" + std::to_string(from);
    policy.to_agent = "agent" + std::to_string(to);
    policy.quality_floor = r % 7 == 0 ? 0.97 : 0.0;
    routes.push_back(engine.add_route(policy, links[to % kNodes]).value());
  }
  // Requests drawn up front so the timed loop measures decide() alone.
  constexpr std::size_t kShapes = 1 << 20;
  std::vector<RouteId> route_of(kShapes);
  std::vector<TransferShape> shapes(kShapes);
  std::uniform_real_distribution<double> log_len(std::log(16.0), std::log(32768.0));
  std::uniform_int_distribution<std::size_t> any_route(0, options.routes - 1);
  for (std::size_t i = 0; i < kShapes; ++i) {
    route_of[i] = routes[any_route(rng)];
    shapes[i].tokens = static_cast<std::uint64_t>(std::exp(log_len(rng)));
    shapes[i].receiver_cached = i % 3 == 0 ? shapes[i].tokens / 2 : 0;
    shapes[i].now_s = static_cast<double>(i) * 1e-4;
  }

  // Warm-up: one decision per route, so first-touch page faults are not counted.
  std::uint64_t checksum = 0;
  Decision decision;
  for (std::size_t r = 0; r < options.routes; ++r) {
    (void)engine.decide_into(routes[r], shapes[r & (kShapes - 1)], decision);
    checksum += decision.chosen;
  }
  // Throughput: no clock inside the loop.
  const auto start = RouteClock::now();
  for (std::size_t i = 0; i < options.decisions; ++i) {
    const std::size_t k = i & (kShapes - 1);
    (void)engine.decide_into(route_of[k], shapes[k], decision);
    checksum += decision.chosen;
  }
  const double total_ns = route_ns_between(start, RouteClock::now());

  // Latency distribution: each decision timed on its own (includes ~2 clock reads).
  const std::size_t timed = std::min<std::size_t>(options.decisions, 500'000);
  std::vector<double> latency(timed);
  for (std::size_t i = 0; i < timed; ++i) {
    const std::size_t k = (i * 7919) & (kShapes - 1);
    const auto t0 = RouteClock::now();
    (void)engine.decide_into(route_of[k], shapes[k], decision);
    const auto t1 = RouteClock::now();
    checksum += decision.chosen;
    latency[i] = route_ns_between(t0, t1);
  }
  std::sort(latency.begin(), latency.end());
  const auto clock_t0 = RouteClock::now();
  for (std::size_t i = 0; i < timed; ++i) {
    (void)RouteClock::now();
  }
  const double clock_ns = route_ns_between(clock_t0, RouteClock::now()) / static_cast<double>(timed);

  // Physical floor: a dependent random read per decision over the same working set size
  // (route table entries are ~100 bytes), which no table-driven decide() can beat.
  const std::size_t lines = options.routes * 2;
  std::vector<std::uint64_t> chase(lines * 8);
  {
    std::vector<std::size_t> order(lines);
    for (std::size_t i = 0; i < lines; ++i) {
      order[i] = i;
    }
    std::shuffle(order.begin(), order.end(), rng);
    for (std::size_t i = 0; i < lines; ++i) {
      chase[order[i] * 8] = order[(i + 1) % lines] * 8;
    }
  }
  std::uint64_t cursor = 0;
  const auto floor_start = RouteClock::now();
  for (std::size_t i = 0; i < options.decisions; ++i) {
    cursor = chase[cursor];
  }
  const double floor_ns = route_ns_between(floor_start, RouteClock::now()) / static_cast<double>(options.decisions);

  const double mean_ns = total_ns / static_cast<double>(options.decisions);
  return {
      {"bench", "decision_bench"},
      {"machine",
       {{"cpu", host_cpu_model()},
        {"hardware_threads", std::thread::hardware_concurrency()},
        {"load_average_1m", host_load_average()}}},
      {"agents", options.agents},
      {"routes", options.routes},
      {"links", kNodes},
      {"media", engine.media_count()},
      {"decisions", options.decisions},
      {"decisions_per_s", 1e9 / mean_ns},
      {"mean_ns", mean_ns},
      {"p50_ns", latency[timed / 2]},
      {"p99_ns", latency[timed * 99 / 100]},
      {"p999_ns", latency[timed * 999 / 1000]},
      {"timed_includes_clock_read_ns", clock_ns},
      {"physical_floor_random_read_ns", floor_ns},
      {"goal_mean_below_2us", mean_ns < 2000.0},
      {"checksum", checksum + cursor},
  };
}

}  // namespace kvrelay::bench
