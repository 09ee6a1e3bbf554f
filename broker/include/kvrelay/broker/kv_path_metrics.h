#pragma once

// The KV path's metric families (kvrelay_kv_*), registered once per daemon.

#include "kvrelay/core/metrics.h"

namespace kvrelay::broker {

struct KvPathMetrics {
  explicit KvPathMetrics(metrics::Registry& registry);
  metrics::Family<metrics::Counter>& decisions;
  metrics::Family<metrics::Histogram>& decision_seconds;
  metrics::Family<metrics::Counter>& lookups;
  metrics::Family<metrics::Counter>& wire_bytes;
  metrics::Family<metrics::Counter>& raw_bytes;
  metrics::Family<metrics::Histogram>& fetch_seconds;
  metrics::Family<metrics::Counter>& pushes;
  metrics::Family<metrics::Counter>& prefill_reports;
  // message: lookup, publish, prefill_report; reason: unsigned, forged (broker/src/trusted_context.h)
  metrics::Family<metrics::Counter>& ignored_params;
  // route; forced: lossless, tokens (a lossy hop refused by the route's quality_floor)
  metrics::Family<metrics::Counter>& precision_refreshes;
  // Issue #27's store: prefetches sent on publish {route, result}; lookups served from prefetched
  // KV {route}; next_agents a publish named that no route of its agent leads to; lookups that
  // fetched a spilled entry back from the peer holding it {route}.
  metrics::Family<metrics::Counter>& prefetches;
  metrics::Family<metrics::Counter>& prefetch_hits;
  metrics::Family<metrics::Counter>& next_agents_ignored;
  metrics::Family<metrics::Counter>& fetch_backs;
  // Issue #28: requests the front proxy had summarised {route, outcome: summarised, failed, skipped}.
  metrics::Family<metrics::Counter>& summaries;
};

}  // namespace kvrelay::broker
