#include "kv_store_metrics.h"

namespace kvrelay::proxy {

namespace {

// Counters only go up: add what the store counted since the last render.
void catch_up(metrics::Counter& counter, std::uint64_t total) {
  const double seen = counter.value();
  if (static_cast<double>(total) > seen) counter.inc(static_cast<double>(total) - seen);
}

}  // namespace

KvStoreMetrics::KvStoreMetrics(metrics::Registry& registry, std::shared_ptr<kv_store::EntryStore> store)
    : store_(std::move(store)),
      evictions_(registry.counter("kvrelay_kv_evictions_total",
                                  "KV entries the store dropped to make room, by reason: budget "
                                  "(limits.kv_store_bytes) or arena (limits.shm_arena_bytes)",
                                  {"reason"})),
      budget_evictions_(evictions_.with({"budget"})),
      arena_evictions_(evictions_.with({"arena"})),
      stubs_(registry.gauge("kvrelay_kv_stubs", "Stubs of entries this store spilled to peers (issue #27)").with({})),
      spilling_bytes_(
          registry.gauge("kvrelay_kv_spilling_bytes", "Bytes of store victims whose spill push has not ended")
              .with({})),
      spilled_in_bytes_(
          registry.gauge("kvrelay_kv_spilled_in_bytes", "Bytes of entries peers spilled into this store").with({})) {}

void KvStoreMetrics::refresh() {
  const auto stats = store_->stats();
  std::lock_guard lock(mutex_);
  catch_up(budget_evictions_, stats.budget_evictions);
  catch_up(arena_evictions_, stats.arena_evictions);
  stubs_.set(static_cast<double>(stats.stubs));
  spilling_bytes_.set(static_cast<double>(stats.spilling_bytes));
  spilled_in_bytes_.set(static_cast<double>(stats.spilled_in_bytes));
}

}  // namespace kvrelay::proxy
