#pragma once

// The policy a running daemon serves with. Readers take an immutable snapshot per request, so a
// reload or a live route change never alters a request that already began; writers replace the
// snapshot atomically (copy-on-write).

#include <nlohmann/json.hpp>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvrelay/broker/policy_source.h"
#include "kvrelay/core/metrics.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"

namespace kvrelay::proxy {

// What a reload did, field by field (docs/operations.md, "Reloading the policy").
struct ReloadReport {
  std::vector<std::string> live;                // JSON pointers into the new file, in effect now
  std::vector<std::string> restart_required;    // pointers whose running value stays until a restart
  std::vector<std::string> overrides_kept;      // routes whose live changes were applied again
  std::vector<std::string> overrides_replaced;  // routes whose live changes the file replaced
  broker::EngineUpdate engine;

  // One line for the log: "applied; restart needed for /listen/http".
  [[nodiscard]] std::string summary() const;
  [[nodiscard]] nlohmann::json to_json() const;
};

class RuntimePolicy final : public broker::PolicySource {
 public:
  RuntimePolicy(std::string path, std::shared_ptr<const Policy> initial, metrics::Registry& registry);

  [[nodiscard]] std::shared_ptr<const Policy> current() const override { return current_.load(); }

  // Re-reads and validates the policy file. On any problem the serving policy stays as it was and
  // the error carries the same pointer messages as `kvrelay check-config`. Fields read only at
  // start keep their running value in the snapshot and are named in the report; live route
  // changes survive when the file leaves their route as it was. Logs the report itself (SIGHUP).
  [[nodiscard]] Result<ReloadReport> reload();

  // Live change of one route: {"enabled": bool, "forced_medium": medium|null, "audit_fraction": 0..1}.
  // Returns the route as it now is. Lasts until a reload changes that route in the file.
  [[nodiscard]] Result<RoutePolicy> update_route(const std::string& route_id, const nlohmann::json& changes);

  [[nodiscard]] const std::string& path() const { return path_; }

  // Told of each reloaded snapshot once it serves, under the writers' lock; answers what the
  // decision engine did with it. The KV path registers itself here; without an observer the
  // report compares the engines' topologies. {} unregisters.
  void set_engine_observer(EngineObserver observer) override;

  // A check every reloaded file must pass besides validation (the daemon's memory limit,
  // memory_limit.h); a failure rejects the reload as an invalid file does. {} removes it.
  using ReloadCheck = std::function<Status(const Policy&)>;
  void set_reload_check(ReloadCheck check);

 private:
  std::string path_;
  std::atomic<std::shared_ptr<const Policy>> current_;
  std::mutex write_mutex_;  // serialises writers; readers never wait
  // Guarded by write_mutex_: the policy as the file last gave it (restart-only fields as running),
  // and each route's live changes since, merged, to apply again over an unchanged route.
  std::shared_ptr<const Policy> file_policy_;
  std::map<std::string, nlohmann::json> route_overrides_;
  EngineObserver engine_observer_;
  ReloadCheck reload_check_;
  metrics::Family<metrics::Counter>& reloads_;
  metrics::Family<metrics::Counter>& route_updates_;
  metrics::Gauge& last_reload_success_;
};

[[nodiscard]] nlohmann::json route_to_json(const RoutePolicy& route);

}  // namespace kvrelay::proxy
