#pragma once

// The simulated world: agents on nodes, links between nodes, receivers with load, and a trace
// of context transfers. Every random draw (bandwidth at that moment, measurement noise, load)
// is made once when the trace is built, so every policy is judged on exactly the same events
// and the true cost of every medium for every transfer is known to the oracle.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "kvrelay/decision/decision_engine.h"

namespace kvrelay::sim {

using decision::kMaxMedia;
using decision::MediumSpec;

struct SimAgent {
  std::string id;
  int node = 0;
  int model = 0;  // index into kModels; equal index = equal fingerprint
  bool accepts_sparse = false;
};

struct SimLink {
  std::string id;
  bool shm = false;
  double nominal_bytes_per_s = 0.0;
  double rtt_s = 0.0;
};

struct SimRoute {
  std::string id;
  int from = 0;
  int to = 0;
  int link = 0;
  double quality_floor = 0.0;
};

// What the engine may measure at an event: always noisy, never the true cost directly.
struct Observation {
  double link_bytes_per_s = 0.0;  // a measured transfer or probe rate
  double rtt_s = 0.0;
  std::uint64_t suffix_tokens = 0;  // the receiver's own prompt prefill after the hand-off
  double suffix_prefill_s = 0.0;
  double noise = 1.0;  // multiplicative noise on the chosen medium's measured prefill/codec times
};

struct Transfer {
  double time_s = 0.0;
  int route = 0;
  std::uint64_t tokens = 0;
  std::uint64_t cached = 0;
  int conversation = -1;  // chain hops of one context share it (quality floor bookkeeping)
  std::uint32_t output_tokens = 256;
  // True cost per medium id; +inf where the medium cannot be used for structural reasons.
  std::array<double, kMaxMedia> true_cost{};
  // True ingredients, for turning the chosen medium into measurements.
  double bytes_per_s = 0.0;
  double prefill_s = 0.0;  // true prefill of the missing tokens
  Observation observation;
};

struct Probe {
  double time_s = 0.0;
  int link = 0;
  double bytes_per_s = 0.0;  // noisy
  double rtt_s = 0.0;
};

struct Workload {
  std::string name;
  std::vector<SimAgent> agents;
  std::vector<SimLink> links;
  std::vector<SimRoute> routes;
  std::vector<Transfer> transfers;
  std::vector<Probe> probes;
  std::vector<MediumSpec> true_media;   // what the codecs really do on this host
  std::vector<MediumSpec> prior_media;  // what codec_bench told the engine (close, not equal)
};

struct ModelSpec {
  std::string name;
  double kv_bytes_per_token;
  decision::PrefillCoefficients prefill;  // on an unloaded receiver
  double decode_s_per_token;
};
extern const std::array<ModelSpec, 2> kModels;

// Workload kinds: "chain_shm", "fanout_10g", "fanin_1g", "mixed".
[[nodiscard]] Workload build_workload(const std::string& kind, std::size_t transfers, std::uint64_t seed);

}  // namespace kvrelay::sim
