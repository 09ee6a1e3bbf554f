#pragma once

// The policy a running daemon serves with. Readers take an immutable snapshot per request, so a
// reload or a live route change never alters a request that already began; writers replace the
// snapshot atomically (copy-on-write).

#include <nlohmann/json_fwd.hpp>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "kvrelay/core/metrics.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"

namespace kvrelay::proxy {

class RuntimePolicy {
 public:
  RuntimePolicy(std::string path, std::shared_ptr<const Policy> initial, metrics::Registry& registry);

  [[nodiscard]] std::shared_ptr<const Policy> current() const { return current_.load(); }

  // Re-reads and validates the policy file. On any problem the serving policy stays as it was and
  // the error carries the same pointer messages as `kvrelay check-config`. Changes of listen
  // addresses only take effect on restart (reported in the returned note).
  [[nodiscard]] Result<std::string> reload();

  // Live change of one route: {"enabled": bool, "forced_medium": medium|null, "audit_fraction": 0..1}.
  // Returns the route as it now is. Lasts until the next reload.
  [[nodiscard]] Result<RoutePolicy> update_route(const std::string& route_id, const nlohmann::json& changes);

  [[nodiscard]] const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::atomic<std::shared_ptr<const Policy>> current_;
  std::mutex write_mutex_;  // serialises writers; readers never wait
  metrics::Family<metrics::Counter>& reloads_;
  metrics::Family<metrics::Counter>& route_updates_;
  metrics::Gauge& last_reload_success_;
};

[[nodiscard]] nlohmann::json route_to_json(const RoutePolicy& route);

}  // namespace kvrelay::proxy
