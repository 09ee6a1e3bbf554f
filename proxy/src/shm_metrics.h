#pragma once

// The shared-memory data plane's state at /metrics: read from ShmServer::stats() each time the
// page renders (the server keeps these figures for its own Stats reply; copying them on every
// change would put metric updates on the data path).

#include <atomic>
#include <memory>

#include "kvrelay/core/metrics.h"
#include "kvrelay/shm_transport/server.h"

namespace kvrelay::proxy {

class ShmServerMetrics {
 public:
  explicit ShmServerMetrics(metrics::Registry& registry);
  // The server to read; null (before it starts, after it stops) leaves the gauges as they are.
  void attach(const shm::ShmServer* server) noexcept { server_.store(server); }
  void refresh();

 private:
  std::atomic<const shm::ShmServer*> server_{nullptr};
  metrics::Gauge& connections_;
  metrics::Gauge& entries_;
  metrics::Gauge& entry_bytes_;
  metrics::Gauge& pending_regions_;
  metrics::Gauge& pending_bytes_;
  metrics::Gauge& open_rings_;
  metrics::Gauge& arena_bytes_;
  metrics::Gauge& arena_bytes_in_use_;
  metrics::Gauge& leases_;
};

}  // namespace kvrelay::proxy
