#include "kvrelay/decision/decision_engine.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

namespace kvrelay::decision {

std::string_view exclusion_name(Exclusion exclusion) noexcept {
  switch (exclusion) {
    case Exclusion::kNone:
      return "none";
    case Exclusion::kRouteDisabled:
      return "route_disabled";
    case Exclusion::kNotAllowed:
      return "not_allowed";
    case Exclusion::kNotForced:
      return "not_forced";
    case Exclusion::kFingerprintMismatch:
      return "fingerprint_mismatch";
    case Exclusion::kSparseUnsupported:
      return "sparse_unsupported";
    case Exclusion::kBelowQualityFloor:
      return "below_quality_floor";
    case Exclusion::kPrecisionRefresh:
      return "precision_refresh";
    case Exclusion::kCodecUnavailable:
      return "codec_unavailable";
    case Exclusion::kBytesOnlyDtype:
      return "fp8_moves_as_bytes";
    case Exclusion::kSummaryUnavailable:
      return "summary_unavailable";
  }
  return "unknown";
}

std::string_view decision_reason_name(DecisionReason reason) noexcept {
  switch (reason) {
    case DecisionReason::kFirstDecision:
      return "first_decision";
    case DecisionReason::kArgmin:
      return "argmin";
    case DecisionReason::kSwitched:
      return "switched";
    case DecisionReason::kHysteresisHeld:
      return "hysteresis_held";
    case DecisionReason::kDwellHeld:
      return "dwell_held";
    case DecisionReason::kPreviousIneligible:
      return "previous_ineligible";
    case DecisionReason::kForced:
      return "forced";
    case DecisionReason::kRouteDisabled:
      return "route_disabled";
  }
  return "unknown";
}

const CandidateCost& Decision::cost_of(MediumId medium) const noexcept {
  // Candidates are stored at their medium id, so this is an index, bounds-checked.
  return candidates[std::min<std::size_t>(medium, kMaxMedia - 1)];
}

DecisionEngine::DecisionEngine(EngineConfig config) : config_(config) {
  if (config_.load_builtin_media) {
    for (const BuiltinMedium& builtin : builtin_media()) {
      // Built-in names are distinct and fewer than kMaxMedia, so this cannot fail.
      (void)add_medium(builtin_medium(builtin.name));
    }
  } else {
    (void)add_medium(builtin_medium("tokens"));
  }
}

Result<MediumId> DecisionEngine::add_medium(MediumSpec spec) {
  if (medium_ids_.contains(spec.name)) {
    return fail(ErrorCode::kAlreadyExists, "medium '" + spec.name + "' already registered");
  }
  if (media_.size() >= kMaxMedia) {
    return fail(ErrorCode::kResourceExhausted, "at most 16 media can be registered");
  }
  if (media_.empty() && spec.kind != MediumKind::kTokens) {
    return fail(ErrorCode::kInvalidArgument, "the first medium must be tokens");
  }
  if (!(spec.profile.fidelity > 0.0 && spec.profile.fidelity <= 1.0) || !(spec.profile.extra_decode_fraction >= 0.0) ||
      spec.profile.encode_bytes_per_s < 0.0 || spec.profile.decode_bytes_per_s < 0.0) {
    return fail(ErrorCode::kInvalidArgument, "medium '" + spec.name + "' has an invalid codec profile");
  }
  for (const double ratio : spec.profile.ratio) {
    if (!(ratio > 0.0 && ratio <= 4.0)) {
      return fail(ErrorCode::kInvalidArgument, "medium '" + spec.name + "' has an invalid ratio");
    }
  }
  const auto id = static_cast<MediumId>(media_.size());
  const CodecProfile& p = spec.profile;
  MediumState state{spec,
                    {WindowedMean(config_.codec_window, p.ratio[0]), WindowedMean(config_.codec_window, p.ratio[1]),
                     WindowedMean(config_.codec_window, p.ratio[2]), WindowedMean(config_.codec_window, p.ratio[3])},
                    WindowedRate(config_.codec_window, p.encode_bytes_per_s),
                    WindowedRate(config_.codec_window, p.decode_bytes_per_s)};
  medium_ids_.emplace(spec.name, id);
  media_.push_back(std::move(state));
  return id;
}

Result<AgentId> DecisionEngine::add_agent(AgentParams params) {
  if (agent_ids_.contains(params.id)) {
    return fail(ErrorCode::kAlreadyExists, "agent '" + params.id + "' already registered");
  }
  if (!(params.kv_bytes_per_token >= 0.0) || !(params.decode_s_per_token >= 0.0)) {
    return fail(ErrorCode::kInvalidArgument, "agent '" + params.id + "' has invalid parameters");
  }
  const auto id = static_cast<AgentId>(agents_.size());
  agent_ids_.emplace(params.id, id);
  const double decode_rate = params.decode_s_per_token > 0.0 ? 1.0 / params.decode_s_per_token : 0.0;
  AgentState state{params, PrefillFit(config_.prefill_window, config_.prefill_min_samples, params.prefill_prior),
                   WindowedRate(config_.prefill_window, decode_rate)};
  agents_.push_back(std::move(state));
  agent_hot_.emplace_back();
  refresh_hot(id);
  return id;
}

void DecisionEngine::refresh_hot(AgentId agent) noexcept {
  const AgentState& state = agents_[agent];
  AgentHot& hot = agent_hot_[agent];
  hot.fingerprint_id = state.params.fingerprint_id;
  hot.kv_bytes_per_token = state.params.kv_bytes_per_token;
  const double decode_rate = state.decode_tokens.per_second();
  hot.decode_s_per_token = decode_rate > 0.0 ? 1.0 / decode_rate : state.params.decode_s_per_token;
  // Scaling every coefficient scales the prediction: predict() is linear in them.
  const double load_weight = 1.0 + state.requests_waiting;
  const PrefillCoefficients fit = state.prefill.coefficients();
  hot.prefill = PrefillCoefficients{fit.a * load_weight, fit.b * load_weight, fit.c * load_weight};
  hot.accepts_sparse = state.params.accepts_sparse;
  hot.dtype = state.params.dtype;
}

Result<LinkId> DecisionEngine::add_link(LinkParams params) {
  if (link_ids_.contains(params.id)) {
    return fail(ErrorCode::kAlreadyExists, "link '" + params.id + "' already registered");
  }
  if (!(params.prior_bytes_per_s > 0.0) || !(params.prior_rtt_s >= 0.0)) {
    return fail(ErrorCode::kInvalidArgument, "link '" + params.id + "' needs a positive bandwidth prior");
  }
  const auto id = static_cast<LinkId>(links_.size());
  link_ids_.emplace(params.id, id);
  LinkState state{params, WindowedRate(config_.link_window, params.prior_bytes_per_s),
                  WindowedMean(config_.rtt_window, params.prior_rtt_s)};
  links_.push_back(std::move(state));
  return id;
}

Status DecisionEngine::fill_route_settings(const RoutePolicy& policy, RouteState& state) const {
  state.enabled = policy.enabled;
  state.threshold = std::max(0.0, policy.hysteresis_threshold);
  state.quality_floor = std::clamp(policy.quality_floor, 0.0, 1.0);
  state.deadline_s = policy.deadline ? static_cast<double>(policy.deadline->count()) / 1000.0 : 0.0;
  std::uint32_t allowed = 0;
  if (policy.allowed_media.empty()) {
    allowed = ~0U;
    // "Every medium" means every way to move the context itself: a summary replaces it, so a
    // route takes one only where it names it.
    for (std::size_t i = 0; i < media_.size(); ++i) {
      if (media_[i].spec.kind == MediumKind::kSummary) allowed &= ~(1U << i);
    }
  } else {
    for (const std::string& name : policy.allowed_media) {
      KVRELAY_TRY(const MediumId id, find_medium(name));
      allowed |= 1U << id;
    }
  }
  state.forced = kNoMedium;
  if (policy.forced_medium) {
    KVRELAY_TRY(const MediumId forced, find_medium(*policy.forced_medium));
    state.forced = forced;
  }
  state.allowed_mask = allowed;
  state.summary_tokens = policy.summary.max_tokens;
  return ok();
}

Result<RouteId> DecisionEngine::add_route(const RoutePolicy& policy, LinkId link) {
  if (route_ids_.contains(policy.id)) {
    return fail(ErrorCode::kAlreadyExists, "route '" + policy.id + "' already registered");
  }
  if (link >= links_.size()) {
    return fail(ErrorCode::kNotFound, "route '" + policy.id + "': unknown link");
  }
  KVRELAY_TRY(const AgentId from, find_agent(policy.from_agent));
  KVRELAY_TRY(const AgentId to, find_agent(policy.to_agent));
  RouteState state;
  state.from = from;
  state.to = to;
  state.link = link;
  state.summariser = WindowedMean(config_.summary_window, 0.0);
  KVRELAY_TRY(fill_route_settings(policy, state));
  state.current.fill(kNoMedium);
  state.since.fill(0.0);
  const auto id = static_cast<RouteId>(routes_.size());
  route_ids_.emplace(policy.id, id);
  routes_.push_back(state);
  route_names_.push_back(policy.id);
  return id;
}

Status DecisionEngine::update_route(const RoutePolicy& policy) {
  KVRELAY_TRY(const RouteId id, find_route(policy.id));
  KVRELAY_TRY(const AgentId from, find_agent(policy.from_agent));
  KVRELAY_TRY(const AgentId to, find_agent(policy.to_agent));
  RouteState& state = routes_[id];
  if (state.from != from || state.to != to) {
    return fail(ErrorCode::kUnsupported, "route '" + policy.id + "' connects other agents: rebuild the engine");
  }
  // Filled into a copy first so a bad medium name leaves the route as it was.
  RouteState updated = state;
  KVRELAY_TRY(fill_route_settings(policy, updated));
  state = updated;
  return ok();
}

Status DecisionEngine::update_agent(const AgentParams& params) {
  KVRELAY_TRY(const AgentId id, find_agent(params.id));
  AgentState& state = agents_[id];
  if (state.params.fingerprint_id != params.fingerprint_id ||
      state.params.kv_bytes_per_token != params.kv_bytes_per_token || state.params.dtype != params.dtype) {
    return fail(ErrorCode::kUnsupported, "agent '" + params.id + "' runs another model: rebuild the engine");
  }
  if (!(params.decode_s_per_token >= 0.0)) {
    return fail(ErrorCode::kInvalidArgument, "agent '" + params.id + "' has invalid parameters");
  }
  const PrefillCoefficients& prior = state.params.prefill_prior;
  if (prior.a != params.prefill_prior.a || prior.b != params.prefill_prior.b || prior.c != params.prefill_prior.c) {
    state.prefill.set_prior(params.prefill_prior);  // refits over the kept window
  }
  state.decode_tokens.set_prior(params.decode_s_per_token > 0.0 ? 1.0 / params.decode_s_per_token : 0.0);
  state.params = params;
  refresh_hot(id);
  return ok();
}

Status DecisionEngine::update_medium_quality(MediumId medium, double fidelity, double extra_decode_fraction) {
  if (medium >= media_.size()) return fail(ErrorCode::kNotFound, "unknown medium id");
  if (!(fidelity > 0.0 && fidelity <= 1.0) || !(extra_decode_fraction >= 0.0)) {
    return fail(ErrorCode::kInvalidArgument, "medium '" + media_[medium].spec.name + "': invalid quality");
  }
  media_[medium].spec.profile.fidelity = fidelity;
  media_[medium].spec.profile.extra_decode_fraction = extra_decode_fraction;
  return ok();
}

namespace {

template <class Map>
auto find_id(const Map& map, std::string_view key, std::string_view what) -> Result<typename Map::mapped_type> {
  const auto it = map.find(std::string(key));
  if (it == map.end()) {
    return fail(ErrorCode::kNotFound, std::string(what) + " '" + std::string(key) + "' not registered");
  }
  return it->second;
}

}  // namespace

Result<MediumId> DecisionEngine::find_medium(std::string_view name) const {
  return find_id(medium_ids_, name, "medium");
}
Result<AgentId> DecisionEngine::find_agent(std::string_view id) const {
  return find_id(agent_ids_, id, "agent");
}
Result<LinkId> DecisionEngine::find_link(std::string_view id) const {
  return find_id(link_ids_, id, "link");
}
Result<RouteId> DecisionEngine::find_route(std::string_view id) const {
  return find_id(route_ids_, id, "route");
}

std::size_t DecisionEngine::regime_of(std::uint64_t tokens) noexcept {
  std::size_t regime = 0;
  std::uint64_t bound = 64;
  while (regime + 1 < kRegimes && tokens >= bound) {
    ++regime;
    bound *= 4;
  }
  return regime;
}

void DecisionEngine::evaluate(const RouteState& route, const TransferShape& shape, Decision& out) const noexcept {
  const AgentHot& sender = agent_hot_[route.from];
  const AgentHot& receiver = agent_hot_[route.to];
  const LinkState& link = links_[route.link];
  const bool kv_compatible = sender.fingerprint_id == receiver.fingerprint_id;
  const std::uint64_t cached = std::min(shape.receiver_cached, shape.tokens);
  const std::uint64_t missing = shape.tokens - cached;
  const double missing_d = static_cast<double>(missing);
  const double raw_kv_bytes = missing_d * sender.kv_bytes_per_token;
  const double bandwidth = std::max(link.throughput.per_second(), 1.0);
  const double rtt = link.rtt.mean();
  const double decode_s_per_token = receiver.decode_s_per_token;
  const bool refresh = shape.chain_fidelity < route.quality_floor;
  const DType dtype = shape.dtype.value_or(sender.dtype);
  const std::size_t dtype_index = dtype_slot(dtype);
  // fp8 KV is already the engine's quantization: only its bytes move (raw, lossless), never a
  // lossy or sparse re-encoding of it.
  const bool bytes_only = dtype_moves_as_bytes(dtype);

  out.missing_tokens = missing;
  out.dtype = dtype;
  out.candidate_count = static_cast<std::uint8_t>(media_.size());
  out.argmin = kNoMedium;
  double best = std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < media_.size(); ++i) {
    const MediumState& m = media_[i];
    CandidateCost& c = out.candidates[i];
    c = CandidateCost{};
    c.medium = static_cast<MediumId>(i);
    if (m.spec.kind == MediumKind::kTokens) {
      c.wire_bytes = missing_d * 4.0;  // uint32 token ids
      c.comm_s = c.wire_bytes / bandwidth + rtt;
      c.comp_s = receiver.prefill.predict(missing_d, static_cast<double>(cached));
    } else if (m.spec.kind == MediumKind::kSummary) {
      // The budget's token ids cross the link and B prefills them in place of the context (none
      // of which it can reuse), after the summariser generated them.
      const double budget = static_cast<double>(route.summary_tokens);
      c.wire_bytes = budget * 4.0;
      c.comm_s = c.wire_bytes / bandwidth + rtt;
      c.comp_s = receiver.prefill.predict(budget, 0.0) + summariser_estimate(route);
      c.loss_s =
          m.spec.profile.extra_decode_fraction * static_cast<double>(shape.expected_output_tokens) * decode_s_per_token;
    } else {
      const double ratio = m.ratio[dtype_index].mean();
      c.wire_bytes = raw_kv_bytes * ratio;
      c.comm_s = c.wire_bytes / bandwidth + rtt;
      const double enc = m.encode.per_second();
      const double dec = m.decode.per_second();
      c.codec_s = (enc > 0.0 ? raw_kv_bytes / enc : 0.0) + (dec > 0.0 ? raw_kv_bytes / dec : 0.0);
      if (const LinearCostFit& measured = route.handoff[i]; measured.samples() > 0) {
        // What handoffs with this medium on this route took, receiver's costs included.
        c.comm_s = measured.predict(raw_kv_bytes);
        c.codec_s = 0.0;
      }
      c.loss_s =
          m.spec.profile.extra_decode_fraction * static_cast<double>(shape.expected_output_tokens) * decode_s_per_token;
    }
    c.audit_s = route.audit_correction[i];
    c.total_s = c.comm_s + c.codec_s + c.comp_s + c.loss_s + c.audit_s;

    const double fidelity = m.spec.profile.fidelity;
    if (!route.enabled) {
      c.excluded = i == kTokensMedium ? Exclusion::kNone : Exclusion::kRouteDisabled;
    } else if (route.forced != kNoMedium && route.forced != i) {
      c.excluded = Exclusion::kNotForced;
    } else if ((route.allowed_mask & (1U << i)) == 0 && route.forced != i) {
      c.excluded = Exclusion::kNotAllowed;
    } else if (!m.spec.available) {
      c.excluded = Exclusion::kCodecUnavailable;
    } else if (m.spec.kind == MediumKind::kSummary && !shape.summary_possible) {
      c.excluded = Exclusion::kSummaryUnavailable;
    } else if (m.spec.needs_kv() && !kv_compatible) {
      c.excluded = Exclusion::kFingerprintMismatch;
    } else if (bytes_only && m.spec.needs_kv() && !m.spec.lossless()) {
      c.excluded = Exclusion::kBytesOnlyDtype;
    } else if (m.spec.kind == MediumKind::kKvSparse && !receiver.accepts_sparse) {
      c.excluded = Exclusion::kSparseUnsupported;
    } else if (!m.spec.lossless() && refresh) {
      c.excluded = Exclusion::kPrecisionRefresh;
    } else if (!m.spec.lossless() &&
               (fidelity < route.quality_floor || shape.chain_fidelity * fidelity < route.quality_floor)) {
      c.excluded = Exclusion::kBelowQualityFloor;
    }
    if (c.excluded == Exclusion::kNone && c.total_s < best) {
      best = c.total_s;
      out.argmin = c.medium;
    }
  }
  if (out.argmin == kNoMedium) {
    // A forced KV medium on an incompatible pair leaves nothing: tokens always work.
    out.argmin = kTokensMedium;
    out.candidates[kTokensMedium].excluded = Exclusion::kNone;
  }
}

Result<Decision> DecisionEngine::predict(RouteId route, const TransferShape& shape) const {
  if (route >= routes_.size()) {
    return fail(ErrorCode::kNotFound, "unknown route id");
  }
  Decision out;
  out.route = route;
  evaluate(routes_[route], shape, out);
  out.chosen = out.argmin;
  out.reason = DecisionReason::kArgmin;
  return out;
}

Result<Decision> DecisionEngine::decide(RouteId route, const TransferShape& shape) {
  Decision out;
  KVRELAY_TRY(decide_into(route, shape, out));
  return out;
}

Status DecisionEngine::decide_into(RouteId route_id, const TransferShape& shape, Decision& out) {
  if (route_id >= routes_.size()) {
    return fail(ErrorCode::kNotFound, "unknown route id");
  }
  RouteState& route = routes_[route_id];
  out = Decision{};
  out.route = route_id;
  evaluate(route, shape, out);
  const std::size_t regime = regime_of(shape.tokens);
  const MediumId previous = route.current[regime];
  out.previous = previous;
  out.chosen = out.argmin;
  if (!route.enabled) {
    out.reason = DecisionReason::kRouteDisabled;
  } else if (route.forced != kNoMedium && out.argmin == route.forced) {
    out.reason = DecisionReason::kForced;
  } else if (previous == kNoMedium) {
    out.reason = DecisionReason::kFirstDecision;
  } else if (previous == out.argmin) {
    out.reason = DecisionReason::kArgmin;
  } else if (out.candidates[previous].excluded != Exclusion::kNone) {
    out.reason = DecisionReason::kPreviousIneligible;
  } else {
    const double previous_cost = out.candidates[previous].total_s;
    const double gain =
        previous_cost > 0.0 ? (previous_cost - out.candidates[out.argmin].total_s) / previous_cost : 0.0;
    out.predicted_gain = gain;
    if (gain <= route.threshold) {
      out.chosen = previous;
      out.hysteresis_held = true;
      out.reason = DecisionReason::kHysteresisHeld;
    } else if (shape.now_s - route.since[regime] < config_.min_dwell_s) {
      out.chosen = previous;
      out.hysteresis_held = true;
      out.reason = DecisionReason::kDwellHeld;
    } else {
      out.reason = DecisionReason::kSwitched;
    }
  }
  if (out.chosen != previous) {
    route.current[regime] = out.chosen;
    route.since[regime] = shape.now_s;
  }
  const MediumSpec& chosen = media_[out.chosen].spec;
  if (chosen.kind == MediumKind::kTokens) {
    out.chain_fidelity_after = 1.0;  // the receiver recomputes the KV exactly
  } else if (chosen.lossless()) {
    out.chain_fidelity_after = shape.chain_fidelity;
  } else {
    out.chain_fidelity_after = shape.chain_fidelity * chosen.profile.fidelity;
  }
  out.deadline_miss = route.deadline_s > 0.0 && out.candidates[out.chosen].total_s > route.deadline_s;
  return ok();
}

void DecisionEngine::observe_prefill(AgentId receiver, std::uint64_t new_tokens, std::uint64_t cached_tokens,
                                     double seconds) noexcept {
  if (receiver < agents_.size()) {
    agents_[receiver].prefill.observe(new_tokens, cached_tokens, seconds);
    refresh_hot(receiver);
  }
}

void DecisionEngine::observe_load(AgentId receiver, double requests_waiting) noexcept {
  if (receiver < agents_.size() && std::isfinite(requests_waiting) && requests_waiting >= 0.0) {
    agents_[receiver].requests_waiting = requests_waiting;
    refresh_hot(receiver);
  }
}

void DecisionEngine::observe_decode(AgentId receiver, std::uint64_t tokens, double seconds) noexcept {
  if (receiver < agents_.size()) {
    agents_[receiver].decode_tokens.observe(static_cast<double>(tokens), seconds);
    refresh_hot(receiver);
  }
}

void DecisionEngine::observe_link(LinkId link, double bytes, double seconds) noexcept {
  if (link < links_.size()) {
    links_[link].throughput.observe(bytes, seconds);
  }
}

void DecisionEngine::observe_rtt(LinkId link, double seconds) noexcept {
  if (link < links_.size() && seconds >= 0.0) {
    links_[link].rtt.observe(seconds);
  }
}

void DecisionEngine::observe_codec(MediumId medium, DType dtype, double raw_bytes, double encoded_bytes,
                                   double encode_s, double decode_s) noexcept {
  if (medium >= media_.size() || !(raw_bytes > 0.0) || !(encoded_bytes >= 0.0)) {
    return;
  }
  MediumState& m = media_[medium];
  m.ratio[dtype_slot(dtype)].observe(encoded_bytes / raw_bytes);
  m.encode.observe(raw_bytes, encode_s);
  m.decode.observe(raw_bytes, decode_s);
}

void DecisionEngine::observe_handoff(RouteId route, MediumId medium, double raw_bytes, double seconds) noexcept {
  if (route >= routes_.size() || medium >= media_.size() || !media_[medium].spec.needs_kv()) return;
  routes_[route].handoff[medium].observe(raw_bytes, seconds);
}

double DecisionEngine::summariser_estimate(const RouteState& route) const noexcept {
  if (route.summariser.samples() > 0) return route.summariser.mean();
  return agent_hot_[route.from].decode_s_per_token * static_cast<double>(route.summary_tokens);
}

void DecisionEngine::observe_summary(RouteId route, double seconds) noexcept {
  if (route >= routes_.size() || !std::isfinite(seconds) || seconds < 0.0) return;
  routes_[route].summariser.observe(seconds);
}

double DecisionEngine::summariser_seconds(RouteId route) const noexcept {
  return route < routes_.size() ? summariser_estimate(routes_[route]) : 0.0;
}

void DecisionEngine::set_audit_correction(RouteId route, MediumId medium, double seconds) noexcept {
  if (route >= routes_.size() || medium >= media_.size() || !std::isfinite(seconds)) return;
  routes_[route].audit_correction[medium] = seconds;
}

double DecisionEngine::audit_correction(RouteId route, MediumId medium) const noexcept {
  return route < routes_.size() && medium < media_.size() ? routes_[route].audit_correction[medium] : 0.0;
}

double DecisionEngine::link_bytes_per_s(LinkId link) const {
  return link < links_.size() ? links_[link].throughput.per_second() : 0.0;
}

double DecisionEngine::link_rtt_s(LinkId link) const {
  return link < links_.size() ? links_[link].rtt.mean() : 0.0;
}

PrefillCoefficients DecisionEngine::prefill_coefficients(AgentId agent) const {
  return agent < agents_.size() ? agents_[agent].prefill.coefficients() : PrefillCoefficients{};
}

}  // namespace kvrelay::decision
