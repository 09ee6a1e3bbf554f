#pragma once

// Per-transfer medium choice: predict C_comm + C_codec + C_comp + C_loss for every candidate
// over the blocks the receiver lacks, exclude what the route, the fingerprints or the quality
// floor forbid, take the argmin, and hold the route's previous medium unless the predicted gain
// beats the route's hysteresis threshold after a minimum dwell.
//
// Agents, links, routes and media are interned to dense ids at setup; decide() touches only
// vectors indexed by those ids and fills a fixed-size Decision, so it allocates nothing.

#include <boost/unordered/unordered_flat_map.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/core/dtype.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"
#include "kvrelay/decision/estimators.h"
#include "kvrelay/decision/media.h"

namespace kvrelay::decision {

using AgentId = std::uint32_t;
using LinkId = std::uint32_t;
using RouteId = std::uint32_t;
inline constexpr MediumId kNoMedium = 0xFF;

// Why a candidate could not be chosen (kNone: it was eligible).
enum class Exclusion : std::uint8_t {
  kNone,
  kRouteDisabled,        // the route is disabled: context moves as tokens only
  kNotAllowed,           // not in the route's allowed_media
  kNotForced,            // the route forces another medium
  kFingerprintMismatch,  // KV needs identical sender and receiver fingerprints
  kSparseUnsupported,    // receiver did not declare position-sparse KV support
  kBelowQualityFloor,    // codec fidelity (times the chain so far) below the route's floor
  kPrecisionRefresh,     // chain fidelity already below the floor: lossless only
  kCodecUnavailable,     // a plugin medium whose codec this process has not loaded
  kBytesOnlyDtype,       // a lossy or sparse medium for fp8 KV, which moves only as bytes
  kSummaryUnavailable,   // no summary can be made for this transfer (TransferShape::summary_possible)
};
[[nodiscard]] std::string_view exclusion_name(Exclusion exclusion) noexcept;

// How the chosen medium came about.
enum class DecisionReason : std::uint8_t {
  kFirstDecision,       // no previous choice for this route and length regime
  kArgmin,              // the argmin equals the previous choice
  kSwitched,            // the argmin beat the previous choice by more than the threshold
  kHysteresisHeld,      // gain below the threshold: previous choice kept
  kDwellHeld,           // gain above the threshold but the minimum dwell has not passed
  kPreviousIneligible,  // previous choice is now excluded, argmin taken
  kForced,              // the route forces this medium
  kRouteDisabled,
};
[[nodiscard]] std::string_view decision_reason_name(DecisionReason reason) noexcept;

struct CandidateCost {
  MediumId medium = kNoMedium;
  Exclusion excluded = Exclusion::kNone;
  double comm_s = 0.0;
  double codec_s = 0.0;
  double comp_s = 0.0;
  double loss_s = 0.0;
  double audit_s = 0.0;  // the route's live audit correction for this medium (included in total_s)
  double total_s = 0.0;
  double wire_bytes = 0.0;
};

// One context move as the engine sees it.
struct TransferShape {
  std::uint64_t tokens = 0;                    // context length at the sender
  std::uint64_t receiver_cached = 0;           // leading tokens the receiver already holds (block aligned)
  double chain_fidelity = 1.0;                 // product of lossy-hop fidelities this context went through
  double now_s = 0.0;                          // caller's clock (monotonic or virtual), for the dwell
  std::uint32_t expected_output_tokens = 256;  // scales the decode cost of quality loss
  std::optional<DType> dtype;                  // the KV's, when the caller knows it; else the sender's
  // Whether a summary may stand in for the context: the front proxy asks before B's request
  // leaves; a worker's lookup comes after, when a request not summarised can no longer be.
  bool summary_possible = true;
};

struct Decision {
  RouteId route = 0;
  MediumId chosen = kNoMedium;
  MediumId argmin = kNoMedium;
  MediumId previous = kNoMedium;
  DecisionReason reason = DecisionReason::kFirstDecision;
  bool hysteresis_held = false;  // the previous choice was kept over a cheaper argmin
  bool deadline_miss = false;    // even the chosen medium is predicted past the route deadline
  double predicted_gain = 0.0;   // (cost(previous) - cost(argmin)) / cost(previous)
  double chain_fidelity_after = 1.0;
  std::uint64_t missing_tokens = 0;
  DType dtype = DType::kFloat16;  // of the KV decided about (fp8: no lossy candidate)
  std::uint8_t candidate_count = 0;
  std::array<CandidateCost, kMaxMedia> candidates{};

  [[nodiscard]] const CandidateCost& cost_of(MediumId medium) const noexcept;
};

struct AgentParams {
  std::string id;
  std::uint64_t fingerprint_id = 0;  // ModelFingerprint::id()
  double kv_bytes_per_token = 0.0;   // all layers, K and V
  DType dtype = DType::kFloat16;
  bool accepts_sparse = false;
  int role_priority = 0;
  PrefillCoefficients prefill_prior{0.01, 2e-4, 1e-9};  // seconds, as a receiver
  double decode_s_per_token = 0.02;
};

struct LinkParams {
  std::string id;
  bool shm = false;  // same host: the prior is the measured copy bandwidth
  double prior_bytes_per_s = 1.25e8;
  double prior_rtt_s = 5e-4;
};

struct EngineConfig {
  std::size_t link_window = 16;
  std::size_t rtt_window = 16;
  std::size_t prefill_window = 64;
  std::size_t prefill_min_samples = 8;
  std::size_t codec_window = 32;
  std::size_t summary_window = 16;  // summariser calls per route in the mean
  double min_dwell_s = 0.5;
  bool load_builtin_media = true;
};

class DecisionEngine {
 public:
  explicit DecisionEngine(EngineConfig config = {});

  // Setup (not the hot path).
  [[nodiscard]] Result<MediumId> add_medium(MediumSpec spec);
  [[nodiscard]] Result<AgentId> add_agent(AgentParams params);
  [[nodiscard]] Result<LinkId> add_link(LinkParams params);
  // The route's from/to agents must exist. Route fields are copied (allowed media interned).
  [[nodiscard]] Result<RouteId> add_route(const RoutePolicy& policy, LinkId link);

  // Live settings: what a policy reload may change without a rebuild. Everything learned (link
  // throughput and RTT, prefill fits, decode rates, loads, codec ratios and speeds, measured
  // handoffs, the hysteresis state) is kept.
  // The route's allowed media, forced medium, enabled flag, hysteresis, quality floor, deadline;
  // refused (kUnsupported) when its from/to agents differ from the registered route's.
  [[nodiscard]] Status update_route(const RoutePolicy& policy);
  // The agent's sparse support, role priority and priors (prefill, decode); refused when its
  // fingerprint, KV size or dtype differ, as those change what every estimate means.
  [[nodiscard]] Status update_agent(const AgentParams& params);
  // A medium's calibrated quality (cost_model.media).
  [[nodiscard]] Status update_medium_quality(MediumId medium, double fidelity, double extra_decode_fraction);
  [[nodiscard]] const AgentParams& agent(AgentId id) const { return agents_[id].params; }

  [[nodiscard]] Result<MediumId> find_medium(std::string_view name) const;
  [[nodiscard]] Result<AgentId> find_agent(std::string_view id) const;
  [[nodiscard]] Result<LinkId> find_link(std::string_view id) const;
  [[nodiscard]] Result<RouteId> find_route(std::string_view id) const;
  [[nodiscard]] const MediumSpec& medium(MediumId id) const { return media_[id].spec; }
  [[nodiscard]] std::size_t media_count() const noexcept { return media_.size(); }
  [[nodiscard]] const std::string& route_name(RouteId id) const { return route_names_[id]; }
  [[nodiscard]] std::size_t route_count() const noexcept { return routes_.size(); }

  // Hot path: decide and remember the choice for the route's hysteresis.
  [[nodiscard]] Result<Decision> decide(RouteId route, const TransferShape& shape);
  // The same, filling a caller-owned Decision (no ~1 KiB copy through the Result).
  [[nodiscard]] Status decide_into(RouteId route, const TransferShape& shape, Decision& out);
  // The same prediction without touching any state (what-if, admin, oracle comparisons).
  [[nodiscard]] Result<Decision> predict(RouteId route, const TransferShape& shape) const;

  // Measurements. Invalid ids or non-finite values are ignored (they come from the data path).
  void observe_prefill(AgentId receiver, std::uint64_t new_tokens, std::uint64_t cached_tokens,
                       double seconds) noexcept;
  void observe_decode(AgentId receiver, std::uint64_t tokens, double seconds) noexcept;
  // The receiver's engine load (its metrics page: requests waiting for a slot). A re-prefill on a
  // receiver with n requests waiting delays each of them by its own duration, so the compute term
  // is charged (1 + n) times: the latency it adds across the node, not only to this transfer.
  void observe_load(AgentId receiver, double requests_waiting) noexcept;
  void observe_link(LinkId link, double bytes, double seconds) noexcept;
  void observe_rtt(LinkId link, double seconds) noexcept;
  // One encode and/or decode of `raw_bytes` into `encoded_bytes`; a time that is not finite and
  // positive leaves that side out (a sidecar times its encodes when serving and its decodes when
  // fetching), the ratio is still observed.
  void observe_codec(MediumId medium, DType dtype, double raw_bytes, double encoded_bytes, double encode_s,
                     double decode_s) noexcept;
  // A finished handoff over `route` with KV medium `medium`: the receiver's time from asking for
  // the context to starting its prefill (fetch, decode into memory, the shared-memory handoff,
  // the worker's import) for `raw_bytes` of KV. The link and codec estimates miss the receiver's
  // side (on a VM, decoding or importing into fresh memory costs more than the wire), so once a
  // route has a sample for a medium, this measured cost replaces comm + codec in its prediction.
  void observe_handoff(RouteId route, MediumId medium, double raw_bytes, double seconds) noexcept;
  // Live audit calibration (issue #28): seconds added to `medium`'s predicted cost on `route`,
  // refitted from the route's audited outcomes (broker/live_calibration.h). Tokens stay the
  // reference at 0. Ignored for bad ids or a non-finite value.
  void set_audit_correction(RouteId route, MediumId medium, double seconds) noexcept;
  // One summariser call for a handoff on `route` took `seconds` (request to the summary's last
  // byte, docs/summary.md): the summary medium's generation time is the mean of the route's last
  // summary_window calls; before any, the sender's decode time per token x the token budget.
  void observe_summary(RouteId route, double seconds) noexcept;
  [[nodiscard]] double summariser_seconds(RouteId route) const noexcept;
  [[nodiscard]] double audit_correction(RouteId route, MediumId medium) const noexcept;

  // Current windowed estimates, for the decision log and tests.
  [[nodiscard]] double link_bytes_per_s(LinkId link) const;
  [[nodiscard]] double link_rtt_s(LinkId link) const;
  [[nodiscard]] PrefillCoefficients prefill_coefficients(AgentId agent) const;

 private:
  // Length regimes (powers of 4 from 64 tokens) keep separate hysteresis state: a route whose
  // contexts alternate between short and long should follow the break-even length, which is a
  // property of the request, not noise in the estimates.
  static constexpr std::size_t kRegimes = 7;

  struct MediumState {
    MediumSpec spec;
    std::array<WindowedMean, kDtypeSlots> ratio;  // per dtype_slot()
    WindowedRate encode;
    WindowedRate decode;
  };
  struct AgentState {
    AgentParams params;
    PrefillFit prefill;
    WindowedRate decode_tokens;
    double requests_waiting = 0.0;
  };
  // What evaluate() reads about an agent, one cache line, refreshed when estimates change.
  struct AgentHot {
    std::uint64_t fingerprint_id = 0;
    double kv_bytes_per_token = 0.0;
    double decode_s_per_token = 0.0;
    PrefillCoefficients prefill;
    DType dtype = DType::kFloat16;
    bool accepts_sparse = false;
  };
  struct LinkState {
    LinkParams params;
    WindowedRate throughput;
    WindowedMean rtt;
  };
  struct RouteState {
    AgentId from = 0;
    AgentId to = 0;
    LinkId link = 0;
    bool enabled = true;
    std::uint32_t allowed_mask = 0;  // bit per MediumId; all set when the policy lists none
    MediumId forced = kNoMedium;
    double threshold = 0.15;
    double quality_floor = 0.0;
    double deadline_s = 0.0;  // 0: none
    std::array<MediumId, kRegimes> current{};
    std::array<double, kRegimes> since{};
    std::array<LinearCostFit, kMaxMedia> handoff{};    // per medium, seconds over raw KV bytes
    std::array<double, kMaxMedia> audit_correction{};  // per medium, seconds (live calibration)
    std::uint32_t summary_tokens = 64;                 // the summary's budget (routes[].summary.max_tokens)
    WindowedMean summariser{16, 0.0};                  // seconds per summariser call, measured
  };

  [[nodiscard]] Status fill_route_settings(const RoutePolicy& policy, RouteState& state) const;
  void evaluate(const RouteState& route, const TransferShape& shape, Decision& out) const noexcept;
  void refresh_hot(AgentId agent) noexcept;
  [[nodiscard]] double summariser_estimate(const RouteState& route) const noexcept;
  [[nodiscard]] static std::size_t regime_of(std::uint64_t tokens) noexcept;

  EngineConfig config_;
  std::vector<MediumState> media_;
  std::vector<AgentState> agents_;
  std::vector<AgentHot> agent_hot_;
  std::vector<std::string> route_names_;
  std::vector<LinkState> links_;
  std::vector<RouteState> routes_;
  boost::unordered_flat_map<std::string, MediumId> medium_ids_;
  boost::unordered_flat_map<std::string, AgentId> agent_ids_;
  boost::unordered_flat_map<std::string, LinkId> link_ids_;
  boost::unordered_flat_map<std::string, RouteId> route_ids_;
};

}  // namespace kvrelay::decision
