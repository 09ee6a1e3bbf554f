#pragma once

// Stage four of a lookup: what it leaves behind. The decision record (GET /admin/decisions),
// the kvrelay_kv_* metrics, and the samples the decision engine's estimators learn from.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "kvrelay/broker/decision_log.h"
#include "kvrelay/broker/kv_path_metrics.h"
#include "kvrelay/core/fidelity.h"
#include "kvrelay/decision/decision_engine.h"

#include "fetch_missing.h"
#include "plan.h"
#include "precision.h"

namespace kvrelay::broker {

// One encode or decode of `codec` (a spec: "int4+zstd"); a side left out was not timed here.
struct CodecSample {
  std::string codec;
  DType dtype = DType::kFloat32;
  std::uint64_t raw_bytes = 0;
  std::uint64_t frame_bytes = 0;
  std::optional<double> encode_seconds;
  std::optional<double> decode_seconds;
};
// Feeds the engine's codec estimates; raw KV has no codec cost and is ignored.
void feed_codec(decision::DecisionEngine& engine, const CodecSample& sample);
// Feeds the engine's estimate of the link to `peer` with one fetch's bytes and seconds.
void feed_link(decision::DecisionEngine& engine, const std::string& peer, double frame_bytes, double seconds);

[[nodiscard]] std::int64_t unix_millis();
[[nodiscard]] nlohmann::json fidelity_json(const Fidelity& fidelity);
// {"chain_product", "factor", "floor", "replaced", "forced": "lossless"|"tokens", "exact_source"}
[[nodiscard]] nlohmann::json precision_refresh_json(const PrecisionRefresh& refresh);

// The plan's choice into the record (medium, source, reason, cost) and the decision metrics.
void record_plan(nlohmann::json& record, const LookupPlan& plan, double decision_seconds, KvPathMetrics& metrics);
// A fetch's bytes and time, by direction (shared memory from a same-host peer apart from TCP).
void record_fetched(KvPathMetrics& metrics, const FetchedKv& fetched, const std::string& medium,
                    const std::string& codec, const std::string& route);
// Closes a lookup's record: outcome, what it served, how long it took; counted and logged.
void finish_lookup(nlohmann::json record, std::string_view outcome, std::uint64_t served_tokens, double resolve_ms,
                   KvPathMetrics& metrics, DecisionLog& log);

}  // namespace kvrelay::broker
