#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/metrics.h"
#include "kvrelay/proxy/admin_router.h"
#include "kvrelay/proxy/online_audit.h"
#include "kvrelay/proxy/runtime_policy.h"
#include "kvrelay/proxy/upstream_prober.h"

namespace kvrelay::proxy {

struct AdminContext {
  std::shared_ptr<RuntimePolicy> policy;
  std::shared_ptr<metrics::Registry> registry;
  std::function<bool()> is_ready;  // listening and not draining
  std::shared_ptr<const codec::CodecRegistry> codecs;
  std::vector<codec::PluginLoadFailure> codec_load_failures;  // plugins refused at start-up
  std::shared_ptr<const UpstreamProber> upstream_prober;
  std::shared_ptr<OnlineAudit> audit;  // online audit trials; the report endpoint is empty without it
  // The KV path's live calibration (refits and pending windows); "live" is null without it.
  std::function<nlohmann::json()> live_calibration;
  std::vector<AdminEndpoint> extra_endpoints;  // rows other parts of the daemon declare (KV path)
  // Run before /metrics renders: sets the gauges of figures read on demand (the shm data plane).
  std::function<void()> before_metrics;
};

// The daemon's health, metrics and admin endpoints, declared in one table (see docs/operations.md).
[[nodiscard]] std::vector<AdminEndpoint> build_admin_endpoints(const AdminContext& context);

}  // namespace kvrelay::proxy
