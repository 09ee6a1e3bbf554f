#include "node_state.h"

#include <cmath>
#include <random>
#include <string>

namespace kvrelay::bench {

namespace {

constexpr std::uint64_t kNodeFingerprints = 4;
constexpr double kNodeKvBytesPerToken = 131072.0;  // an 8B-class model
constexpr double kLedgerTauS = 60.0;

std::string agent_name(std::size_t node, std::size_t agent) {
  return "agent" + std::to_string(node) + "." + std::to_string(agent);
}

// Log-uniform in [low, high].
std::uint64_t log_uniform(std::mt19937_64& rng, double low, double high) {
  std::uniform_real_distribution<double> draw(std::log(low), std::log(high));
  return static_cast<std::uint64_t>(std::exp(draw(rng)));
}

void add_engine_state(NodeState& node, std::size_t node_count, const NodeBenchOptions& options, std::mt19937_64& rng) {
  for (std::size_t n = 0; n < node_count; ++n) {
    for (std::size_t a = 0; a < options.agents_per_node; ++a) {
      decision::AgentParams agent;
      agent.id = agent_name(n, a);
      agent.fingerprint_id = a % kNodeFingerprints;
      agent.kv_bytes_per_token = kNodeKvBytesPerToken;
      agent.accepts_sparse = a % 5 == 0;
      (void)node.engine.add_agent(agent);
    }
  }
  // Link 0 is shared memory; link j > 0 reaches the j-th other node.
  std::vector<decision::LinkId> links;
  links.push_back(node.engine.add_link(decision::LinkParams{"shm", true, 10e9, 2e-5}).value());
  for (std::size_t n = 0; n < node_count; ++n) {
    if (n == node.index) continue;
    links.push_back(
        node.engine.add_link(decision::LinkParams{"node" + std::to_string(n), false, 1.25e9, 2e-4}).value());
  }
  std::uniform_int_distribution<std::size_t> any_node(0, node_count - 1);
  std::uniform_int_distribution<std::size_t> any_agent(0, options.agents_per_node - 1);
  std::uniform_int_distribution<int> any_priority(0, 7);
  for (std::size_t a = 0; a < options.agents_per_node; ++a) {
    for (std::size_t r = 0; r < options.routes_per_agent; ++r) {
      const std::size_t to_node = any_node(rng);
      kvrelay::RoutePolicy route;
      route.id = "route" + std::to_string(a) + "." + std::to_string(r);
      route.from_agent = agent_name(node.index, a);
      route.to_agent = agent_name(to_node, any_agent(rng));
      route.priority = any_priority(rng);
      route.quality_floor = r == 0 ? 0.97 : 0.0;  // one route of each agent has a floor
      const std::size_t link = to_node == node.index ? 0 : (to_node < node.index ? to_node + 1 : to_node);
      node.routes.push_back(node.engine.add_route(route, links[link]).value());
    }
  }
}

void add_ledger_state(NodeState& node, const NodeBenchOptions& options, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> any_priority(0, 7);
  std::uniform_int_distribution<int> extra_hits(0, 7);
  std::uniform_real_distribution<double> last_access(0.0, 600.0);
  for (std::size_t e = 0; e < options.ledger_entries; ++e) {
    const decision::LedgerKey key{node.index, node.next_key++};
    const std::uint64_t bytes = log_uniform(rng, 64.0 * 1024, 4.0 * 1024 * 1024);
    const double at = last_access(rng);
    node.ledger.track(key, bytes, any_priority(rng) == 7 ? 7 : 0, at);
    for (int h = extra_hits(rng); h > 0; --h)
      (void)node.ledger.hit(key, at);
    node.ledger_used += bytes;
  }
  node.ledger_budget = node.ledger_used;
  node.ledger_now_s = 600.0;
}

}  // namespace

void queue_transfer(NodeState& node, decision::LinkScheduler& link, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> any_priority(0, 7);
  decision::TransferSpec spec;
  spec.id = node.next_transfer++;
  spec.bytes = log_uniform(rng, 1024.0 * 1024, 64.0 * 1024 * 1024);
  spec.src_priority = any_priority(rng);
  spec.dst_priority = any_priority(rng);
  spec.route_priority = any_priority(rng);
  (void)link.submit(spec, link.now());
}

std::unique_ptr<NodeState> build_node(std::size_t index, std::size_t node_count, const NodeBenchOptions& options) {
  auto node = std::make_unique<NodeState>();
  node->index = index;
  node->ledger.set_recency_tau(kLedgerTauS);
  // One generator per part: the schedulers and the ledger do not depend on the cluster's size.
  std::mt19937_64 engine_rng(1000 + index);
  std::mt19937_64 link_rng(2000 + index);
  std::mt19937_64 ledger_rng(3000 + index);
  add_engine_state(*node, node_count, options, engine_rng);
  decision::SchedulerConfig config;
  config.link_bytes_per_s = 1.25e9;
  for (std::size_t l = 0; l < options.links_per_node; ++l) {
    node->links.push_back(std::make_unique<decision::LinkScheduler>(config));
    for (std::size_t t = 0; t < options.transfers_per_link; ++t)
      queue_transfer(*node, *node->links.back(), link_rng());
  }
  add_ledger_state(*node, options, ledger_rng);
  return node;
}

}  // namespace kvrelay::bench
