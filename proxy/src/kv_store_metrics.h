#pragma once

// The KV store's evictions at /metrics (kvrelay_kv_evictions_total{reason}), read from the
// store's own counts each time the page renders, so nothing is added under the store's lock.

#include <memory>
#include <mutex>

#include "kvrelay/core/metrics.h"
#include "kvrelay/kv_store/entry_store.h"

namespace kvrelay::proxy {

class KvStoreMetrics {
 public:
  KvStoreMetrics(metrics::Registry& registry, std::shared_ptr<kv_store::EntryStore> store);
  void refresh();

 private:
  std::shared_ptr<kv_store::EntryStore> store_;
  std::mutex mutex_;  // two renders at once must not both add the same evictions
  metrics::Family<metrics::Counter>& evictions_;
  metrics::Counter& budget_evictions_;
  metrics::Counter& arena_evictions_;
  metrics::Gauge& stubs_;
  metrics::Gauge& spilling_bytes_;
  metrics::Gauge& spilled_in_bytes_;
};

}  // namespace kvrelay::proxy
