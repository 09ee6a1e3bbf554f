#include "plan.h"

#include <fmt/format.h>

#include <algorithm>

#include "kvrelay/decision/media.h"

#include "kv_media.h"
#include "precision.h"

namespace kvrelay::broker {

namespace {

// A delta fetch moves only the k blocks the peer adds, but joining them to the N held blocks
// writes all N + k into a new entry (fresh memory), and a fetch has fixed costs that weigh more
// at short lengths: with a local prefix in hand it pays only when the peer adds a good share.
// Measured on the demo shape: without this rule a same-node hit fetched 32 MiB to save 16
// tokens of prefill (before deltas); half keeps clear of that and of short-context losses.
constexpr std::size_t kPeerFetchMinGainDivisor = 2;

bool same_fingerprint(const Policy& policy, const RoutePolicy& route) {
  const auto* from = policy.find_agent(route.from_agent);
  const auto* to = policy.find_agent(route.to_agent);
  return from != nullptr && to != nullptr && from->model.id() == to->model.id();
}

// Held entries are exact KV: serving one is what kv_raw over shared memory would deliver.
bool allows_exact_kv(const RoutePolicy& route) {
  const auto& allowed = route.allowed_media;
  return allowed.empty() || std::find(allowed.begin(), allowed.end(), "kv_raw") != allowed.end() ||
         std::find(allowed.begin(), allowed.end(), "kv_lossless") != allowed.end();
}

// The dtype of the KV a route moves: its sending agent's model's (the worker's fingerprint, and so
// every entry filed under it, carries the same).
std::optional<DType> route_dtype(const Policy& policy, const RoutePolicy& route) {
  const auto* from = policy.find_agent(route.from_agent);
  return from == nullptr ? std::nullopt : std::optional<DType>(from->model.dtype);
}

bool route_allows(const RoutePolicy& route, std::string_view medium) {
  const auto& allowed = route.allowed_media;
  return allowed.empty() || std::find(allowed.begin(), allowed.end(), medium) != allowed.end();
}

// The route's first lossless KV medium in the catalogue's order (kv_raw, then kv_lossless) whose
// codec is loaded; nullopt when the route allows none.
std::optional<std::string> lossless_medium_for(const RoutePolicy& route, const codec::CodecRegistry& codecs) {
  for (const decision::BuiltinMedium& medium : decision::builtin_media()) {
    if (medium.kind != decision::MediumKind::kKvLossless || medium.prefix_codec.empty()) continue;
    if (!route_allows(route, medium.name) || !codec::resolve_codec(codecs, medium.prefix_codec)) continue;
    return std::string(medium.name);
  }
  return std::nullopt;
}

// The floor as a safety rule: whoever chose a lossy medium (treatment, forced route, engine), a
// hop that would take the chain's product below the route's quality_floor is refreshed.
void apply_quality_floor(const Policy& policy, const RoutePolicy& route, const codec::CodecRegistry& codecs,
                         double chain_product, MediumChoice& choice) {
  const double factor = medium_factor(policy, codecs, choice.medium);
  const auto hop = needs_refresh(route, chain_product, factor);
  if (!hop) return;
  const auto lossless = lossless_medium_for(route, codecs);
  PrecisionRefresh refresh{*hop, choice.medium, lossless ? RefreshForced::kLossless : RefreshForced::kTokens, false};
  const std::string instead = lossless ? fmt::format("{} from an exact source instead", *lossless)
                                       : std::string("tokens instead (the route allows no lossless KV medium)");
  choice.reason = fmt::format(
      "precision refresh: chain fidelity {:.4g} x {} factor {:.4g} = {:.4g} is below route {}'s quality_floor {:.4g}; "
      "{} ({} chose {}: {})",
      hop->chain_product, choice.medium, hop->factor, hop->after(), route.id, hop->floor, instead, choice.source,
      choice.medium, choice.reason);
  choice.medium = lossless.value_or("tokens");
  choice.source = "refresh";
  choice.serve_held_prefix = false;
  choice.refresh = std::move(refresh);
}

PlanStop stop_with(std::string outcome, ErrorCode code, std::string message) {
  return PlanStop{std::move(outcome), Error{code, std::move(message)}};
}

}  // namespace

const RoutePolicy* pick_route(const Policy& policy, const RequestContext& context) {
  if (!context.route.empty()) return policy.find_route(context.route);
  for (const auto& id : context.routes) {
    if (const auto* route = policy.find_route(id)) return route;
  }
  if (context.agent.empty()) return nullptr;
  for (const auto& route : policy.routes) {
    if (route.to_agent == context.agent) return &route;
  }
  return nullptr;
}

MediumChoice choose_medium(const Policy& policy, const RoutePolicy* route, const RequestContext& context,
                           std::uint64_t context_tokens, std::uint64_t held_tokens, const codec::CodecRegistry& codecs,
                           EngineAdvisor& engine, double chain_product) {
  MediumChoice choice;
  if (context.summary) {
    // The front proxy put a summary in place of A's context (docs/summary.md): B prefills it, no
    // KV is B's to import. Priced as the proxy priced it, for the record and live calibration.
    const SummaryApplied& summary = *context.summary;
    choice.medium = std::string(kSummaryMedium);
    choice.source = summary.source.empty() ? std::string("front_proxy") : summary.source;
    choice.reason = fmt::format("the front proxy put a {}-token summary in place of A's {} tokens",
                                summary.summary_tokens, summary.span_tokens);
    decision::TransferShape priced;
    priced.tokens = summary.span_tokens;
    if (context.max_tokens) priced.expected_output_tokens = *context.max_tokens;
    if (route != nullptr) {
      priced.dtype = route_dtype(policy, *route);
      (void)engine.advise(policy, *route, priced, false, choice.cost);
    }
    return choice;
  }
  if (route == nullptr) {
    // A worker used without the front proxy (or a route-less agent): plain prefix reuse.
    choice.medium = "kv_raw";
    choice.source = "default";
    choice.reason = "no route names this request; serving stored KV as is";
    return choice;
  }
  const auto& treatment = context.treatment;
  const bool treatment_decides = treatment && treatment->decides_medium();
  const bool engine_decides = !(treatment && !treatment->medium.empty()) && !route->forced_medium;
  decision::TransferShape shape;
  shape.tokens = context_tokens;
  shape.receiver_cached = held_tokens;
  shape.chain_fidelity = chain_product;
  if (context.max_tokens) shape.expected_output_tokens = *context.max_tokens;
  shape.dtype = route_dtype(policy, *route);
  // B's request left the front proxy without a summary: none can be made for it now.
  shape.summary_possible = false;
  const bool bytes_only = shape.dtype && dtype_moves_as_bytes(*shape.dtype);
  const auto decided = engine.advise(policy, *route, shape, engine_decides, choice.cost);
  if (treatment_decides) {
    choice.medium = treatment->delivered_medium();
    choice.source = "treatment";
    choice.reason = fmt::format("audit treatment {}", treatment->name);
  } else if (route->forced_medium) {
    choice.medium = *route->forced_medium;
    choice.source = "forced";
    choice.reason = fmt::format("route {} forces {}", route->id, *route->forced_medium);
  } else if (decided) {
    choice.medium = decided->medium;
    choice.source = "engine";
    choice.reason = decided->reason;
    if (bytes_only) {
      choice.reason += fmt::format(" ({} KV moves as bytes: lossy media excluded)", dtype_name(*shape.dtype));
    }
    choice.serve_held_prefix = choice.medium == "tokens" && held_tokens > 0 && route->enabled &&
                               same_fingerprint(policy, *route) && allows_exact_kv(*route);
  } else {
    choice.medium = "kv_raw";
    choice.source = "default";
    choice.reason = "decision engine unavailable";
  }
  if (choice.medium == kSummaryMedium) {
    // Forced or a treatment, but the front proxy did not summarise this request (its summary
    // record in the decision log says why): B got its original prompt.
    choice.reason = fmt::format("{}; but the front proxy did not summarise this request: tokens", choice.reason);
    choice.medium = "tokens";
  }
  if (choice.medium != "tokens") {
    if (!route->enabled) {
      choice.reason = fmt::format("route {} is disabled: tokens only (wanted {})", route->id, choice.medium);
      choice.medium = "tokens";
    } else if (!same_fingerprint(policy, *route)) {
      choice.reason = fmt::format("model fingerprints of {} and {} differ: KV cannot move (wanted {})",
                                  route->from_agent, route->to_agent, choice.medium);
      choice.medium = "tokens";
    } else if (choice.medium == "kv_sparse") {
      // Moves exact KV of the kept positions (plan_lookup checks the worker can attend over them).
      if (const auto* to = policy.find_agent(route->to_agent); to == nullptr || !to->accepts_sparse_kv) {
        choice.reason = fmt::format("agent {} did not declare accepts_sparse_kv; tokens instead", route->to_agent);
        choice.medium = "tokens";
      } else if (bytes_only) {
        // fp8 KV moves only as bytes; the keep rule reads key norms of fp32/fp16/bf16 KV.
        choice.reason = fmt::format(
            "kv_sparse would select positions of {} KV, which moves only as bytes; kv_raw "
            "instead",
            dtype_name(*shape.dtype));
        choice.medium = "kv_raw";
      }
    } else if (!codec_for_medium(choice.medium)) {
      choice.reason = fmt::format("{} cannot fill a prefix cache; tokens instead", choice.medium);
      choice.medium = "tokens";
    } else if (!codec::resolve_codec(codecs, *codec_for_medium(choice.medium))) {
      // A treatment or a forced plugin medium whose codec this sidecar has not loaded.
      choice.reason = fmt::format("codec of {} is not loaded here (GET /admin/codecs); tokens instead", choice.medium);
      choice.medium = "tokens";
    } else if (bytes_only && !codec::fidelity_of(codecs, *codec_for_medium(choice.medium)).is_exact()) {
      // A treatment or a forced lossy medium: fp8 KV is never converted, its bytes move as stored.
      choice.reason = fmt::format("{} would convert {} KV, which moves only as bytes; kv_raw instead", choice.medium,
                                  dtype_name(*shape.dtype));
      choice.medium = "kv_raw";
    }
  }
  apply_quality_floor(policy, *route, codecs, chain_product, choice);
  return choice;
}

std::size_t servable_blocks(const shm::ResolveRequest& request, const RequestContext& context) {
  if (request.block_tokens == 0) return std::size_t{0};
  std::size_t max_blocks =
      request.prompt_tokens == 0
          ? 0
          : std::min<std::size_t>(request.block_hashes.size(),
                                  static_cast<std::size_t>((request.prompt_tokens - 1) / request.block_tokens));
  if (context.treatment && context.treatment->span == KvSpan::kPrompt && context.treatment->prompt_tokens) {
    // The offline runner knows A's prompt length; otherwise the served entry's chain says (treatment_span.h).
    max_blocks = std::min<std::size_t>(max_blocks, *context.treatment->prompt_tokens / request.block_tokens);
  }
  return max_blocks;
}

LookupPlan plan_lookup(const PlanInputs& inputs, std::size_t max_blocks) {
  const auto& request = inputs.request;
  LookupPlan plan;
  plan.max_blocks = max_blocks;
  plan.route = pick_route(inputs.policy, inputs.context);

  // This node's store first: the longest exact chain prefix it holds (the engine prices only
  // the rest); a longer lossy one only a lookup with the same lossy codec may use. A prefix a
  // longer entry holds counts (materialize serves its slice).
  kv_store::PrefixQuery query{request.model_id,
                              request.block_hashes,
                              request.block_hashes.size(),
                              request.block_tokens,
                              kv_store::FidelityRule::exact_only(),
                              true};
  plan.held = kv_store::longest_held_prefix(inputs.store, query);
  if (plan.route != nullptr && plan.route->quality_floor > 0.0) {
    // The best source of any fidelity is what a lossy hop would extend (an exact prefix of a
    // lossy entry is exact). Only a floor reads it: without one no product can cross it.
    kv_store::PrefixQuery any = query;
    any.fidelity = kv_store::FidelityRule::any();
    const auto best = kv_store::longest_held_prefix(inputs.store, any);
    if (best) plan.chain_product = effective_product(best.fidelity(request.block_tokens), inputs.policy, inputs.codecs);
    // A longer source on a peer is what a fetch would extend: its product is the chain's.
    const auto elsewhere = inputs.longest_elsewhere ? inputs.longest_elsewhere() : std::nullopt;
    if (elsewhere && elsewhere->first > best.blocks) plan.chain_product = elsewhere->second;
  }
  plan.choice = choose_medium(inputs.policy, plan.route, inputs.context, max_blocks * request.block_tokens,
                              std::min(plan.held.blocks, max_blocks) * request.block_tokens, inputs.codecs,
                              inputs.engine, plan.chain_product);
  MediumChoice& choice = plan.choice;
  if (choice.medium == kSummaryMedium) {
    plan.stop = stop_with(std::string(kSummaryMedium), ErrorCode::kNotFound,
                          "the front proxy summarised A's context: no KV to serve");
    return plan;
  }
  if (choice.refresh) choice.refresh->exact_source = static_cast<bool>(plan.held);
  if (choice.medium == "tokens" && !choice.serve_held_prefix) {
    plan.stop = stop_with("tokens", ErrorCode::kNotFound, fmt::format("medium tokens: {}", choice.reason));
    return plan;
  }
  if (max_blocks == 0) {
    plan.stop = stop_with("miss", ErrorCode::kNotFound, "prompt shorter than one block plus one token");
    return plan;
  }
  plan.sparse = choice.medium == "kv_sparse";
  if (plan.sparse && (request.flags & shm::kResolveSparse) == 0) {
    choice.reason += "; but the worker did not ask for position-sparse KV (data-plane flag kResolveSparse)";
    plan.stop = stop_with("tokens", ErrorCode::kNotFound,
                          "medium kv_sparse: this worker does not attend over position-sparse KV");
    return plan;
  }
  // The held prefix under a tokens choice is served as stored: exact, no codec; sparse KV is
  // exact KV of the kept positions.
  plan.codec = choice.serve_held_prefix || plan.sparse ? std::string("raw") : *codec_for_medium(choice.medium);
  plan.lossless = codec::fidelity_of(inputs.codecs, plan.codec).is_exact();
  if (!plan.lossless && request.client_version < shm::kFidelityDataPlaneVersion) {
    // The worker could not say that what it computes over lossy KV is lossy: it prefills.
    plan.choice.reason = fmt::format("{}; but the worker's data plane (version {}) cannot carry lossy KV's fidelity",
                                     choice.reason, request.client_version);
    plan.stop =
        stop_with("tokens", ErrorCode::kNotFound,
                  fmt::format("medium {} is lossy and this client speaks data-plane version {} (lossy KV needs {})",
                              choice.medium, request.client_version, shm::kFidelityDataPlaneVersion));
    return plan;
  }
  if (!plan.lossless) {
    const double factor = codec_factor(inputs.policy, inputs.codecs, plan.codec);
    if (plan.route != nullptr) plan.min_fidelity_product = min_reply_product(*plan.route);
    // KV that already went through this codec (a push, say) is what this medium delivers, while
    // its own product keeps the hop above the floor (the best source may be another entry).
    query.fidelity = kv_store::FidelityRule::exact_or_lossy(plan.codec);
    auto encoded = kv_store::longest_held_prefix(inputs.store, query);
    const auto encoded_fidelity = encoded ? encoded.fidelity(request.block_tokens) : Fidelity::exact();
    const bool above_floor =
        plan.route == nullptr ||
        !needs_refresh(*plan.route, effective_product(encoded_fidelity, inputs.policy, inputs.codecs), factor);
    if (encoded.blocks > plan.held.blocks && !encoded_fidelity.is_exact() && above_floor) {
      plan.held = std::move(encoded);
      plan.held_already_encoded = true;
    }
  }
  const std::size_t held_blocks = std::min(plan.held.blocks, max_blocks);
  const bool peer_gain_worth_it =
      plan.held.blocks == 0 || (max_blocks - held_blocks) * kPeerFetchMinGainDivisor >= plan.held.blocks;
  plan.ask_peers = held_blocks < max_blocks && plan.route != nullptr && peer_gain_worth_it &&
                   !choice.serve_held_prefix && !inputs.policy.peers.empty() &&
                   request.block_hashes.size() > plan.held.blocks;
  if (choice.refresh && !plan.held && !plan.ask_peers) {
    // A refresh with no exact source anywhere it could look: the receiver prefills.
    choice.refresh->forced = RefreshForced::kTokens;
    choice.medium = "tokens";
    choice.reason += "; no exact source holds this prefix: tokens";
    plan.stop = stop_with("tokens", ErrorCode::kNotFound, fmt::format("medium tokens: {}", choice.reason));
    return plan;
  }
  if (!plan.held && !plan.ask_peers) {
    plan.stop =
        stop_with("miss", ErrorCode::kNotFound, "neither this sidecar nor its peers hold a prefix of this prompt");
  }
  return plan;
}

}  // namespace kvrelay::broker
