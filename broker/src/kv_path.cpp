#include "kvrelay/broker/kv_path.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/decision/decision_json.h"
#include "kvrelay/decision/engine_from_policy.h"

#include "kv_media.h"

namespace kvrelay::broker {

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kMaxLabelText = 128;
constexpr std::size_t kPushQueueLimit = 64;
constexpr std::size_t kPeerFetchMinGainDivisor = 2;

auto type_error(std::string_view field, std::string_view expected, const json& got) {
  return fail(ErrorCode::kInvalidArgument,
              fmt::format("kv_transfer_params.kvrelay.{}: expected {}, got {}", field, expected, got.dump()));
}

Status read_string(const json& object, std::string_view field, std::string& out) {
  const auto it = object.find(field);
  if (it == object.end() || it->is_null()) return ok();
  if (!it->is_string()) return type_error(field, "a string", *it);
  out = it->get<std::string>().substr(0, kMaxLabelText);
  return ok();
}

Result<Treatment> parse_treatment(const json& value) {
  if (!value.is_object()) return type_error("treatment", "an object", value);
  Treatment treatment;
  KVRELAY_TRY(read_string(value, "name", treatment.name));
  KVRELAY_TRY(read_string(value, "medium", treatment.medium));
  KVRELAY_TRY(read_string(value, "span", treatment.span));
  if (!treatment.medium.empty() && !is_known_medium(treatment.medium)) {
    return type_error("treatment.medium", "a medium name", value["medium"]);
  }
  if (!treatment.span.empty() && treatment.span != "none" && treatment.span != "prompt" &&
      treatment.span != "generated" && treatment.span != "all") {
    return type_error("treatment.span", "none, prompt, generated or all", value["span"]);
  }
  if (const auto it = value.find("prompt_tokens"); it != value.end() && !it->is_null()) {
    if (!it->is_number_unsigned()) return type_error("treatment.prompt_tokens", "a non-negative integer", *it);
    treatment.prompt_tokens = it->get<std::uint64_t>();
  }
  return treatment;
}

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

bool same_fingerprint(const Policy& policy, const RoutePolicy& route) {
  const auto* from = policy.find_agent(route.from_agent);
  const auto* to = policy.find_agent(route.to_agent);
  return from != nullptr && to != nullptr && from->model.id() == to->model.id();
}

std::vector<decision::PluginCodec> loaded_codecs(const codec::CodecRegistry& codecs) {
  std::vector<decision::PluginCodec> loaded;
  for (const auto& codec : codecs.codecs())
    loaded.push_back({std::string(codec->name()), codec->lossless()});
  return loaded;
}

// Held entries are exact KV: serving one is what kv_raw over shared memory would deliver.
bool allows_exact_kv(const RoutePolicy& route) {
  const auto& allowed = route.allowed_media;
  return allowed.empty() || std::find(allowed.begin(), allowed.end(), "kv_raw") != allowed.end() ||
         std::find(allowed.begin(), allowed.end(), "kv_lossless") != allowed.end();
}

std::int64_t unix_millis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

json fidelity_json(const Fidelity& fidelity) {
  if (fidelity.is_exact()) return "exact";
  return {{"lossy_codec", fidelity.lossy_codec}, {"exact_tokens", fidelity.exact_tokens}};
}

// The longest chain prefixes the store holds: exact, and (when longer) of any fidelity.
struct HeldPrefixes {
  std::shared_ptr<const kv_store::StoredEntry> exact;
  std::size_t exact_blocks = 0;
  std::shared_ptr<const kv_store::StoredEntry> lossy;
  std::size_t lossy_blocks = 0;
};
HeldPrefixes find_held_prefixes(kv_store::EntryStore& store, const shm::ResolveRequest& request) {
  HeldPrefixes held;
  for (std::size_t blocks = request.block_hashes.size(); blocks > 0; --blocks) {
    auto found = store.get({request.model_id, request.block_hashes[blocks - 1]});
    if (!found || found->info.layout.tokens != blocks * request.block_tokens) continue;
    if (found->fidelity.is_exact()) {
      held.exact = std::move(found);
      held.exact_blocks = blocks;
      break;
    }
    if (!held.lossy) {
      held.lossy = std::move(found);
      held.lossy_blocks = blocks;
    }
  }
  return held;
}

json treatment_json(const Treatment& treatment) {
  json out{{"name", treatment.name}, {"medium", treatment.medium}, {"span", treatment.span}};
  if (treatment.prompt_tokens) out["prompt_tokens"] = *treatment.prompt_tokens;
  return out;
}

}  // namespace

Result<RequestContext> parse_request_context(std::string_view params_json) {
  RequestContext context;
  if (params_json.empty()) return context;
  const json params = json::parse(params_json, nullptr, false);
  if (params.is_discarded()) return fail(ErrorCode::kInvalidArgument, "kv_transfer_params.kvrelay is not valid JSON");
  if (params.is_null()) return context;
  if (!params.is_object()) return type_error("", "an object", params);
  KVRELAY_TRY(read_string(params, "request_id", context.request_id));
  KVRELAY_TRY(read_string(params, "agent", context.agent));
  KVRELAY_TRY(read_string(params, "route", context.route));
  if (const auto it = params.find("routes"); it != params.end() && !it->is_null()) {
    if (!it->is_array()) return type_error("routes", "an array of route ids", *it);
    for (const auto& route : *it) {
      if (!route.is_string()) return type_error("routes[]", "a route id", route);
      context.routes.push_back(route.get<std::string>().substr(0, kMaxLabelText));
    }
  }
  if (const auto it = params.find("max_tokens"); it != params.end() && !it->is_null()) {
    if (!it->is_number_unsigned()) return type_error("max_tokens", "a non-negative integer", *it);
    context.max_tokens = static_cast<std::uint32_t>(std::min<std::uint64_t>(it->get<std::uint64_t>(), UINT32_MAX));
  }
  if (const auto it = params.find("treatment"); it != params.end() && !it->is_null()) {
    auto treatment = parse_treatment(*it);
    if (!treatment) return treatment.error();
    context.treatment = std::move(treatment).value();
  }
  return context;
}

KvPath::Metrics::Metrics(metrics::Registry& registry)
    : decisions(registry.counter("kvrelay_kv_decisions_total",
                                 "KV-path medium decisions by chosen medium and source (treatment, forced, engine, "
                                 "default)",
                                 {"medium", "source"})),
      decision_seconds(registry.histogram("kvrelay_kv_decision_seconds", "Time to choose a medium for one lookup", {},
                                          {1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2})),
      lookups(registry.counter("kvrelay_kv_lookups_total",
                               "Worker lookups by outcome (hit_local, hit_peer, miss, tokens, error)", {"outcome"})),
      wire_bytes(registry.counter("kvrelay_kv_bytes_total",
                                  "Encoded KV bytes by direction (fetched, served, pushed, received, shm), medium "
                                  "and codec",
                                  {"direction", "medium", "codec"})),
      raw_bytes(registry.counter("kvrelay_kv_raw_bytes_total", "Raw KV bytes those encoded bytes carried",
                                 {"direction", "medium"})),
      fetch_seconds(registry.histogram("kvrelay_kv_fetch_seconds", "Time to fetch and decode KV from a peer, per route",
                                       {"route"}, metrics::latency_buckets_seconds())),
      pushes(registry.counter("kvrelay_kv_pushes_total", "KV pushed ahead on publish, by route and result",
                              {"route", "result"})),
      prefill_reports(registry.counter("kvrelay_kv_prefill_reports_total",
                                       "Prefill timings workers reported to the cost model, by agent", {"agent"})) {}

KvPath::KvPath(std::shared_ptr<PolicySource> policy, std::shared_ptr<kv_store::EntryStore> store,
               std::shared_ptr<const codec::CodecRegistry> codecs, std::shared_ptr<PeerLinks> peers,
               metrics::Registry& registry)
    : policy_(std::move(policy)),
      store_(std::move(store)),
      codecs_(std::move(codecs)),
      peers_(std::move(peers)),
      metrics_(registry),
      copy_bytes_per_s_(decision::measure_copy_bandwidth(16ULL << 20)),
      loaded_codecs_(loaded_codecs(*codecs_)) {
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

std::optional<KvPath::EngineChoice> KvPath::run_engine(const Policy& policy, const RoutePolicy& route,
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
  return EngineChoice{engine_->medium(decided.value().chosen).name,
                      std::string(decision::decision_reason_name(decided.value().reason))};
}

KvPath::Choice KvPath::choose(const Policy& policy, const RoutePolicy* route, const RequestContext& context,
                              std::uint64_t context_tokens, std::uint64_t held_tokens) {
  Choice choice;
  if (route == nullptr) {
    // A worker used without the front proxy (or a route-less agent): plain prefix reuse.
    choice.medium = "kv_raw";
    choice.source = "default";
    choice.reason = "no route names this request; serving stored KV as is";
    return choice;
  }
  const auto& treatment = context.treatment;
  const bool engine_decides = !(treatment && !treatment->medium.empty()) && !route->forced_medium;
  decision::TransferShape shape;
  shape.tokens = context_tokens;
  shape.receiver_cached = held_tokens;
  if (context.max_tokens) shape.expected_output_tokens = *context.max_tokens;
  const auto decided = run_engine(policy, *route, shape, engine_decides, choice.cost);
  if (treatment && (!treatment->medium.empty() || treatment->span == "none")) {
    choice.medium = treatment->span == "none" ? "tokens" : treatment->medium;
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
    choice.serve_held_prefix = choice.medium == "tokens" && held_tokens > 0 && route->enabled &&
                               same_fingerprint(policy, *route) && allows_exact_kv(*route);
  } else {
    choice.medium = "kv_raw";
    choice.source = "default";
    choice.reason = "decision engine unavailable";
  }
  if (choice.medium != "tokens") {
    if (!route->enabled) {
      choice.reason = fmt::format("route {} is disabled: tokens only (wanted {})", route->id, choice.medium);
      choice.medium = "tokens";
    } else if (!same_fingerprint(policy, *route)) {
      choice.reason = fmt::format("model fingerprints of {} and {} differ: KV cannot move (wanted {})",
                                  route->from_agent, route->to_agent, choice.medium);
      choice.medium = "tokens";
    } else if (!codec_for_medium(choice.medium)) {
      choice.reason = fmt::format("{} cannot fill a prefix cache; tokens instead", choice.medium);
      choice.medium = "tokens";
    } else if (!codec::resolve_codec(*codecs_, *codec_for_medium(choice.medium))) {
      // A treatment or a forced plugin medium whose codec this sidecar has not loaded.
      choice.reason = fmt::format("codec of {} is not loaded here (GET /admin/codecs); tokens instead", choice.medium);
      choice.medium = "tokens";
    }
  }
  return choice;
}

std::optional<KvPath::Fetched> KvPath::fetch_from_peers(const Policy& policy, const shm::ResolveRequest& request,
                                                        const std::shared_ptr<const kv_store::StoredEntry>& held,
                                                        std::size_t held_blocks, const std::string& codec,
                                                        const std::string& medium, const std::string& route,
                                                        peer::Deadline deadline, json& record) {
  if (policy.peers.empty() || request.block_hashes.size() <= held_blocks) return std::nullopt;
  peer::FetchRequest fetch;
  fetch.request_id = std::random_device{}();
  fetch.model_id = request.model_id;
  fetch.codec = codec;
  const bool lossless_requested = codec::fidelity_of(*codecs_, codec).is_exact();
  // Only the blocks this sidecar lacks cross the link; the held prefix is joined back below.
  const std::uint64_t held_tokens = held ? held->info.layout.tokens : 0;
  fetch.skip_tokens = held_tokens;
  for (std::size_t blocks = request.block_hashes.size(); blocks > held_blocks; --blocks) {
    fetch.hashes.push_back(request.block_hashes[blocks - 1]);
  }
  json attempts = json::array();
  for (const auto& peer_id : peers_->candidates(request.model_id, fetch.hashes)) {
    if (Clock::now() >= deadline) {
      attempts.push_back({{"peer", peer_id}, {"result", "skipped: lookup deadline reached"}});
      break;
    }
    const auto started = Clock::now();
    auto fetched = peers_->fetch(peer_id, fetch, deadline, policy.limits.kv_store_bytes, *codecs_);
    if (!fetched) {
      attempts.push_back({{"peer", peer_id}, {"result", fetched.error().to_string()}});
      continue;
    }
    if (!fetched.value()) {
      attempts.push_back({{"peer", peer_id}, {"result", "holds none"}});
      continue;
    }
    const auto received = Clock::now();
    const std::string& transport = fetched.value()->transport;
    if (received >= deadline) {  // the worker prefills rather than wait for the decode too
      attempts.push_back({{"peer", peer_id},
                          {"transport", transport},
                          {"result", "timeout: decode: deadline exceeded before the frame could be decoded"}});
      break;
    }
    const auto frame = fetched.value()->frame();
    const auto position =
        std::find(request.block_hashes.begin(), request.block_hashes.end(), fetched.value()->key.context_hash);
    const auto blocks = static_cast<std::size_t>(position - request.block_hashes.begin()) + 1;
    // A raw frame is filed straight from the receive buffer; other codecs decode into a warm one.
    auto decoded = codec::decode_frame_view(*codecs_, frame, policy.limits.kv_store_bytes, peers_->buffers());
    if (!decoded || decoded.value().header.layout.tokens + held_tokens != blocks * request.block_tokens) {
      attempts.push_back(
          {{"peer", peer_id},
           {"result", decoded ? std::string("entry does not cover its blocks") : decoded.error().to_string()}});
      continue;
    }
    const Fidelity fetched_fidelity = codec::fidelity_of(codec::frame_codec(*codecs_, decoded.value().header));
    if (!fetched_fidelity.is_exact() && lossless_requested) {
      attempts.push_back(
          {{"peer", peer_id},
           {"result", fmt::format("wrong codec: asked for {}, got a {} frame", codec, fetched_fidelity.lossy_codec)}});
      continue;
    }
    const auto kv = std::as_bytes(decoded.value().kv);
    const std::uint64_t fetched_raw_bytes = kv.size();
    const auto decoded_at = Clock::now();
    // The link's share: request to checked KV, without the local cost of filing it.
    const double seconds = std::chrono::duration<double>(decoded_at - started).count();
    const auto file_entry = [&]() -> Result<std::shared_ptr<const kv_store::StoredEntry>> {
      if (held) {
        return join_entry(*held, decoded.value().header.layout, kv, fetched_fidelity, peers_->buffers(), arena_.get());
      }
      KVRELAY_TRY(auto made, kv_store::make_stored_entry(decoded.value().header.layout, kv, arena_.get()));
      made->fidelity = fetched_fidelity;
      return std::shared_ptr<const kv_store::StoredEntry>(std::move(made));
    };
    auto entry = file_entry();
    if (!entry) {
      attempts.push_back({{"peer", peer_id}, {"result", entry.error().to_string()}});
      continue;
    }
    const auto milliseconds = [](auto duration) { return std::chrono::duration<double, std::milli>(duration).count(); };
    const double filing_ms = milliseconds(Clock::now() - decoded_at);
    // Where the fetch's time went (docs/operations.md, "The fetch record").
    const json steps{
        {"connect_and_request_ms", milliseconds(received - started) - milliseconds(fetched.value()->reply_wait) -
                                       milliseconds(fetched.value()->transfer)},
        {"reply_wait_ms", milliseconds(fetched.value()->reply_wait)},
        {"transfer_ms", milliseconds(fetched.value()->transfer)},
        {"decode_ms", milliseconds(decoded_at - received)},
        {"entry_ms", held ? 0.0 : filing_ms},
        {"join_ms", held ? filing_ms : 0.0}};
    // Shared memory from a same-host peer is counted apart from what crossed TCP.
    const char* direction = transport == "shm" ? "fetched_shm" : "fetched";
    metrics_.wire_bytes.with({direction, medium, codec}).inc(static_cast<double>(frame.size()));
    metrics_.raw_bytes.with({direction, medium}).inc(static_cast<double>(fetched_raw_bytes));
    metrics_.fetch_seconds.with({route}).observe(seconds);
    {
      std::lock_guard lock(engine_mutex_);
      if (engine_) {
        if (const auto link = engine_->find_link("peer:" + peer_id)) {
          engine_->observe_link(link.value(), static_cast<double>(frame.size()), seconds);
        }
      }
    }
    observe_codec(codec, decoded.value().header.layout.dtype, fetched_raw_bytes, frame.size(), std::nullopt,
                  std::chrono::duration<double>(decoded_at - received).count());
    json attempt{{"peer", peer_id},
                 {"result", "fetched"},
                 {"transport", transport},
                 {"held_tokens", held_tokens},
                 {"fetched_tokens", blocks * request.block_tokens - held_tokens},
                 {"frame_bytes", frame.size()},
                 {"raw_bytes", fetched_raw_bytes},
                 {"seconds", seconds},
                 {"steps", steps}};
    if (!fetched.value()->transport_note.empty()) attempt["transport_note"] = fetched.value()->transport_note;
    attempts.push_back(std::move(attempt));
    record["fetch"] = std::move(attempts);
    return Fetched{std::move(entry).value(), blocks, peer_id};
  }
  record["fetch"] = std::move(attempts);
  return std::nullopt;
}

Result<shm::ResolvedEntry> KvPath::resolve(const shm::ResolveRequest& request) {
  const auto started = Clock::now();
  const auto policy = policy_->current();
  json record{{"kind", "lookup"}, {"time_unix_ms", unix_millis()}, {"prompt_tokens", request.prompt_tokens}};
  auto finish = [&](std::string_view outcome, std::size_t served_blocks) {
    record["outcome"] = outcome;
    record["served_tokens"] = served_blocks * request.block_tokens;
    record["resolve_ms"] = std::chrono::duration<double, std::milli>(Clock::now() - started).count();
    metrics_.lookups.with({outcome}).inc();
    log_.record(std::move(record));
  };

  auto parsed = parse_request_context(request.params_json);
  if (!parsed) {
    record["error"] = parsed.error().message;
    finish("error", 0);
    return parsed.error();
  }
  const RequestContext& context = parsed.value();
  const RoutePolicy* route = pick_route(*policy, context);
  record["request_id"] = context.request_id;
  record["agent"] = context.agent;
  record["route"] = route != nullptr ? json(route->id) : json();
  if (context.treatment) record["treatment"] = treatment_json(*context.treatment);
  if (context.max_tokens) record["max_tokens"] = *context.max_tokens;

  // Blocks that may be served: never the whole prompt (its last token is prefilled for logits),
  // and for a "prompt" span treatment only the blocks inside A's prompt.
  std::size_t max_blocks = std::min<std::size_t>(
      request.block_hashes.size(), static_cast<std::size_t>((request.prompt_tokens - 1) / request.block_tokens));
  if (request.prompt_tokens == 0) max_blocks = 0;
  if (context.treatment && context.treatment->span == "prompt") {
    if (!context.treatment->prompt_tokens) {
      record["error"] = "treatment span \"prompt\" needs treatment.prompt_tokens";
      finish("error", 0);
      return fail(ErrorCode::kInvalidArgument,
                  "kv_transfer_params.kvrelay.treatment: span \"prompt\" needs prompt_tokens");
    }
    max_blocks = std::min<std::size_t>(max_blocks, *context.treatment->prompt_tokens / request.block_tokens);
  }
  record["available_tokens"] = max_blocks * request.block_tokens;

  // This sidecar's store first: the longest exact chain prefix it holds (the engine prices only
  // the rest), and any longer lossy one, which only a lookup with the same lossy codec may use.
  const HeldPrefixes held = find_held_prefixes(*store_, request);
  std::shared_ptr<const kv_store::StoredEntry> entry = held.exact;
  std::size_t entry_blocks = held.exact_blocks;
  const Choice choice = choose(*policy, route, context, max_blocks * request.block_tokens,
                               std::min(entry_blocks, max_blocks) * request.block_tokens);
  const double decision_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  metrics_.decision_seconds.get().observe(decision_seconds);
  metrics_.decisions.with({choice.medium, choice.source}).inc();
  record["medium"] = choice.medium;
  record["source"] = choice.source;
  record["reason"] = choice.reason;
  record["decision_us"] = decision_seconds * 1e6;
  if (choice.serve_held_prefix) record["held_prefix_served"] = true;
  if (!choice.cost.is_null()) record["cost"] = choice.cost;

  if (choice.medium == "tokens" && !choice.serve_held_prefix) {
    finish("tokens", 0);
    return fail(ErrorCode::kNotFound, fmt::format("medium tokens: {}", choice.reason));
  }
  if (max_blocks == 0) {
    finish("miss", 0);
    return fail(ErrorCode::kNotFound, "prompt shorter than one block plus one token");
  }
  // The held prefix under a tokens choice is served as stored: exact, no codec.
  const std::string codec = choice.serve_held_prefix ? std::string("raw") : *codec_for_medium(choice.medium);
  const bool lossless = codec::fidelity_of(*codecs_, codec).is_exact();
  if (!lossless && request.client_version < shm::kFidelityDataPlaneVersion) {
    // The worker could not say that what it computes over lossy KV is lossy: it prefills.
    record["reason"] = fmt::format("{}; but the worker's data plane (version {}) cannot carry lossy KV's fidelity",
                                   choice.reason, request.client_version);
    finish("tokens", 0);
    return fail(ErrorCode::kNotFound,
                fmt::format("medium {} is lossy and this client speaks data-plane version {} (lossy KV needs {})",
                            choice.medium, request.client_version, shm::kFidelityDataPlaneVersion));
  }

  bool already_encoded = false;
  if (!lossless && held.lossy_blocks > entry_blocks && held.lossy->fidelity.lossy_codec == codec) {
    // KV that already went through this codec (a push, say) is what this medium delivers.
    entry = held.lossy;
    entry_blocks = held.lossy_blocks;
    already_encoded = true;
  }
  std::string from = entry ? "local" : "";
  // A delta fetch moves only the k blocks the peer adds, but joining them to the N held blocks
  // writes all N + k into a new entry (fresh memory), and a fetch has fixed costs that weigh more
  // at short lengths: with a local prefix in hand it pays only when the peer adds a good share.
  // Measured on the demo shape: without this rule a same-node hit fetched 32 MiB to save 16
  // tokens of prefill (before deltas); half keeps clear of that and of short-context losses.
  const bool peer_gain_worth_it =
      entry_blocks == 0 || (max_blocks - std::min(entry_blocks, max_blocks)) * kPeerFetchMinGainDivisor >= entry_blocks;
  if (std::min(entry_blocks, max_blocks) < max_blocks && route != nullptr && peer_gain_worth_it &&
      !choice.serve_held_prefix) {
    const bool held_prefix = entry != nullptr;
    if (auto fetched = fetch_from_peers(*policy, request, entry, entry_blocks, codec, choice.medium, route->id,
                                        started + policy->limits.kv_lookup_timeout, record)) {
      entry = std::move(fetched->entry);
      entry_blocks = fetched->blocks;
      from = (held_prefix ? "local+peer:" : "peer:") + fetched->peer;  // local+: held prefix + delta
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
    finish("miss", 0);
    return fail(ErrorCode::kNotFound, "neither this sidecar nor its peers hold a prefix of this prompt");
  }
  record["kv_from"] = from;
  const std::size_t served_blocks = std::min(entry_blocks, max_blocks);
  if (served_blocks < entry_blocks) {
    auto sliced = slice_entry(*entry, served_blocks * request.block_tokens, arena_.get());
    if (!sliced) {
      record["error"] = sliced.error().message;
      finish("error", 0);
      return sliced.error();
    }
    entry = std::move(sliced).value();
  }
  if (!already_encoded && !lossless) {
    // Same node: the bytes move over shared memory, but B gets exactly what the codec delivers.
    const auto encode_started = Clock::now();
    auto frame = encode_entry(*codecs_, codec, *entry);
    const auto encoded_at = Clock::now();
    auto decoded = frame ? decode_entry(*codecs_, frame.value(), policy->limits.kv_store_bytes, arena_.get())
                         : Result<std::shared_ptr<const kv_store::StoredEntry>>(frame.error());
    if (!decoded) {
      record["error"] = decoded.error().message;
      finish("error", 0);
      return decoded.error();
    }
    // decode_entry's time includes filing the entry, as a fetch's decode does not: an upper bound.
    observe_codec(codec, entry->info.layout.dtype, entry->info.bytes, frame.value().size(),
                  std::chrono::duration<double>(encoded_at - encode_started).count(),
                  std::chrono::duration<double>(Clock::now() - encoded_at).count());
    metrics_.wire_bytes.with({"shm", choice.medium, codec}).inc(static_cast<double>(frame.value().size()));
    entry = std::move(decoded).value();
  }
  if (!already_encoded) {
    metrics_.raw_bytes.with({"shm", choice.medium}).inc(static_cast<double>(entry->info.bytes));
  }
  if (route != nullptr) {
    outcomes_.served(context.request_id, {route->id, choice.medium, static_cast<double>(entry->info.bytes), started});
  }
  // Whatever the medium, a lookup that chose a lossless one gets exact KV, or none.
  if (lossless && !entry->fidelity.is_exact()) {
    record["error"] = "internal: lossy KV on a lossless lookup";
    finish("error", 0);
    return fail(ErrorCode::kInternal, "lossy KV reached a lookup that chose a lossless medium; not served");
  }
  record["fidelity"] = fidelity_json(entry->fidelity);
  finish(from == "local" ? "hit_local" : "hit_peer", served_blocks);
  Fidelity fidelity = entry->fidelity;
  return shm::ResolvedEntry{
      std::move(entry),
      shm::ResolvedMeta{static_cast<std::uint32_t>(served_blocks),
                        choice.serve_held_prefix ? std::string("kv_raw") : choice.medium, std::move(fidelity)}};
}

void KvPath::published(const kv_store::EntryKey& key, const std::shared_ptr<const kv_store::StoredEntry>& entry,
                       std::string_view params_json) {
  auto parsed = parse_request_context(params_json);
  if (!parsed || parsed.value().agent.empty()) return;
  const auto policy = policy_->current();
  for (const auto& route : policy->routes) {
    if (route.from_agent != parsed.value().agent || !route.push || !route.enabled) continue;
    const auto* to = policy->find_agent(route.to_agent);
    if (to == nullptr || to->node.empty() || to->node == policy->node_id) continue;  // same node: already here
    if (policy->find_peer(to->node) == nullptr) continue;
    RequestContext context = parsed.value();
    context.treatment.reset();
    context.max_tokens.reset();  // A's answer budget; B's is not known before B asks
    // What the receiving node holds is not known here: the whole entry is priced.
    const Choice choice = choose(*policy, &route, context, entry->info.layout.tokens, 0);
    json record{{"kind", "push"},
                {"time_unix_ms", unix_millis()},
                {"request_id", context.request_id},
                {"agent", context.agent},
                {"route", route.id},
                {"medium", choice.medium},
                {"source", choice.source},
                {"reason", choice.reason},
                {"to_node", to->node},
                {"tokens", entry->info.layout.tokens}};
    if (!choice.cost.is_null()) record["cost"] = choice.cost;
    // Lossy KV under a lossless medium would be filed as exact at the destination.
    const auto push_codec = codec_for_medium(choice.medium);
    const bool lossy_as_exact =
        push_codec && !entry->fidelity.is_exact() && codec::fidelity_of(*codecs_, *push_codec).is_exact();
    if (lossy_as_exact) {
      record["outcome"] = "not_pushed";
      record["reason"] =
          fmt::format("the KV is lossy ({}) and the medium {} is lossless", entry->fidelity.lossy_codec, choice.medium);
      log_.record(std::move(record));
      metrics_.pushes.with({route.id, "lossy_kv"}).inc();
      continue;
    }
    if (choice.medium == "tokens") {
      record["outcome"] = "not_pushed";
      log_.record(std::move(record));
      metrics_.pushes.with({route.id, "tokens"}).inc();
      continue;
    }
    std::lock_guard lock(push_mutex_);
    if (push_queue_.size() >= kPushQueueLimit) {
      metrics_.pushes.with({route.id, "dropped"}).inc();
      continue;  // the destination will fetch on demand instead
    }
    push_queue_.push_back(
        PushJob{route.id, to->node, choice.medium, *codec_for_medium(choice.medium), key, entry, std::move(record)});
    push_wake_.notify_one();
  }
}

void KvPath::run_pusher() {
  while (true) {
    PushJob job;
    {
      std::unique_lock lock(push_mutex_);
      push_wake_.wait(lock, [this] { return stopping_ || !push_queue_.empty(); });
      if (stopping_) return;
      job = std::move(push_queue_.front());
      push_queue_.pop_front();
    }
    const auto policy = policy_->current();
    const auto started = Clock::now();
    auto frame = encode_entry(*codecs_, job.codec, *job.entry);
    if (frame) {
      observe_codec(job.codec, job.entry->info.layout.dtype, job.entry->info.bytes, frame.value().size(),
                    std::chrono::duration<double>(Clock::now() - started).count(), std::nullopt);
    }
    Status pushed =
        frame ? peers_->push(job.peer, std::random_device{}(), job.key, frame.value(), policy->limits.read_timeout)
              : Status(frame.error());
    const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
    if (pushed) {
      metrics_.wire_bytes.with({"pushed", job.medium, job.codec}).inc(static_cast<double>(frame.value().size()));
      metrics_.raw_bytes.with({"pushed", job.medium}).inc(static_cast<double>(job.entry->info.bytes));
      job.record["frame_bytes"] = frame.value().size();
      job.record["outcome"] = "pushed";
    } else {
      job.record["outcome"] = "failed";
      job.record["error"] = pushed.error().to_string();
      spdlog::warn("KV path: push on route {} to {} failed: {}", job.route, job.peer, pushed.error().to_string());
    }
    job.record["seconds"] = seconds;
    metrics_.pushes.with({job.route, pushed ? "pushed" : "failed"}).inc();
    log_.record(std::move(job.record));
  }
}

void KvPath::prefill_observed(const shm::PrefillReport& report) {
  auto parsed = parse_request_context(report.params_json);
  const auto policy = policy_->current();
  std::string agent = parsed ? parsed.value().agent : std::string();
  if (policy->find_agent(agent) == nullptr) {
    metrics_.prefill_reports.with({"unknown"}).inc();
    return;
  }
  metrics_.prefill_reports.with({agent}).inc();
  const auto outcome = outcomes_.reported(parsed ? parsed.value().request_id : std::string(), report.seconds);
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
  const auto medium_name = medium_for_codec(codec);
  if (medium_name == "kv_raw") return;
  constexpr double kNotTimed = std::numeric_limits<double>::quiet_NaN();  // the engine skips that side
  std::lock_guard lock(engine_mutex_);
  if (!engine_) return;
  if (const auto medium = engine_->find_medium(medium_name)) {
    engine_->observe_codec(medium.value(), dtype, static_cast<double>(raw_bytes), static_cast<double>(frame_bytes),
                           encode_s.value_or(kNotTimed), decode_s.value_or(kNotTimed));
  }
}

void KvPath::observe_peer_rtt(const std::string& peer, double seconds) {
  std::lock_guard lock(engine_mutex_);
  if (!engine_) return;
  if (const auto link = engine_->find_link("peer:" + peer)) engine_->observe_rtt(link.value(), seconds);
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
