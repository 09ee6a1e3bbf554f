#include "policies.h"

#include <cmath>
#include <map>
#include <random>
#include <stdexcept>

namespace kvrelay::sim {

namespace {

constexpr std::size_t kTokens = 0;
constexpr std::size_t kRaw = 1;

// Chain fidelity per conversation, kept by each policy for its own choices.
class Chains {
 public:
  double fidelity(int conversation) const {
    const auto it = map_.find(conversation);
    return it == map_.end() ? 1.0 : it->second;
  }
  void record(int conversation, const MediumSpec& chosen) {
    if (conversation < 0) {
      return;
    }
    double& f = map_.try_emplace(conversation, 1.0).first->second;
    if (chosen.kind == decision::MediumKind::kTokens) {
      f = 1.0;
    } else if (!chosen.lossless()) {
      f *= chosen.profile.fidelity;
    }
  }

 private:
  std::map<int, double> map_;
};

bool eligible(const Workload& w, const Transfer& x, std::size_t m, double chain) {
  if (m >= w.true_media.size() || !std::isfinite(x.true_cost[m])) {
    return false;
  }
  const MediumSpec& spec = w.true_media[m];
  const double floor = w.routes[static_cast<std::size_t>(x.route)].quality_floor;
  if (spec.lossless()) {
    return true;
  }
  return chain >= floor && spec.profile.fidelity * chain >= floor;
}

// Shared bookkeeping: latency, per-route switches, chain fidelity.
class Recorder {
 public:
  Recorder(const Workload& w, std::string name) : w_(w), last_(w.routes.size(), -1) {
    run_.name = std::move(name);
    run_.latency_s.reserve(w.transfers.size());
  }
  void record(const Transfer& x, std::size_t m) {
    if (!std::isfinite(x.true_cost[m])) {
      throw std::logic_error(run_.name + " chose an impossible medium");
    }
    run_.latency_s.push_back(x.true_cost[m]);
    run_.chosen.push_back(static_cast<int>(m));
    int& last = last_[static_cast<std::size_t>(x.route)];
    if (last >= 0 && last != static_cast<int>(m)) {
      ++run_.switches;
    }
    last = static_cast<int>(m);
    chains.record(x.conversation, w_.true_media[m]);
  }
  PolicyRun take() { return std::move(run_); }
  Chains chains;

 private:
  const Workload& w_;
  PolicyRun run_;
  std::vector<int> last_;
};

}  // namespace

PolicyRun run_always(const Workload& w, const std::string& name, std::size_t medium) {
  Recorder rec(w, name);
  for (const Transfer& x : w.transfers) {
    const double chain = rec.chains.fidelity(x.conversation);
    // Fixed policies fall back to the nearest thing that works: raw KV, then tokens.
    std::size_t m = medium;
    if (!eligible(w, x, m, chain)) {
      m = eligible(w, x, kRaw, chain) ? kRaw : kTokens;
    }
    rec.record(x, m);
  }
  return rec.take();
}

PolicyRun run_threshold(const Workload& w, std::uint64_t min_tokens) {
  Recorder rec(w, "threshold_" + std::to_string(min_tokens));
  for (const Transfer& x : w.transfers) {
    const bool kv = x.tokens >= min_tokens && std::isfinite(x.true_cost[kRaw]);
    rec.record(x, kv ? kRaw : kTokens);
  }
  return rec.take();
}

PolicyRun run_oracle(const Workload& w) {
  Recorder rec(w, "oracle");
  for (const Transfer& x : w.transfers) {
    const double chain = rec.chains.fidelity(x.conversation);
    std::size_t best = kTokens;
    for (std::size_t m = 0; m < w.true_media.size(); ++m) {
      if (eligible(w, x, m, chain) && x.true_cost[m] < x.true_cost[best]) {
        best = m;
      }
    }
    rec.record(x, best);
  }
  return rec.take();
}

PolicyRun run_engine(const Workload& w) {
  decision::EngineConfig config;
  config.load_builtin_media = false;
  decision::DecisionEngine engine(config);
  for (std::size_t m = 1; m < w.prior_media.size(); ++m) {
    if (!engine.add_medium(w.prior_media[m])) {
      throw std::logic_error("cannot register " + w.prior_media[m].name);
    }
  }
  std::vector<decision::AgentId> agents;
  for (const SimAgent& a : w.agents) {
    const ModelSpec& model = kModels[static_cast<std::size_t>(a.model)];
    decision::AgentParams p;
    p.id = a.id;
    p.fingerprint_id = static_cast<std::uint64_t>(a.model) + 1;
    p.kv_bytes_per_token = model.kv_bytes_per_token;
    p.dtype = DType::kFloat16;
    p.accepts_sparse = a.accepts_sparse;
    p.prefill_prior = model.prefill;  // measured on an idle worker; load is learned online
    p.decode_s_per_token = model.decode_s_per_token;
    agents.push_back(engine.add_agent(p).value());
  }
  std::vector<decision::LinkId> links;
  for (const SimLink& l : w.links) {
    links.push_back(engine.add_link(decision::LinkParams{l.id, l.shm, l.nominal_bytes_per_s, l.rtt_s}).value());
  }
  std::vector<decision::RouteId> routes;
  for (const SimRoute& r : w.routes) {
    RoutePolicy policy;
    policy.id = r.id;
    policy.from_agent = w.agents[static_cast<std::size_t>(r.from)].id;
    policy.to_agent = w.agents[static_cast<std::size_t>(r.to)].id;
    policy.quality_floor = r.quality_floor;
    routes.push_back(engine.add_route(policy, links[static_cast<std::size_t>(r.link)]).value());
  }

  Recorder rec(w, "kvrelay");
  // Background codec calibration: every few seconds the sidecar runs each codec over a sample
  // of KV it holds and feeds the measured ratio and throughput in (noisy, like any timing).
  std::mt19937_64 calibration_rng(12345);
  std::lognormal_distribution<double> calibration_noise(0.0, 0.05);
  double next_calibration = 0.0;
  constexpr double kCalibrationEvery = 2.0;
  constexpr double kCalibrationBytes = 64e6;
  std::size_t probe = 0;
  constexpr double kProbeBytes = 4e6;
  for (const Transfer& x : w.transfers) {
    for (; probe < w.probes.size() && w.probes[probe].time_s <= x.time_s; ++probe) {
      const Probe& p = w.probes[probe];
      engine.observe_link(links[static_cast<std::size_t>(p.link)], kProbeBytes, kProbeBytes / p.bytes_per_s);
      engine.observe_rtt(links[static_cast<std::size_t>(p.link)], p.rtt_s);
    }
    for (; next_calibration <= x.time_s; next_calibration += kCalibrationEvery) {
      for (std::size_t m = 0; m < w.true_media.size(); ++m) {
        const auto& p = w.true_media[m].profile;
        if (p.encode_bytes_per_s > 0) {
          engine.observe_codec(static_cast<decision::MediumId>(m), DType::kFloat16, kCalibrationBytes,
                               kCalibrationBytes * p.ratio[1] * calibration_noise(calibration_rng),
                               kCalibrationBytes / p.encode_bytes_per_s * calibration_noise(calibration_rng),
                               kCalibrationBytes / p.decode_bytes_per_s * calibration_noise(calibration_rng));
        }
      }
    }
    const SimRoute& r = w.routes[static_cast<std::size_t>(x.route)];
    decision::TransferShape shape;
    shape.tokens = x.tokens;
    shape.receiver_cached = x.cached;
    shape.chain_fidelity = rec.chains.fidelity(x.conversation);
    shape.now_s = x.time_s;
    shape.expected_output_tokens = x.output_tokens;
    const auto decided = engine.decide(routes[static_cast<std::size_t>(x.route)], shape);
    if (!decided) {
      throw std::logic_error(decided.error().to_string());
    }
    const std::size_t m = decided.value().chosen;
    rec.record(x, m);

    // What the sidecar measures afterwards, all with noise.
    const decision::AgentId receiver = agents[static_cast<std::size_t>(r.to)];
    const decision::LinkId link = links[static_cast<std::size_t>(r.link)];
    const Observation& o = x.observation;
    const std::uint64_t missing = x.tokens - x.cached;
    if (m == kTokens) {
      engine.observe_prefill(receiver, missing, x.cached, x.prefill_s * o.noise);
    } else if (missing > 0) {
      const MediumSpec& truth = w.true_media[m];
      const double raw =
          static_cast<double>(missing) *
          kModels[static_cast<std::size_t>(w.agents[static_cast<std::size_t>(r.from)].model)].kv_bytes_per_token;
      const double wire = raw * truth.profile.ratio[1];
      engine.observe_link(link, wire, wire / o.link_bytes_per_s);
      if (truth.profile.encode_bytes_per_s > 0) {
        engine.observe_codec(static_cast<decision::MediumId>(m), DType::kFloat16, raw, wire,
                             raw / truth.profile.encode_bytes_per_s * o.noise,
                             raw / truth.profile.decode_bytes_per_s * o.noise);
      }
    }
    engine.observe_rtt(link, o.rtt_s);
    engine.observe_prefill(receiver, o.suffix_tokens, x.tokens, o.suffix_prefill_s);
  }
  return rec.take();
}

}  // namespace kvrelay::sim
