#include "record.h"

#include <chrono>
#include <limits>

#include "kv_media.h"

namespace kvrelay::broker {

using nlohmann::json;

KvPathMetrics::KvPathMetrics(metrics::Registry& registry)
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
                                       "Prefill timings workers reported to the cost model, by agent", {"agent"})),
      ignored_params(registry.counter("kvrelay_kv_ignored_params_total",
                                      "Workers' messages whose kv_transfer_params.kvrelay fields were unsigned or "
                                      "forged and were treated as absent, by message and reason",
                                      {"message", "reason"})),
      precision_refreshes(registry.counter("kvrelay_kv_precision_refreshes_total",
                                           "Lookups whose lossy medium would have taken the KV's fidelity product "
                                           "below the route's quality_floor, by route and what was served instead "
                                           "(lossless, tokens)",
                                           {"route", "forced"})),
      prefetches(registry.counter("kvrelay_kv_prefetches_total",
                                  "KV sent ahead on publish at background priority to a route's remote destination, "
                                  "by route and result",
                                  {"route", "result"})),
      prefetch_hits(registry.counter("kvrelay_kv_prefetch_hits_total",
                                     "Lookups served from KV a peer prefetched here, by route", {"route"})),
      next_agents_ignored(registry.counter("kvrelay_kv_next_agents_ignored_total",
                                           "Agents a publish named in next_agents that no route of its agent leads "
                                           "to, ignored",
                                           {})),
      fetch_backs(registry.counter("kvrelay_kv_fetch_backs_total",
                                   "Lookups that met a stub and fetched the spilled entry back, by route", {"route"})),
      summaries(registry.counter("kvrelay_summaries_total",
                                 "Handoffs the front proxy was to send as a summary of A's context, by route and "
                                 "outcome (summarised; failed: B got its original request; skipped: no span known)",
                                 {"route", "outcome"})) {}

void feed_codec(decision::DecisionEngine& engine, const CodecSample& sample) {
  const auto medium_name = medium_for_codec(sample.codec);
  if (medium_name == "kv_raw") return;
  constexpr double kNotTimed = std::numeric_limits<double>::quiet_NaN();  // the engine skips that side
  if (const auto medium = engine.find_medium(medium_name)) {
    engine.observe_codec(medium.value(), sample.dtype, static_cast<double>(sample.raw_bytes),
                         static_cast<double>(sample.frame_bytes), sample.encode_seconds.value_or(kNotTimed),
                         sample.decode_seconds.value_or(kNotTimed));
  }
}

void feed_link(decision::DecisionEngine& engine, const std::string& peer, double frame_bytes, double seconds) {
  if (const auto link = engine.find_link("peer:" + peer)) engine.observe_link(link.value(), frame_bytes, seconds);
}

std::int64_t unix_millis() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

json fidelity_json(const Fidelity& fidelity) {
  if (fidelity.is_exact()) return "exact";
  json out{{"lossy_codec", fidelity.lossy_codec}, {"exact_tokens", fidelity.exact_tokens}};
  if (fidelity.product < 1.0) out["product"] = fidelity.product;  // 1: nobody stamped one
  return out;
}

json precision_refresh_json(const PrecisionRefresh& refresh) {
  return {{"chain_product", refresh.hop.chain_product},
          {"factor", refresh.hop.factor},
          {"floor", refresh.hop.floor},
          {"replaced", refresh.replaced_medium},
          {"forced", refresh_forced_name(refresh.forced)},
          {"exact_source", refresh.exact_source}};
}

void record_plan(json& record, const LookupPlan& plan, double decision_seconds, KvPathMetrics& metrics) {
  const MediumChoice& choice = plan.choice;
  metrics.decision_seconds.get().observe(decision_seconds);
  metrics.decisions.with({choice.medium, choice.source}).inc();
  record["medium"] = choice.medium;
  record["source"] = choice.source;
  record["reason"] = choice.reason;
  record["decision_us"] = decision_seconds * 1e6;
  if (choice.serve_held_prefix) record["held_prefix_served"] = true;
  if (!choice.cost.is_null()) record["cost"] = choice.cost;
  if (plan.route != nullptr && plan.route->quality_floor > 0.0) record["chain_product"] = plan.chain_product;
  if (choice.refresh) {
    record["precision_refresh"] = precision_refresh_json(*choice.refresh);
    const std::string route = plan.route != nullptr ? plan.route->id : std::string();
    metrics.precision_refreshes.with({route, std::string(refresh_forced_name(choice.refresh->forced))}).inc();
  }
}

void record_fetched(KvPathMetrics& metrics, const FetchedKv& fetched, const std::string& medium,
                    const std::string& codec, const std::string& route) {
  const char* direction = fetched.transport == "shm" ? "fetched_shm" : "fetched";
  metrics.wire_bytes.with({direction, medium, codec}).inc(static_cast<double>(fetched.frame_bytes));
  metrics.raw_bytes.with({direction, medium}).inc(static_cast<double>(fetched.raw_bytes));
  metrics.fetch_seconds.with({route}).observe(fetched.seconds);
}

void finish_lookup(json record, std::string_view outcome, std::uint64_t served_tokens, double resolve_ms,
                   KvPathMetrics& metrics, DecisionLog& log) {
  record["outcome"] = outcome;
  record["served_tokens"] = served_tokens;
  record["resolve_ms"] = resolve_ms;
  metrics.lookups.with({outcome}).inc();
  log.record(std::move(record));
}

}  // namespace kvrelay::broker
