#include "trace.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace kvrelay::sim {

// An 8B-class model (32 layers, 8 KV heads, head dim 128, fp16) and a 3B-class one; prefill
// speeds of one modern accelerator. Different indices mean different fingerprints.
const std::array<ModelSpec, 2> kModels = {
    ModelSpec{"llama-8b", 32.0 * 2 * 8 * 128 * 2, {0.015, 8.0e-5, 2.5e-10}, 0.020},
    ModelSpec{"llama-3b", 28.0 * 2 * 8 * 128 * 2 / 2, {0.010, 3.5e-5, 1.2e-10}, 0.012},
};

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

MediumSpec medium(const char* name, decision::MediumKind kind, double ratio, double enc, double dec, double fidelity,
                  double extra) {
  MediumSpec spec;
  spec.name = name;
  spec.kind = kind;
  spec.profile = decision::CodecProfile{{ratio * 0.5, ratio, ratio, ratio}, enc, dec, fidelity, extra};
  return spec;
}

// GPU codec speeds on the host (bytes of raw KV per second); order matches kBuiltinMedia.
std::vector<MediumSpec> true_media() {
  using decision::MediumKind;
  return {
      medium("tokens", MediumKind::kTokens, 1.0, 0, 0, 1.0, 0.0),
      medium("kv_raw", MediumKind::kKvLossless, 1.0, 0, 0, 1.0, 0.0),
      medium("kv_lossless", MediumKind::kKvLossless, 0.86, 6e9, 10e9, 1.0, 0.0),
      medium("kv_fp8", MediumKind::kKvLossy, 0.51, 35e9, 50e9, 0.995, 0.004),
      medium("kv_int8", MediumKind::kKvLossy, 0.53, 40e9, 60e9, 0.99, 0.006),
      medium("kv_int4", MediumKind::kKvLossy, 0.28, 25e9, 40e9, 0.95, 0.05),
      medium("kv_sparse", MediumKind::kKvSparse, 0.30, 50e9, 50e9, 0.97, 0.03),
  };
}

// codec_bench on the same host measured them within ~10-15%: close, deliberately not exact.
std::vector<MediumSpec> prior_media(const std::vector<MediumSpec>& truth) {
  std::vector<MediumSpec> prior = truth;
  const double bias[] = {1.0, 1.0, 1.1, 0.9, 1.12, 0.88, 1.08};
  for (std::size_t i = 0; i < prior.size(); ++i) {
    auto& p = prior[i].profile;
    for (double& r : p.ratio) {
      r = std::min(1.0, r * (2.0 - bias[i]));
    }
    p.encode_bytes_per_s *= bias[i];
    p.decode_bytes_per_s *= bias[i];
  }
  return prior;
}

struct World {
  Workload w;
  std::mt19937_64 rng;
  std::vector<double> link_phase;
  std::vector<std::vector<std::pair<double, double>>> congestion;  // per link: [start, end)
  std::vector<std::vector<double>> load;                           // per agent: per 30 s epoch
  double horizon_s = 0.0;

  double lognormal(double sigma) { return std::exp(std::normal_distribution<double>(0.0, sigma)(rng)); }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng); }
  std::uint64_t log_uniform_tokens(double lo, double hi) {
    const double v = std::exp(uniform(std::log(lo), std::log(hi)));
    return std::max<std::uint64_t>(16, static_cast<std::uint64_t>(v));
  }

  // True bandwidth of a link at time t: slow swing, congestion episodes, per-transfer jitter
  // (the jitter is drawn by the caller so each transfer gets its own).
  double bandwidth(int link, double t) {
    const SimLink& l = w.links[static_cast<std::size_t>(link)];
    const double swing = l.shm ? 0.1 : 0.3;
    double bw = l.nominal_bytes_per_s *
                (1.0 + swing * std::sin(2.0 * M_PI * t / 40.0 + link_phase[static_cast<std::size_t>(link)]));
    for (const auto& [start, end] : congestion[static_cast<std::size_t>(link)]) {
      if (t >= start && t < end) {
        bw *= 0.4;
      }
    }
    return bw;
  }

  double receiver_load(int agent, double t) {
    const auto& epochs = load[static_cast<std::size_t>(agent)];
    const auto epoch = std::min(epochs.size() - 1, static_cast<std::size_t>(t / 30.0));
    return epochs[epoch];
  }

  int add_agent(const std::string& id, int node, int model, bool sparse = false) {
    w.agents.push_back(SimAgent{id, node, model, sparse});
    return static_cast<int>(w.agents.size()) - 1;
  }
  int add_link(const std::string& id, bool shm, double bytes_per_s, double rtt) {
    w.links.push_back(SimLink{id, shm, bytes_per_s, rtt});
    return static_cast<int>(w.links.size()) - 1;
  }
  int add_route(int from, int to, int link, double floor = 0.0) {
    w.routes.push_back(
        SimRoute{w.agents[static_cast<std::size_t>(from)].id + "->" + w.agents[static_cast<std::size_t>(to)].id, from,
                 to, link, floor});
    return static_cast<int>(w.routes.size()) - 1;
  }

  void add_transfer(double t, int route, std::uint64_t tokens, int conversation) {
    Transfer x;
    x.time_s = t;
    x.route = route;
    x.tokens = std::min<std::uint64_t>(tokens, 32768);
    x.conversation = conversation;
    // Often the receiver already holds a prefix (an earlier turn of the same context).
    if (uniform(0, 1) < 0.4) {
      x.cached = static_cast<std::uint64_t>(uniform(0, 0.8) * static_cast<double>(x.tokens)) / 16 * 16;
    }
    x.output_tokens = static_cast<std::uint32_t>(uniform(64, 512));
    w.transfers.push_back(x);
  }

  void finish(double probe_interval_s) {
    std::sort(w.transfers.begin(), w.transfers.end(),
              [](const Transfer& l, const Transfer& r) { return l.time_s < r.time_s; });
    for (Transfer& x : w.transfers) {
      const SimRoute& r = w.routes[static_cast<std::size_t>(x.route)];
      const SimAgent& from = w.agents[static_cast<std::size_t>(r.from)];
      const SimAgent& to = w.agents[static_cast<std::size_t>(r.to)];
      const SimLink& link = w.links[static_cast<std::size_t>(r.link)];
      const ModelSpec& sender_model = kModels[static_cast<std::size_t>(from.model)];
      const ModelSpec& receiver_model = kModels[static_cast<std::size_t>(to.model)];
      const double load_now = receiver_load(r.to, x.time_s);
      x.bytes_per_s = bandwidth(r.link, x.time_s) * lognormal(0.1);
      const double missing = static_cast<double>(x.tokens - x.cached);
      x.prefill_s = receiver_model.prefill.predict(missing, static_cast<double>(x.cached)) * load_now * lognormal(0.05);
      const double raw = missing * sender_model.kv_bytes_per_token;
      for (std::size_t m = 0; m < w.true_media.size(); ++m) {
        const MediumSpec& spec = w.true_media[m];
        if (spec.kind == decision::MediumKind::kTokens) {
          x.true_cost[m] = missing * 4.0 / x.bytes_per_s + link.rtt_s + x.prefill_s;
          continue;
        }
        if (from.model != to.model || (spec.kind == decision::MediumKind::kKvSparse && !to.accepts_sparse)) {
          x.true_cost[m] = kInf;
          continue;
        }
        const auto& p = spec.profile;
        const double ratio = p.ratio[1];  // fp16 models
        x.true_cost[m] = raw * ratio / x.bytes_per_s + link.rtt_s +
                         (p.encode_bytes_per_s > 0 ? raw / p.encode_bytes_per_s : 0.0) +
                         (p.decode_bytes_per_s > 0 ? raw / p.decode_bytes_per_s : 0.0) +
                         p.extra_decode_fraction * x.output_tokens * receiver_model.decode_s_per_token;
      }
      for (std::size_t m = w.true_media.size(); m < kMaxMedia; ++m) {
        x.true_cost[m] = kInf;
      }
      Observation& o = x.observation;
      o.link_bytes_per_s = x.bytes_per_s * lognormal(0.08);
      o.rtt_s = link.rtt_s * lognormal(0.1);
      o.suffix_tokens = log_uniform_tokens(16, 1024);
      o.suffix_prefill_s =
          receiver_model.prefill.predict(static_cast<double>(o.suffix_tokens), static_cast<double>(x.tokens)) *
          load_now * lognormal(0.08);
      o.noise = lognormal(0.08);
    }
    for (double t = 0.0; t < horizon_s; t += probe_interval_s) {
      for (int link = 0; link < static_cast<int>(w.links.size()); ++link) {
        // Probes are small: they see the bandwidth and RTT with more noise than real transfers.
        w.probes.push_back(Probe{t, link, bandwidth(link, t) * lognormal(0.15),
                                 w.links[static_cast<std::size_t>(link)].rtt_s * lognormal(0.15)});
      }
    }
  }
};

void setup_dynamics(World& world) {
  const std::size_t epochs = static_cast<std::size_t>(world.horizon_s / 30.0) + 2;
  for (std::size_t i = 0; i < world.w.agents.size(); ++i) {
    std::vector<double> loads;
    for (std::size_t e = 0; e < epochs; ++e) {
      loads.push_back(world.uniform(1.0, 2.5));
    }
    world.load.push_back(loads);
  }
  for (std::size_t l = 0; l < world.w.links.size(); ++l) {
    world.link_phase.push_back(world.uniform(0, 2 * M_PI));
    std::vector<std::pair<double, double>> episodes;
    for (double t = world.uniform(10, 60); t < world.horizon_s; t += world.uniform(40, 90)) {
      episodes.emplace_back(t, t + world.uniform(8, 20));
    }
    world.congestion.push_back(episodes);
  }
}

// A context walks an agent chain; each hop adds the agent's own output to it.
void add_chains(World& world, const std::vector<int>& routes, std::size_t count, double rate, int& conversation) {
  double t = 0.0;
  for (std::size_t c = 0; c < count;) {
    t += std::exponential_distribution<double>(rate)(world.rng);
    std::uint64_t tokens = world.log_uniform_tokens(16, 4096);
    double hop_t = t;
    for (const int route : routes) {
      if (c >= count) {
        break;
      }
      world.add_transfer(hop_t, route, tokens, conversation);
      ++c;
      tokens += world.log_uniform_tokens(16, 6000);
      hop_t += world.uniform(0.5, 3.0);
    }
    ++conversation;
  }
  world.horizon_s = std::max(world.horizon_s, t + 40.0);
}

void add_random(World& world, const std::vector<int>& routes, std::size_t count, double rate) {
  double t = 0.0;
  for (std::size_t c = 0; c < count; ++c) {
    t += std::exponential_distribution<double>(rate)(world.rng);
    const auto pick = std::uniform_int_distribution<std::size_t>(0, routes.size() - 1)(world.rng);
    world.add_transfer(t, routes[pick], world.log_uniform_tokens(16, 32768), -1);
  }
  world.horizon_s = std::max(world.horizon_s, t + 1.0);
}

}  // namespace

Workload build_workload(const std::string& kind, std::size_t transfers, std::uint64_t seed) {
  World world;
  world.rng.seed(seed);
  world.w.name = kind;
  world.w.true_media = true_media();
  world.w.prior_media = prior_media(world.w.true_media);
  const bool mixed = kind == "mixed";
  const std::size_t parts = mixed ? 4 : 1;
  const std::size_t share = transfers / parts;
  int conversation = 0;
  // Workload parts are built on their own agents and links; "mixed" puts all of them side by side.
  std::vector<std::pair<std::vector<int>, bool>> pending;  // routes, is_chain
  if (kind == "chain_shm" || mixed) {
    const int shm = world.add_link("shm0", true, 10e9, 2e-5);
    std::vector<int> agents;
    for (int i = 0; i < 8; ++i) {
      agents.push_back(world.add_agent("chain" + std::to_string(i), 0, 0));
    }
    std::vector<int> routes;
    for (std::size_t i = 0; i + 1 < agents.size(); ++i) {
      routes.push_back(world.add_route(agents[i], agents[i + 1], shm, 0.97));
    }
    pending.emplace_back(routes, true);
  }
  if (kind == "fanout_10g" || mixed) {
    const int link = world.add_link("tcp10g", false, 1.25e9, 2e-4);
    const int hub = world.add_agent("hub", 0, 0);
    std::vector<int> routes;
    for (int i = 0; i < 8; ++i) {
      const int worker = world.add_agent("worker" + std::to_string(i), 1, i < 5 ? 0 : 1, i % 3 == 0);
      routes.push_back(world.add_route(hub, worker, link));
    }
    pending.emplace_back(routes, false);
  }
  if (kind == "fanin_1g" || mixed) {
    const int link = world.add_link("tcp1g", false, 1.25e8, 5e-4);
    const int sink = world.add_agent("reducer", 0, 0);
    std::vector<int> routes;
    for (int i = 0; i < 8; ++i) {
      const int mapper = world.add_agent("mapper" + std::to_string(i), 2, i < 6 ? 0 : 1);
      routes.push_back(world.add_route(mapper, sink, link));
    }
    pending.emplace_back(routes, false);
  }
  if (mixed) {
    const int link = world.add_link("tcp25g", false, 3.125e9, 1e-4);
    std::vector<int> routes;
    const int a = world.add_agent("planner", 3, 0);
    for (int i = 0; i < 4; ++i) {
      const int b = world.add_agent("tool" + std::to_string(i), 4, i < 3 ? 0 : 1, i == 0);
      routes.push_back(world.add_route(a, b, link));
      routes.push_back(world.add_route(b, a, link));
    }
    pending.emplace_back(routes, false);
  }
  for (const auto& [routes, chain] : pending) {
    if (chain) {
      add_chains(world, routes, share, 10.0, conversation);
    } else {
      add_random(world, routes, share, 60.0);
    }
  }
  setup_dynamics(world);
  world.finish(0.2);
  return std::move(world.w);
}

}  // namespace kvrelay::sim
