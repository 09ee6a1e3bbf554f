#include "shm_metrics.h"

namespace kvrelay::proxy {

ShmServerMetrics::ShmServerMetrics(metrics::Registry& registry)
    : connections_(
          registry.gauge("kvrelay_shm_connections", "Worker connections to the shared-memory data plane").get()),
      entries_(registry.gauge("kvrelay_shm_entries", "KV entries in the sidecar's store").get()),
      entry_bytes_(registry.gauge("kvrelay_shm_entry_bytes", "Bytes of the KV entries in the store").get()),
      pending_regions_(
          registry.gauge("kvrelay_shm_pending_regions", "Regions allocated or attached by workers, not yet committed")
              .get()),
      pending_bytes_(registry.gauge("kvrelay_shm_pending_bytes", "Bytes of the pending regions").get()),
      open_rings_(registry.gauge("kvrelay_shm_open_rings", "Small-message rings open to workers").get()),
      arena_bytes_(
          registry.gauge("kvrelay_shm_arena_bytes", "Capacity of the shared-memory arena (limits.shm_arena_bytes)")
              .get()),
      arena_bytes_in_use_(
          registry.gauge("kvrelay_shm_arena_bytes_in_use", "Arena bytes held by entries, pending regions and leases")
              .get()),
      leases_(registry.gauge("kvrelay_shm_leases", "Arena entries handed to workers and not yet given back").get()) {}

void ShmServerMetrics::refresh() {
  const shm::ShmServer* server = server_.load();
  if (server == nullptr) return;
  const auto stats = server->stats();
  connections_.set(static_cast<double>(stats.connections));
  entries_.set(static_cast<double>(stats.entries));
  entry_bytes_.set(static_cast<double>(stats.entry_bytes));
  pending_regions_.set(static_cast<double>(stats.pending_regions));
  pending_bytes_.set(static_cast<double>(stats.pending_bytes));
  open_rings_.set(static_cast<double>(stats.open_rings));
  arena_bytes_.set(static_cast<double>(stats.arena_bytes));
  arena_bytes_in_use_.set(static_cast<double>(stats.arena_bytes_in_use));
  leases_.set(static_cast<double>(stats.leases));
}

}  // namespace kvrelay::proxy
