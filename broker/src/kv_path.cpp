#include "kvrelay/broker/kv_path.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "kvrelay/broker/engine_codecs.h"
#include "kvrelay/broker/tenant_chain.h"
#include "kvrelay/codec_plugins/sparse.h"
#include "kvrelay/decision/decision_json.h"
#include "kvrelay/decision/engine_from_policy.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/kv_store/entry_slice.h"
#include "kvrelay/peer/fetch_encoding.h"
#include "kvrelay/peer/peer_authorization.h"

#include "fetch_missing.h"
#include "kv_media.h"
#include "materialize.h"
#include "peer_links_fetcher.h"
#include "plan.h"
#include "precision.h"
#include "record.h"
#include "treatment_span.h"
#include "trusted_context.h"

namespace kvrelay::broker {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kPushQueueLimit = 64;
constexpr std::size_t kPrefetchQueueLimit = 16;

double milliseconds_since(Clock::time_point started) {
  return std::chrono::duration<double, std::milli>(Clock::now() - started).count();
}

// In a policy with tenants, the lookup's chain as its tenant's store scope files it
// (tenant_chain.h); the worker's own chain otherwise.
const shm::ResolveRequest& scoped_lookup(const Policy& policy, const shm::ResolveRequest& worker_request,
                                         const std::string& tenant, shm::ResolveRequest& scoped) {
  if (policy.tenants.empty()) return worker_request;
  scoped = worker_request;
  for (auto& hash : scoped.block_hashes)
    hash = kv_store::tenant_scoped_key({scoped.model_id, hash}, tenant).context_hash;
  return scoped;
}

kv_store::ChainScope chain_scope(const Policy& policy) {
  return policy.tenants.empty() ? kv_store::ChainScope::kUnscoped : kv_store::ChainScope::kTenant;
}

// The fidelity product a peer stamped on KV it sent (its entry's product times its codec's
// factor: the hop included). The decoded entry carries it once the wire does (issue #27, S7); a
// peer that stamps none leaves 1, which effective_product reads as the codec's factor.
double fetched_product(const FetchedKv& fetched) {
  return fetched.entry->fidelity.product;
}

// The product the KV a lookup serves carries (precision.h): 1 when exact; for KV from a peer,
// its stamp; for this node's source, the source's product times the medium's factor.
double served_product(const Policy& policy, const codec::CodecRegistry& codecs, const LookupPlan& plan,
                      const Fidelity& served, std::optional<double> from_peer, std::uint32_t block_tokens) {
  if (served.is_exact()) return 1.0;
  if (from_peer) return effective_product(Fidelity::lossy(served.lossy_codec, 0, *from_peer), policy, codecs);
  const double source = plan.held ? effective_product(plan.held.fidelity(block_tokens), policy, codecs) : 1.0;
  return source * codec_factor(policy, codecs, plan.codec);
}

// Files what a lookup delivered of its request's treatment when the lookup returns, however it
// returns (issue #28): nothing unless one of nothing()/served() says otherwise.
class DeliveryRecorder {
 public:
  DeliveryRecorder(Deliveries* to, const RequestContext& context) : to_(to), context_(context) {
    if (!context_.treatment) return;
    delivery_.as_assigned = context_.treatment->span == KvSpan::kNone;
    if (!delivery_.as_assigned) delivery_.reason = "the lookup ended before serving KV";
  }
  DeliveryRecorder(const DeliveryRecorder&) = delete;
  DeliveryRecorder& operator=(const DeliveryRecorder&) = delete;
  ~DeliveryRecorder() {
    if (to_ != nullptr && context_.treatment && !context_.request_id.empty()) {
      to_->record(context_.request_id, std::move(delivery_));
    }
  }

  // The engine's predictions of the plan (its cost breakdown), kept with whatever is delivered.
  void predicted(const json& cost) {
    if (!context_.treatment || !cost.is_object()) return;
    const auto candidates = cost.find("candidates");
    if (candidates == cost.end() || !candidates->is_array()) return;
    for (const auto& candidate : *candidates) {
      const double total = candidate.value("total_s", 0.0);
      const double correction = candidate.value("audit_correction_s", 0.0);
      predicted_.emplace_back(candidate.value("medium", std::string()), total - correction);
    }
  }

  // Nothing served: as assigned only for a treatment that moves no KV.
  void nothing(const std::string& why) {
    if (!context_.treatment) return;
    delivery_ = Delivery{};
    delivery_.predicted_s = predicted_;
    delivery_.as_assigned = context_.treatment->span == KvSpan::kNone;
    if (!delivery_.as_assigned) delivery_.reason = why;
  }

  // B's prompt carried a summary in place of A's context (the front proxy made it): all of the
  // context moved, as a summary, no KV.
  void summarised(const SummaryApplied& summary) {
    if (!context_.treatment) return;
    delivery_ = summary_delivery(*context_.treatment, summary);
    delivery_.predicted_s = predicted_;
  }

  void served(KvSpan span, const std::string& medium, std::uint64_t tokens, const MediumChoice& choice) {
    if (!context_.treatment) return;
    const Treatment& assigned = *context_.treatment;
    delivery_ = Delivery{span, medium, tokens, true, {}, predicted_};
    if (assigned.span == KvSpan::kNone) {
      delivery_.as_assigned = false;
      delivery_.reason = fmt::format("{} served {} KV tokens ({})", choice.source, tokens, choice.reason);
    } else if (!assigned.medium.empty() && assigned.medium != medium) {
      delivery_.as_assigned = false;
      delivery_.reason = fmt::format("served {} instead of {}: {}", medium, assigned.medium, choice.reason);
    }
  }

 private:
  Deliveries* to_;
  const RequestContext& context_;
  Delivery delivery_;
  std::vector<std::pair<std::string, double>> predicted_;
};

}  // namespace

KvPath::KvPath(std::shared_ptr<PolicySource> policy, std::shared_ptr<kv_store::EntryStore> store,
               std::shared_ptr<const codec::CodecRegistry> codecs, std::shared_ptr<PeerLinks> peers,
               metrics::Registry& registry)
    : policy_(std::move(policy)),
      store_(std::move(store)),
      codecs_(std::move(codecs)),
      peers_(std::move(peers)),
      fetcher_(std::make_unique<PeerLinksFetcher>(*peers_, *codecs_)),
      metrics_(registry),
      copy_bytes_per_s_(decision::measure_copy_bandwidth(16ULL << 20)),
      loaded_codecs_(engine_codecs(*codecs_)) {
  {
    std::lock_guard lock(engine_mutex_);
    ensure_engine_locked(*policy_->current());
  }
  // A reload updates the engine at once, so its reply can say what the engine did.
  policy_->set_engine_observer([this](const Policy& reloaded) {
    std::lock_guard lock(engine_mutex_);
    // A lookup may have reached the new snapshot first: report what it did to the engine.
    if (engine_policy_.get() == &reloaded) return last_engine_update_;
    return refresh_engine_locked(reloaded);
  });
  pusher_ = std::thread([this] { run_pusher(); });
}

KvPath::~KvPath() {
  policy_->set_engine_observer({});
  {
    std::lock_guard lock(push_mutex_);
    stopping_ = true;
  }
  push_wake_.notify_all();
  if (pusher_.joinable()) pusher_.join();
}

void KvPath::ensure_engine_locked(const Policy& policy) {
  if (engine_ && engine_policy_.get() == &policy) return;
  (void)refresh_engine_locked(policy);
}

EngineUpdate KvPath::refresh_engine_locked(const Policy& policy) {
  // Held only when it is the serving snapshot: then its address cannot be reused by another.
  auto current = policy_->current();
  engine_policy_ = current.get() == &policy ? std::move(current) : nullptr;
  last_engine_update_ = update_engine_locked(policy);
  return last_engine_update_;
}

EngineUpdate KvPath::update_engine_locked(const Policy& policy) {
  const Policy view = decision::engine_view(policy);
  // Forced media and disabled routes are left out of the view (choose() applies them), and the
  // rest of the settings reach a kept engine through apply_policy_settings: a reload or a live
  // route change keeps what it learned (link throughput, prefill fit, codec ratios, load).
  auto signature = decision::engine_topology(view);
  if (engine_ && signature == engine_signature_) {
    auto applied = decision::apply_policy_settings(*engine_, view);
    if (applied) return {};
    spdlog::error("KV path: policy settings not applied to the decision engine ({}); rebuilding it",
                  applied.error().to_string());
  }
  decision::LinkPriors priors;
  priors.shm_bytes_per_s = copy_bytes_per_s_;
  auto built = decision::engine_from_policy(view, priors, {}, loaded_codecs_);
  engine_signature_ = std::move(signature);
  if (!built) {
    spdlog::error("KV path: no decision engine for this policy ({}); routes without a forced medium use kv_raw",
                  built.error().to_string());
    engine_.reset();
    return {true, built.error().to_string()};
  }
  engine_.emplace(std::move(built).value());
  return {true, {}};
}

std::optional<EngineAdvice> KvPath::advise(const Policy& policy, const RoutePolicy& route,
                                           decision::TransferShape shape, bool commit, json& cost) {
  std::lock_guard lock(engine_mutex_);
  ensure_engine_locked(policy);
  if (!engine_) return std::nullopt;
  const auto id = engine_->find_route(route.id);
  if (!id) return std::nullopt;
  shape.now_s = std::chrono::duration<double>(Clock::now() - started_).count();
  auto decided = commit ? engine_->decide(id.value(), shape) : engine_->predict(id.value(), shape);
  if (!decided) return std::nullopt;
  cost = decision::decision_to_json(decided.value(), *engine_);
  return EngineAdvice{engine_->medium(decided.value().chosen).name,
                      std::string(decision::decision_reason_name(decided.value().reason))};
}

KvPath::HandoffSpan KvPath::handoff_span(const Policy& policy, const RoutePolicy& route,
                                         std::span<const TokenId> prompt, BlockHash chain_root,
                                         const std::string& tenant) {
  const AgentPolicy* from = policy.find_agent(route.from_agent);
  if (from == nullptr || prompt.empty()) return {};
  const std::uint64_t model_id = published_model_of(*from);
  auto chain = hash_blocks(model_id, prompt, kDefaultBlockTokens, chain_root);
  if (!policy.tenants.empty()) {
    for (auto& hash : chain)
      hash = kv_store::tenant_scoped_key({model_id, hash}, tenant).context_hash;
  }
  // KV of any fidelity shows how far A's context reaches; a longer entry that holds the prefix counts.
  const kv_store::PrefixQuery query{model_id, chain, chain.size(), kDefaultBlockTokens, kv_store::FidelityRule::any(),
                                    true};
  const auto local = kv_store::longest_held_prefix(*store_, query);
  std::size_t blocks = local.blocks;
  if (const auto held = peers_->longest_held(model_id, chain); held && held->blocks > blocks) blocks = held->blocks;
  HandoffSpan span;
  span.tokens = blocks * std::uint64_t{kDefaultBlockTokens};
  const AgentPolicy* to = policy.find_agent(route.to_agent);
  if (local && to != nullptr && to->model.id() == from->model.id() && local.fidelity(kDefaultBlockTokens).is_exact()) {
    span.receiver_cached = local.blocks * std::uint64_t{kDefaultBlockTokens};
  }
  return span;
}

std::uint64_t KvPath::published_model_of(const AgentPolicy& agent) const {
  std::lock_guard lock(published_models_mutex_);
  const auto found = published_models_.find(agent.id);
  return found != published_models_.end() ? found->second : agent.model.id();
}

std::optional<EngineAdvice> KvPath::predict_handoff(const Policy& policy, const RoutePolicy& route,
                                                    const decision::TransferShape& shape, json& cost) {
  return advise(policy, route, shape, /*commit=*/false, cost);
}

void KvPath::record_summary(json record, const std::string& route, std::string_view outcome,
                            std::optional<double> summariser_seconds) {
  metrics_.summaries.with({route, std::string(outcome)}).inc();
  if (summariser_seconds) {
    std::lock_guard lock(engine_mutex_);
    if (engine_) {
      if (const auto id = engine_->find_route(route)) engine_->observe_summary(id.value(), *summariser_seconds);
    }
  }
  log_.record(std::move(record));
}

// Plan, fetch what the plan asks for, materialize the entry served, record all of it.
Result<shm::ResolvedEntry> KvPath::resolve(const shm::ResolveRequest& worker_request) {
  const auto started = Clock::now();
  const auto policy = policy_->current();
  json record{{"kind", "lookup"}, {"time_unix_ms", unix_millis()}, {"prompt_tokens", worker_request.prompt_tokens}};
  const auto finish = [&](std::string_view outcome, std::size_t served_blocks) {
    finish_lookup(std::move(record), outcome, served_blocks * worker_request.block_tokens, milliseconds_since(started),
                  metrics_, log_);
  };
  const auto fail_with = [&](Error error) -> Result<shm::ResolvedEntry> {
    record["error"] = error.message;
    finish("error", 0);
    return error;
  };

  auto parsed = trusted_request_context(*policy, worker_request.params_json);
  if (!parsed) return fail_with(parsed.error());
  if (!parsed.value().ignored.empty()) {
    metrics_.ignored_params.with({"lookup", parsed.value().ignored}).inc();
    record["kvrelay_params"] = "ignored: " + parsed.value().ignored;
  }
  const RequestContext& context = parsed.value().context;
  shm::ResolveRequest scoped;
  const shm::ResolveRequest& request = scoped_lookup(*policy, worker_request, context.tenant, scoped);
  const RoutePolicy* route = pick_route(*policy, context);
  record["request_id"] = context.request_id;
  record["agent"] = context.agent;
  if (!context.tenant.empty()) record["tenant"] = context.tenant;
  record["route"] = route != nullptr ? json(route->id) : json();
  if (context.treatment) record["treatment"] = treatment_json(*context.treatment);
  if (context.max_tokens) record["max_tokens"] = *context.max_tokens;
  if (context.summary) record["summary"] = summary_applied_json(*context.summary);
  const std::size_t max_blocks = servable_blocks(request, context);
  record["available_tokens"] = max_blocks * request.block_tokens;
  // What this lookup delivers of an audited request's treatment, filed as it returns.
  DeliveryRecorder delivery(deliveries_.get(), context);

  // 1. Plan: no I/O.
  PlanInputs plan_inputs{*policy, request, context, *store_, *codecs_, *this};
  plan_inputs.longest_elsewhere = [&]() -> std::optional<std::pair<std::size_t, double>> {
    const auto held = peers_->longest_held(request.model_id, request.block_hashes);
    if (!held) return std::nullopt;
    return std::pair{held->blocks, held->product};
  };
  LookupPlan plan = plan_lookup(plan_inputs, max_blocks);
  record_plan(record, plan, std::chrono::duration<double>(Clock::now() - started).count(), metrics_);
  delivery.predicted(plan.choice.cost);
  if (plan.stop) {
    if (context.summary && plan.choice.medium == kSummaryMedium) {
      delivery.summarised(*context.summary);
    } else {
      delivery.nothing(plan.stop->error.message);
    }
    finish(plan.stop->outcome, 0);
    return plan.stop->error;
  }
  const MediumChoice& choice = plan.choice;
  if (plan.held) {  // the local source: an entry of its own or, by the prefix index, a longer one
    record["held"] = {{"blocks", plan.held.blocks},
                      {"entry_tokens", plan.held.entry->info.layout.tokens},
                      {"entry_fidelity", fidelity_json(plan.held.entry->fidelity)}};
  }

  // A prefetched source: a peer sent it ahead on its publish (issue #27). Read before any slicing.
  const bool prefetched_source = plan.held && plan.held.entry->origin == kv_store::EntryOrigin::kPrefetched;
  // A longer entry of this prompt was spilled: the peer holding it is asked first.
  // (Only past the held prefix: those are the blocks the fetch asks for.)
  const auto stub =
      plan.ask_peers ? store_->longest_stub(request.model_id, std::span(request.block_hashes).subspan(plan.held.blocks))
                     : std::nullopt;
  if (stub) {
    record["stub"] = {{"peer", stub->peer}, {"tokens", stub->tokens}, {"fidelity", fidelity_json(stub->fidelity)}};
  }

  // 2. Fetch what peers add after the held prefix, by the lookup's deadline. A prefix a longer
  // entry holds is cut first: the peer's delta joins those blocks, not the whole entry.
  const std::uint64_t held_tokens = plan.held.blocks * std::uint64_t{request.block_tokens};
  if (plan.ask_peers && plan.held && plan.held.entry->info.layout.tokens > held_tokens) {
    auto head = kv_store::slice_entry(*plan.held.entry, held_tokens, arena_.get());
    if (!head) return fail_with(head.error());
    plan.held.entry = std::move(head).value();
  }
  std::shared_ptr<const kv_store::StoredEntry> entry = plan.held.entry;
  std::size_t entry_blocks = plan.held.blocks;
  bool already_encoded = plan.held_already_encoded;
  std::string from = entry ? "local" : "";
  std::optional<double> peer_product;  // set when a peer's KV is served
  if (plan.ask_peers) {
    FetchInputs inputs{
        request,
        plan.held,
        plan.codec,
        plan.lossless,
        started + policy->limits.kv_lookup_timeout,
        policy->limits.kv_store_bytes,
        *codecs_,
        arena_.get(),
        chain_scope(*policy),
        [this](const std::string& source) {
          peers_->note_refused("chain");
          spdlog::warn("KV path: KV fetched from {} refused: its token ids do not hash to the chain asked for", source);
        }};
    // The source's link scheduler orders its reply by this route; sources below the product skip it.
    inputs.route = route->id;
    inputs.min_fidelity_product = plan.min_fidelity_product;
    if (stub) inputs.prefer_peer = stub->peer;
    FetchOutcome fetched = fetch_missing(*fetcher_, inputs);
    record["fetch"] = std::move(fetched.attempts);
    if (stub && stub_gone(*stub, record["fetch"], plan)) {
      (void)store_->forget_stub(stub->key);
      record["stub"]["forgotten"] = true;
    }
    if (fetched.fetched) {
      FetchedKv& kv = *fetched.fetched;
      record_fetched(metrics_, kv, choice.medium, plan.codec, route->id);
      {
        std::lock_guard lock(engine_mutex_);
        if (engine_) {
          feed_link(*engine_, kv.source, static_cast<double>(kv.frame_bytes), kv.seconds);
          feed_codec(*engine_, {plan.codec, kv.dtype, kv.raw_bytes, kv.frame_bytes, std::nullopt, kv.decode_seconds});
        }
      }
      from = (entry ? "local+peer:" : "peer:") + kv.source;  // local+: held prefix + delta
      if (stub && kv.source == stub->peer) {
        record["fetch_back"] = true;
        metrics_.fetch_backs.with({route->id}).inc();
      }
      peer_product = fetched_product(kv);
      entry = std::move(kv.entry);
      entry_blocks = kv.blocks;
      already_encoded = true;
      // Only exact KV is kept for later lookups (the store would refuse a lossy copy over it).
      if (entry->fidelity.is_exact()) {
        if (auto put = store_->put({request.model_id, request.block_hashes[entry_blocks - 1]}, entry); !put) {
          spdlog::warn("KV path: fetched entry not stored: {}", put.error().to_string());
        }
      }
    }
  }
  if (!entry) {
    delivery.nothing("neither this sidecar nor its peers hold a prefix of this prompt");
    finish("miss", 0);
    return fail(ErrorCode::kNotFound, "neither this sidecar nor its peers hold a prefix of this prompt");
  }
  record["kv_from"] = from;

  // 3. Materialize: the treatment's span of the servable blocks, through the codec when it has
  // not been yet.
  const KvSpan span = context.treatment ? context.treatment->span : KvSpan::kAll;
  SpanInputs span_inputs{span, std::min(entry_blocks, plan.max_blocks), request.block_tokens, std::nullopt,
                         (worker_request.flags & shm::kResolveSpan) != 0};
  if (context.treatment && context.treatment->prompt_tokens) {
    span_inputs.prompt_boundary = context.treatment->prompt_tokens;
  } else if (entry->chain && entry->chain->prompt_tokens > 0) {
    span_inputs.prompt_boundary = entry->chain->prompt_tokens;
  }
  auto cut = cut_span(span_inputs);
  if (!cut) {
    record["span"] = {{"span", span_name(span)}, {"error", cut.error().message}};
    delivery.nothing(cut.error().message);
    finish("tokens", 0);
    return cut.error();
  }
  if (span == KvSpan::kPrompt || span == KvSpan::kGenerated) {
    record["span"] = {{"span", span_name(span)},
                      {"prompt_boundary", *span_inputs.prompt_boundary},
                      {"first_token", cut.value().first_block * request.block_tokens},
                      {"end_token", cut.value().end_block * request.block_tokens}};
  }
  const bool round_trip = !already_encoded && !plan.lossless;
  ServeInputs serve{*codecs_,
                    std::move(entry),
                    entry_blocks,
                    cut.value().end_block,
                    request.block_tokens,
                    plan.codec,
                    round_trip,
                    policy->limits.kv_store_bytes,
                    arena_.get(),
                    cut.value().first_block};
  auto served = entry_to_serve(std::move(serve));
  if (!served) return fail_with(served.error());
  entry = std::move(served.value().entry);

  // 4. Record: what it cost and what was served.
  if (const auto& trip = served.value().round_trip) {
    observe_codec(plan.codec, entry->info.layout.dtype, entry->info.bytes, trip->frame_bytes, trip->encode_seconds,
                  trip->decode_seconds);
    metrics_.wire_bytes.with({"shm", choice.medium, plan.codec}).inc(static_cast<double>(trip->frame_bytes));
  }
  if (!already_encoded) {
    metrics_.raw_bytes.with({"shm", choice.medium}).inc(static_cast<double>(entry->info.bytes));
  }
  if (route != nullptr) {
    outcomes_.served(context.request_id, {route->id, choice.medium, static_cast<double>(entry->info.bytes), started});
    if (entry_blocks > 0) store_->note_use({request.model_id, request.block_hashes[entry_blocks - 1]}, route->priority);
  }
  // What the worker's next publish of this request inherits (published() stamps it).
  const double product = served_product(*policy, *codecs_, plan, entry->fidelity, peer_product, request.block_tokens);
  outcomes_.served_product(context.request_id, product);
  // Whatever the medium, a lookup that chose a lossless one gets exact KV, or none.
  if (plan.lossless && !entry->fidelity.is_exact()) {
    record["error"] = "internal: lossy KV on a lossless lookup";
    finish("error", 0);
    return fail(ErrorCode::kInternal, "lossy KV reached a lookup that chose a lossless medium; not served");
  }
  const std::size_t served_blocks = served.value().blocks;
  std::vector<TokenRun> kept;
  if (plan.sparse) {
    // kv_sparse: the kept positions of the exact KV served, at their original positions.
    if (cut.value().first_block > 0) {
      delivery.nothing("kv_sparse keeps positions of a leading prefix only, not of a span");
      finish("tokens", 0);
      return fail(ErrorCode::kNotFound, "kv_sparse keeps positions of a leading prefix only, not of a span");
    }
    // The one keep rule (the `sparse` codec's, which `kvrelay codec eval` measures).
    auto view = kv_store::view_entry(*entry);
    if (!view) return fail_with(view.error());
    auto positions = codec::sparse_keep_positions(entry->info.layout, view.value().bytes(), codec::SparseKeep{});
    if (!positions) return fail_with(positions.error());
    kept = std::move(positions).value();
    coarsen_token_runs(kept, shm::kMaxKeptRuns);  // what one reply can name
    if (!kept.empty() && (kept.size() > 1 || kept.front().length != entry->info.layout.tokens)) {
      // Exact through the first dropped position; its product the medium's calibrated factor.
      const Fidelity sparse = Fidelity::lossy("sparse", kept.front().start == 0 ? kept.front().length : 0,
                                              medium_factor(*policy, *codecs_, "kv_sparse"));
      auto selected = kv_store::select_entry_tokens(*entry, kept, arena_.get(), &sparse);
      if (!selected) return fail_with(selected.error());
      entry = std::move(selected).value();
      record["sparse"] = {{"kept_tokens", run_tokens(kept)},
                          {"of_tokens", served_blocks * std::uint64_t{request.block_tokens}},
                          {"runs", kept.size()}};
    } else {
      kept.clear();  // every position kept: plain exact KV
    }
  }
  record["fidelity"] = fidelity_json(entry->fidelity);
  if (!entry->fidelity.is_exact()) record["fidelity_product"] = kept.empty() ? product : entry->fidelity.product;
  if (prefetched_source && from == "local") {
    record["prefetch_hit"] = true;
    metrics_.prefetch_hits.with({route != nullptr ? route->id : std::string()}).inc();
  }
  finish(from == "local" ? "hit_local" : "hit_peer", served_blocks);
  shm::ResolvedMeta meta;
  meta.blocks = static_cast<std::uint32_t>(served_blocks);
  meta.medium = choice.serve_held_prefix ? std::string("kv_raw") : choice.medium;
  meta.fidelity = entry->fidelity;
  meta.first_block = static_cast<std::uint32_t>(cut.value().first_block);
  meta.kept = std::move(kept);
  delivery.served(span, meta.medium, served_blocks * std::uint64_t{request.block_tokens}, choice);
  return shm::ResolvedEntry{std::move(entry), std::move(meta)};
}

void KvPath::observe_audited_outcome(const std::string& route_id, const Delivery& delivery, double ttft_s) {
  const auto policy = policy_->current();
  const RoutePolicy* route = policy->find_route(route_id);
  if (route == nullptr || !route->audit.calibrate_live || delivery.predicted_s.empty()) return;
  std::lock_guard lock(engine_mutex_);
  ensure_engine_locked(*policy);
  if (!engine_) return;
  const auto route_index = engine_->find_route(route_id);
  if (!route_index) return;
  const auto correction = [&](const std::string& medium) {
    const auto id = engine_->find_medium(medium);
    return id ? engine_->audit_correction(route_index.value(), id.value()) : 0.0;
  };
  const AuditedOutcome outcome{delivery.medium, delivery.span, ttft_s, delivery.predicted_s};
  const auto refit = calibration_.observe(*route, outcome, correction);
  if (!refit) return;
  for (const MediumRefit& medium : refit->media) {
    if (const auto id = engine_->find_medium(medium.medium)) {
      engine_->set_audit_correction(route_index.value(), id.value(), medium.after_s);
    }
  }
  auto logged = refit_json(*refit);
  spdlog::info("audit calibration: route {} refitted from {} audited outcomes: {}", route_id, refit->trials,
               logged["media"].dump());
  log_.record(std::move(logged));
}

void KvPath::published(const kv_store::EntryKey& worker_key,
                       const std::shared_ptr<const kv_store::StoredEntry>& published_entry,
                       std::string_view params_json) {
  const auto policy = policy_->current();
  auto parsed = trusted_request_context(*policy, params_json);
  if (parsed && !parsed.value().ignored.empty())
    metrics_.ignored_params.with({"publish", parsed.value().ignored}).inc();
  const std::string tenant = parsed ? parsed.value().context.tenant : std::string();
  auto [key, filed] = refile_in_tenant_scope(*policy, worker_key, published_entry, tenant);
  if (filed && parsed) filed = stamp_served_product(key, filed, parsed.value().context.request_id);
  if (!filed || !parsed || parsed.value().context.agent.empty()) return;
  const kv_store::StoredEntry* entry = filed.get();
  const RequestContext& published_context = parsed.value().context;
  if (policy->find_agent(published_context.agent) != nullptr) {
    std::lock_guard lock(published_models_mutex_);
    published_models_.insert_or_assign(published_context.agent, worker_key.model_id);
  }
  for (const auto& route : policy->routes)  // the store values KV by the routes that will read it
    if (route.from_agent == published_context.agent && route.enabled) store_->note_use(key, route.priority);
  for (const auto& route : policy->routes) {
    if (route.from_agent != published_context.agent || !route.enabled) continue;
    const auto* to = policy->find_agent(route.to_agent);
    if (to == nullptr || to->node.empty() || to->node == policy->node_id) continue;  // same node: already here
    if (policy->find_peer(to->node) == nullptr) continue;
    if (route.push) {
      send_ahead(*policy, route, *to, published_context, key, filed, peer::PushPurpose::kPush);
    } else if (prefetch_wanted(*policy, route, published_context, *entry)) {
      send_ahead(*policy, route, *to, published_context, key, filed, peer::PushPurpose::kPrefetch);
    }
  }
  // Named next agents that none of this agent's routes lead to: a hint with nowhere to go.
  for (const auto& next : published_context.next_agents) {
    const bool routed = std::any_of(policy->routes.begin(), policy->routes.end(), [&](const RoutePolicy& route) {
      return route.from_agent == published_context.agent && route.to_agent == next && route.enabled;
    });
    if (!routed) metrics_.next_agents_ignored.with({}).inc();
  }
}

bool KvPath::prefetch_wanted(const Policy& policy, const RoutePolicy& route, const RequestContext& context,
                             const kv_store::StoredEntry& entry) {
  // The client's next_agents, when it names any, say which routes; else kv_store.prefetch does.
  const auto& next = context.next_agents;
  const bool wanted =
      next.empty() ? policy.kv_store.prefetch : std::find(next.begin(), next.end(), route.to_agent) != next.end();
  if (!wanted) return false;
  if (entry.info.bytes > policy.kv_store.prefetch_max_bytes) {
    metrics_.prefetches.with({route.id, "too_large"}).inc();
    return false;
  }
  // Not into a store that cannot hold it at all (its last summary's budget). A full store is
  // the normal state of a cache: its eviction decides what the prefetched entry displaces.
  const auto* to = policy.find_agent(route.to_agent);
  if (const auto state = peers_->node_state(to->node); state && state->store_budget > 0) {
    if (state->store_budget < entry.info.bytes) {
      metrics_.prefetches.with({route.id, "no_room"}).inc();
      return false;
    }
  }
  return true;
}

void KvPath::send_ahead(const Policy& policy, const RoutePolicy& route, const AgentPolicy& to,
                        const RequestContext& published_context, const kv_store::EntryKey& key,
                        const std::shared_ptr<const kv_store::StoredEntry>& filed, peer::PushPurpose purpose) {
  const kv_store::StoredEntry* entry = filed.get();
  const bool prefetch = purpose == peer::PushPurpose::kPrefetch;
  auto& outcomes = prefetch ? metrics_.prefetches : metrics_.pushes;
  RequestContext context = published_context;
  context.treatment.reset();
  context.max_tokens.reset();  // A's answer budget; B's is not known before B asks
  // What the receiving node holds is not known here: the whole entry is priced. A lossy
  // medium that would take the entry's product below the floor is refreshed (and a lossy
  // entry then not pushed: the destination asks for exact KV itself).
  const MediumChoice choice = choose_medium(policy, &route, context, entry->info.layout.tokens, 0, *codecs_, *this,
                                            effective_product(entry->fidelity, policy, *codecs_));
  json record{{"kind", "push"},
              {"purpose", peer::push_purpose_name(purpose)},
              {"time_unix_ms", unix_millis()},
              {"request_id", context.request_id},
              {"agent", context.agent},
              {"route", route.id},
              {"medium", choice.medium},
              {"source", choice.source},
              {"reason", choice.reason},
              {"to_node", to.node},
              {"tokens", entry->info.layout.tokens}};
  if (!choice.cost.is_null()) record["cost"] = choice.cost;
  if (choice.refresh) record["precision_refresh"] = precision_refresh_json(*choice.refresh);
  const auto not_sent = [&](std::string_view result, std::optional<std::string> reason) {
    record["outcome"] = "not_pushed";
    if (reason) record["reason"] = std::move(*reason);
    log_.record(std::move(record));
    outcomes.with({route.id, std::string(result)}).inc();
  };
  // Lossy KV under a lossless medium would be filed as exact at the destination.
  const auto push_codec = codec_for_medium(choice.medium);
  const bool lossy_as_exact =
      push_codec && !entry->fidelity.is_exact() && codec::fidelity_of(*codecs_, *push_codec).is_exact();
  if (lossy_as_exact) {
    return not_sent("lossy_kv", fmt::format("the KV is lossy ({}) and the medium {} is lossless",
                                            entry->fidelity.lossy_codec, choice.medium));
  }
  if (choice.medium == "tokens") return not_sent("tokens", std::nullopt);
  // A peer could not check its key: KV published without token ids stays on this node.
  if (!entry->chain) return not_sent("no_token_ids", "the worker published this KV without its token ids");
  // Prefetches wait in their own queue, taken only when no push waits: a push was asked for by
  // the route, a prefetch is a guess (and holds its entry in memory while it waits).
  std::lock_guard lock(push_mutex_);
  auto& queue = prefetch ? prefetch_queue_ : push_queue_;
  if (queue.size() >= (prefetch ? kPrefetchQueueLimit : kPushQueueLimit)) {
    outcomes.with({route.id, "dropped"}).inc();
    return;  // the destination will fetch on demand instead
  }
  queue.push_back(PushJob{route.id, to.node, choice.medium, *push_codec, purpose, key, filed, std::move(record)});
  push_wake_.notify_one();
}

void KvPath::run_pusher() {
  while (true) {
    PushJob job;
    {
      std::unique_lock lock(push_mutex_);
      push_wake_.wait(lock, [this] { return stopping_ || !push_queue_.empty() || !prefetch_queue_.empty(); });
      if (stopping_) return;
      auto& queue = push_queue_.empty() ? prefetch_queue_ : push_queue_;
      job = std::move(queue.front());
      queue.pop_front();
    }
    push_one(job);
  }
}

void KvPath::push_one(PushJob& job) {
  const auto policy = policy_->current();
  const auto started = Clock::now();
  auto& outcomes = job.purpose == peer::PushPurpose::kPrefetch ? metrics_.prefetches : metrics_.pushes;
  // Only the blocks the destination lacks, by the keys its last summary listed (issue #27).
  const kv_store::EntryChain& chain = *job.entry->chain;
  const auto keys = kv_store::chain_keys(job.key.model_id, chain, chain_scope(*policy));
  const bool keyed = !keys.empty() && keys.back() == job.key.context_hash;
  const std::size_t held = keyed ? peers_->held_prefix_blocks(job.peer, job.key.model_id, keys) : 0;
  if (keyed && held == keys.size()) {
    job.record["outcome"] = "not_pushed";
    job.record["reason"] = "the destination already holds this entry";
    outcomes.with({job.route, "already_held"}).inc();
    log_.record(std::move(job.record));
    return;
  }
  std::uint64_t skip = held * std::uint64_t{chain.block_tokens};
  auto sent = send_push(job, skip, *policy);
  bool retried = false;
  if (!sent && skip > 0 && sent.error().code == ErrorCode::kNotFound) {
    // The prefix left the destination since its summary ("prefix_gone"): the whole entry, once.
    job.record["delta_error"] = sent.error().to_string();
    retried = true;
    skip = 0;
    sent = send_push(job, 0, *policy);
  }
  job.record["seconds"] = std::chrono::duration<double>(Clock::now() - started).count();
  job.record["skip_tokens"] = skip;
  std::string_view result = "failed";
  if (sent) {
    job.record["frame_bytes"] = sent.value();
    job.record["outcome"] = "pushed";
    result = retried ? "delta_retry_full" : (skip > 0 ? "delta" : "pushed");
  } else {
    job.record["outcome"] = "failed";
    job.record["error"] = sent.error().to_string();
    spdlog::warn("KV path: push on route {} to {} failed: {}", job.route, job.peer, sent.error().to_string());
  }
  outcomes.with({job.route, std::string(result)}).inc();
  log_.record(std::move(job.record));
}

KvPath::StoreTraffic KvPath::store_traffic() const {
  // Read from the metric families, which count the same events by route.
  const auto total = [](const metrics::Family<metrics::Counter>& family, const auto& counted) {
    std::uint64_t sum = 0;
    family.for_each([&](const std::vector<std::string>& labels, const metrics::Counter& counter) {
      if (counted(labels)) sum += static_cast<std::uint64_t>(counter.value());
    });
    return sum;
  };
  const auto any = [](const std::vector<std::string>&) { return true; };
  // {route, result}: the results that sent the entry.
  const auto sent = [](const std::vector<std::string>& labels) {
    return labels.size() == 2 && (labels[1] == "pushed" || labels[1] == "delta" || labels[1] == "delta_retry_full");
  };
  return {total(metrics_.prefetches, sent), total(metrics_.prefetch_hits, any), total(metrics_.fetch_backs, any),
          total(metrics_.next_agents_ignored, any)};
}

bool KvPath::stub_gone(const kv_store::Stub& stub, const json& attempts, const LookupPlan& plan) const {
  // Its peer said it holds none of the chain, to a lookup that asked with the codec the entry went
  // with (or any lossless one for a lossless spill) and no product floor: the entry is gone there.
  const bool lossless_spill = !stub.codec.empty() && codec::fidelity_of(*codecs_, stub.codec).is_exact();
  const bool same_kind = stub.codec == plan.codec || (lossless_spill && plan.lossless);
  if (!same_kind || plan.min_fidelity_product > 0.0) return false;
  return std::any_of(attempts.begin(), attempts.end(), [&](const json& attempt) {
    return attempt.value("peer", "") == stub.peer && attempt.value("result", "") == "holds none";
  });
}

Result<std::uint64_t> KvPath::send_push(const PushJob& job, std::uint64_t skip_tokens, const Policy& policy) {
  const kv_store::StoredEntry& entry = *job.entry;
  // The tokens after skip_tokens (all of them for a whole entry), encoded as a fetch reply is.
  KVRELAY_TRY(const auto spec, codec::resolve_codec(*codecs_, job.codec));
  KVRELAY_TRY(const auto view, kv_store::view_entry(entry));
  KVRELAY_TRY(const auto encoded,
              peer::encode_for_fetch(entry.info.layout, view.bytes(), skip_tokens, spec, peers_->buffers()));
  const auto frame = encoded.frame();
  const std::uint64_t raw_bytes = encoded.raw_bytes;
  observe_codec(job.codec, entry.info.layout.dtype, raw_bytes, frame.size(), encoded.encode_seconds, std::nullopt);
  // The push carries the entry's fidelity product times its codec's factor (issue #27).
  peer::PushOptions options;
  options.route = job.route;
  options.purpose = job.purpose;
  options.skip_tokens = skip_tokens;
  options.source = entry.fidelity;
  options.codec = job.codec;
  std::chrono::microseconds busy{0};
  options.busy = &busy;
  KVRELAY_TRY(peers_->push(job.peer, options, std::random_device{}(), job.key, *entry.chain, frame,
                           policy.limits.read_timeout));
  // The link to the destination, as a fetch from it feeds it: the time the link was busy with it.
  if (busy.count() > 0) observe_peer_transfer(job.peer, frame.size(), std::chrono::duration<double>(busy).count());
  metrics_.wire_bytes.with({"pushed", job.medium, job.codec}).inc(static_cast<double>(frame.size()));
  metrics_.raw_bytes.with({"pushed", job.medium}).inc(static_cast<double>(raw_bytes));
  return static_cast<std::uint64_t>(frame.size());
}

KvPath::Filed KvPath::refile_in_tenant_scope(const Policy& policy, const kv_store::EntryKey& worker_key,
                                             const std::shared_ptr<const kv_store::StoredEntry>& entry,
                                             const std::string& tenant) {
  if (policy.tenants.empty()) return {worker_key, entry};
  // The data plane filed it under the worker's key; lookups read only their tenant's scope, so
  // until it is moved there nobody's lookup serves it.
  const auto scoped = kv_store::tenant_scoped_key(worker_key, tenant);
  std::shared_ptr<const kv_store::StoredEntry> filed = entry;
  if (entry->chain) {
    // Its chain names the tenant, so that a peer can recompute the scoped key it is fetched by.
    auto shared = kv_store::share_entry(*entry);
    if (!shared) {
      spdlog::warn("KV path: published entry not filed in its tenant's scope: {}", shared.error().to_string());
      (void)store_->erase(worker_key);
      return {scoped, nullptr};
    }
    auto chain = std::make_shared<kv_store::EntryChain>(*entry->chain);
    chain->tenant = tenant;
    shared.value()->chain = std::move(chain);
    filed = std::move(shared).value();
  }
  if (auto put = store_->put(scoped, filed); !put && put.error().code != ErrorCode::kAlreadyExists) {
    spdlog::warn("KV path: published entry not filed in its tenant's scope: {}", put.error().to_string());
  }
  (void)store_->erase(worker_key);
  return {scoped, filed};
}

std::shared_ptr<const kv_store::StoredEntry> KvPath::stamp_served_product(
    const kv_store::EntryKey& key, const std::shared_ptr<const kv_store::StoredEntry>& entry,
    const std::string& request_id) {
  if (entry->fidelity.is_exact()) return entry;
  const auto served = outcomes_.served_product_of(request_id);
  if (!served || !(*served < entry->fidelity.product)) return entry;
  auto shared = kv_store::share_entry(*entry);
  if (!shared) {
    spdlog::warn("KV path: published entry keeps fidelity product 1: {}", shared.error().to_string());
    return entry;
  }
  shared.value()->fidelity.product = *served;
  std::shared_ptr<const kv_store::StoredEntry> stamped = std::move(shared).value();
  // The same bytes and fidelity but a smaller product: the store replaces the worker's filing.
  if (auto put = store_->put(key, stamped); !put) {
    spdlog::warn("KV path: published entry keeps fidelity product 1: {}", put.error().to_string());
    return entry;
  }
  return stamped;
}

Status KvPath::authorize_peer_lookup(std::string_view peer_id, const kv_store::EntryKey& key,
                                     const kv_store::StoredEntry& entry) {
  const auto policy = policy_->current();
  // Authenticated by its uid, as strongly as a TCP peer by its certificate: never unrestricted.
  const auto grant = peer::grant_for(*policy, peer_id, /*tls=*/true);
  if (peer::authorize_fetch(*policy, grant, entry)) return ok();
  peers_->note_refused("fetch");
  spdlog::warn("same-host peer {}: lookup of model {:016x} refused: none of its agents uses that model", peer_id,
               key.model_id);
  // Answered as a miss, like KV this node does not hold: the peer learns nothing of it.
  return fail(ErrorCode::kNotFound, "no exact entry for this key");
}

void KvPath::prefill_observed(const shm::PrefillReport& report) {
  const auto policy = policy_->current();
  auto parsed = trusted_request_context(*policy, report.params_json);
  if (parsed && !parsed.value().ignored.empty()) {
    metrics_.ignored_params.with({"prefill_report", parsed.value().ignored}).inc();
  }
  std::string agent = parsed ? parsed.value().context.agent : std::string();
  if (policy->find_agent(agent) == nullptr) {
    metrics_.prefill_reports.with({"unknown"}).inc();
    return;
  }
  metrics_.prefill_reports.with({agent}).inc();
  const auto outcome = outcomes_.reported(parsed ? parsed.value().context.request_id : std::string(), report.seconds);
  std::lock_guard lock(engine_mutex_);
  ensure_engine_locked(*policy);
  if (!engine_) return;
  if (const auto id = engine_->find_agent(agent)) {
    engine_->observe_prefill(id.value(), report.computed_tokens, report.context_tokens - report.computed_tokens,
                             report.seconds);
  }
  if (outcome) {
    const auto route = engine_->find_route(outcome->served.route);
    const auto medium = engine_->find_medium(outcome->served.medium);
    if (route && medium)
      engine_->observe_handoff(route.value(), medium.value(), outcome->served.raw_bytes, outcome->seconds);
  }
}

void KvPath::record_peer_kv(const peer::KvBytesEvent& event) {
  const auto medium = medium_for_codec(event.codec);
  metrics_.wire_bytes.with({event.direction, medium, event.codec}).inc(static_cast<double>(event.frame_bytes));
  metrics_.raw_bytes.with({event.direction, medium}).inc(static_cast<double>(event.raw_bytes));
  const bool served = event.direction == "served";
  observe_codec(event.codec, event.dtype, event.raw_bytes, event.frame_bytes,
                served ? std::optional(event.codec_seconds) : std::nullopt,
                served ? std::nullopt : std::optional(event.codec_seconds));
}

void KvPath::observe_codec(std::string_view codec, DType dtype, std::uint64_t raw_bytes, std::uint64_t frame_bytes,
                           std::optional<double> encode_s, std::optional<double> decode_s) {
  std::lock_guard lock(engine_mutex_);
  if (engine_) feed_codec(*engine_, {std::string(codec), dtype, raw_bytes, frame_bytes, encode_s, decode_s});
}

void KvPath::observe_peer_rtt(const std::string& peer, double seconds) {
  std::lock_guard lock(engine_mutex_);
  if (!engine_) return;
  if (const auto link = engine_->find_link("peer:" + peer)) engine_->observe_rtt(link.value(), seconds);
}

void KvPath::observe_peer_transfer(const std::string& peer, std::uint64_t bytes, double seconds) {
  std::lock_guard lock(engine_mutex_);
  if (engine_) feed_link(*engine_, peer, static_cast<double>(bytes), seconds);
}

void KvPath::observe_load(const std::string& agent, double requests_waiting) {
  std::lock_guard lock(engine_mutex_);
  if (!engine_) return;
  if (const auto id = engine_->find_agent(agent)) engine_->observe_load(id.value(), requests_waiting);
}

void KvPath::observe_decode(const std::string& agent, double seconds_per_token) {
  if (!(seconds_per_token > 0.0) || !std::isfinite(seconds_per_token)) return;
  std::lock_guard lock(engine_mutex_);
  if (!engine_) return;
  if (const auto id = engine_->find_agent(agent)) engine_->observe_decode(id.value(), 1, seconds_per_token);
}

}  // namespace kvrelay::broker
