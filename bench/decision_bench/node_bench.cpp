#include "node_bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <thread>

#include "bench_host.h"
#include "node_state.h"

namespace kvrelay::bench {

namespace {

using NodeClock = std::chrono::steady_clock;
constexpr std::size_t kNodeDraws = 1 << 16;  // requests drawn up front, reused cyclically
constexpr std::size_t kNodeWarmup = 2'000;   // untimed events of a kind before each timed round
constexpr std::size_t kNodeRounds = 5;

double node_ns_between(NodeClock::time_point a, NodeClock::time_point b) {
  return std::chrono::duration<double, std::nano>(b - a).count();
}

// Resident memory: the N nodes' state really exists while one node is timed.
double resident_mib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0.0;
}

// All events' p50/p99/mean, and each round's p50: rounds interleave the kinds, so a burst of
// other work on the host shows up as one slow round instead of skewing one kind.
nlohmann::json summarize_ns(const std::vector<std::vector<double>>& rounds) {
  std::vector<double> all;
  nlohmann::json round_p50 = nlohmann::json::array();
  for (std::vector<double> round : rounds) {
    std::sort(round.begin(), round.end());
    round_p50.push_back(round[round.size() / 2]);
    all.insert(all.end(), round.begin(), round.end());
  }
  std::sort(all.begin(), all.end());
  double sum = 0.0;
  for (const double v : all)
    sum += v;
  return {{"p50_ns", all[all.size() / 2]},
          {"p99_ns", all[all.size() * 99 / 100]},
          {"mean_ns", sum / static_cast<double>(all.size())},
          {"round_p50_ns", round_p50}};
}

// decide_into on the node's own routes, log-uniform lengths, a third with a cached prefix.
std::vector<double> time_decisions(NodeState& node, std::size_t events, std::uint64_t& checksum) {
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<std::size_t> any_route(0, node.routes.size() - 1);
  std::uniform_real_distribution<double> log_len(std::log(16.0), std::log(32768.0));
  std::vector<decision::RouteId> route_of(kNodeDraws);
  std::vector<decision::TransferShape> shapes(kNodeDraws);
  for (std::size_t i = 0; i < kNodeDraws; ++i) {
    route_of[i] = node.routes[any_route(rng)];
    shapes[i].tokens = static_cast<std::uint64_t>(std::exp(log_len(rng)));
    shapes[i].receiver_cached = i % 3 == 0 ? shapes[i].tokens / 2 : 0;
    shapes[i].now_s = static_cast<double>(i) * 1e-3;
  }
  decision::Decision decision;
  std::vector<double> ns(events);
  for (std::size_t i = 0; i < kNodeWarmup + events; ++i) {
    const std::size_t k = i & (kNodeDraws - 1);
    const auto t0 = NodeClock::now();
    const auto status = node.engine.decide_into(route_of[k], shapes[k], decision);
    const auto t1 = NodeClock::now();
    checksum += status ? decision.chosen : 1'000'000'000U;  // a failed decision would show here
    if (i >= kNodeWarmup) ns[i - kNodeWarmup] = node_ns_between(t0, t1);
  }
  return ns;
}

// One chunk grant on one of the node's links (step(): grant, acknowledge, finish on the last
// chunk); a finished transfer is replaced untimed, so every link keeps its queue.
std::vector<double> time_grants(NodeState& node, std::size_t events, std::uint64_t& checksum) {
  std::vector<double> ns(events);
  for (std::size_t i = 0; i < kNodeWarmup + events; ++i) {
    decision::LinkScheduler& link = *node.links[i % node.links.size()];
    const auto t0 = NodeClock::now();
    const auto chunk = link.step();
    const auto t1 = NodeClock::now();
    if (i >= kNodeWarmup) ns[i - kNodeWarmup] = node_ns_between(t0, t1);
    if (!chunk) continue;
    checksum += chunk->transfer;
    if (chunk->completed) queue_transfer(node, link, checksum + i);
  }
  return ns;
}

// One put under a full budget, as the store makes it: the ledger's victims for the bytes over
// budget, forgotten, and the new entry tracked. Between puts an untimed hit on a recent entry.
std::vector<double> time_evictions(NodeState& node, std::size_t events, std::uint64_t& checksum) {
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> log_bytes(std::log(64.0 * 1024), std::log(4.0 * 1024 * 1024));
  std::vector<std::uint64_t> sizes(kNodeDraws);
  for (std::uint64_t& size : sizes)
    size = static_cast<std::uint64_t>(std::exp(log_bytes(rng)));
  std::vector<double> ns(events);
  for (std::size_t i = 0; i < kNodeWarmup + events; ++i) {
    const std::uint64_t bytes = sizes[i & (kNodeDraws - 1)];
    const double now = node.ledger_now_s;
    const auto t0 = NodeClock::now();
    const std::uint64_t over =
        node.ledger_used + bytes > node.ledger_budget ? node.ledger_used + bytes - node.ledger_budget : 0;
    for (const auto& victim : node.ledger.victims(over, now)) {
      node.ledger.forget(victim.key);
      node.ledger_used -= victim.bytes;
    }
    node.ledger.track({node.index, node.next_key++}, bytes, i % 8 == 0 ? 7 : 0, now);
    node.ledger_used += bytes;
    const auto t1 = NodeClock::now();
    if (i >= kNodeWarmup) ns[i - kNodeWarmup] = node_ns_between(t0, t1);
    const std::uint64_t recent = node.next_key - 1 - rng() % std::min<std::uint64_t>(node.next_key, 100'000);
    checksum += node.ledger.hit({node.index, recent}, now) ? 1U : 0U;
    node.ledger_now_s += 0.01;
  }
  return ns;
}

double clock_read_ns() {
  constexpr std::size_t kReads = 200'000;
  const auto t0 = NodeClock::now();
  for (std::size_t i = 0; i < kReads; ++i)
    (void)NodeClock::now();
  return node_ns_between(t0, NodeClock::now()) / static_cast<double>(kReads);
}

}  // namespace

nlohmann::json run_node_bench(const NodeBenchOptions& options) {
  nlohmann::json rows = nlohmann::json::array();
  std::uint64_t checksum = 0;
  for (const std::size_t count : options.nodes) {
    const auto built = NodeClock::now();
    std::vector<std::unique_ptr<NodeState>> cluster;
    for (std::size_t n = 0; n < count; ++n)
      cluster.push_back(build_node(n, count, options));
    const double build_s = node_ns_between(built, NodeClock::now()) * 1e-9;
    NodeState& timed = *cluster.front();  // the others exist while node 0 decides on its own state
    std::vector<std::vector<double>> decisions, grants, evictions;
    const std::size_t per_round = std::max<std::size_t>(1, options.events / kNodeRounds);
    for (std::size_t round = 0; round < kNodeRounds; ++round) {
      decisions.push_back(time_decisions(timed, per_round, checksum));
      grants.push_back(time_grants(timed, per_round, checksum));
      evictions.push_back(time_evictions(timed, per_round, checksum));
    }
    rows.push_back({
        {"nodes", count},
        {"agents_in_cluster", count * options.agents_per_node},
        {"build_s", build_s},
        {"resident_mib", resident_mib()},
        {"decision", summarize_ns(decisions)},
        {"grant", summarize_ns(grants)},
        {"eviction", summarize_ns(evictions)},
    });
  }
  // Flat in nodes: the largest cluster's median over the smallest one's, per kind of event.
  nlohmann::json ratios = nlohmann::json::object();
  bool flat = true;
  for (const char* kind : {"decision", "grant", "eviction"}) {
    const double first = rows.front()[kind]["p50_ns"].get<double>();
    const double last = rows.back()[kind]["p50_ns"].get<double>();
    ratios[kind] = first > 0 ? last / first : 0.0;
    flat = flat && ratios[kind].get<double>() <= 1.5;
  }
  return {
      {"bench", "decision_bench"},
      {"mode", "nodes"},
      {"machine",
       {{"cpu", host_cpu_model()},
        {"hardware_threads", std::thread::hardware_concurrency()},
        {"load_average_1m", host_load_average()}}},
      {"per_node",
       {{"agents", options.agents_per_node},
        {"routes", options.agents_per_node * options.routes_per_agent},
        {"links", options.links_per_node},
        {"transfers_per_link", options.transfers_per_link},
        {"ledger_entries", options.ledger_entries}}},
      {"events_per_kind", options.events},
      {"rounds", kNodeRounds},
      {"events",
       {{"decision", "DecisionEngine::decide_into on one of the node's routes"},
        {"grant", "LinkScheduler::step() on one of the node's links (grant, acknowledge, finish)"},
        {"eviction", "UtilityLedger::victims() for a put over budget, forget them, track the new entry"}}},
      {"timed_includes_clock_read_ns", clock_read_ns()},
      {"by_nodes", rows},
      {"p50_largest_over_smallest", ratios},
      {"goal_flat_within_1_5x", flat},
      {"checksum", checksum},
  };
}

}  // namespace kvrelay::bench
