#pragma once

// What the broker needs of the policy a daemon serves with: a snapshot per request, and a word
// when a reload replaces it (the daemon's RuntimePolicy provides both). An interface, so the
// broker depends on no part of the HTTP front that owns reloading.

#include <functional>
#include <memory>
#include <string>

#include "kvrelay/core/policy.h"

namespace kvrelay::broker {

// What a reload did to the decision engine.
struct EngineUpdate {
  bool rebuilt = false;  // a new engine: its learned estimates start afresh
  std::string error;     // not empty: no engine for this policy (routes use forced media or kv_raw)
};

class PolicySource {
 public:
  virtual ~PolicySource() = default;
  // An immutable snapshot: a reload never alters a request that already began.
  [[nodiscard]] virtual std::shared_ptr<const Policy> current() const = 0;
  // Told of each reloaded snapshot once it serves; answers what the decision engine did with
  // it. {} unregisters.
  using EngineObserver = std::function<EngineUpdate(const Policy&)>;
  virtual void set_engine_observer(EngineObserver observer) = 0;
};

}  // namespace kvrelay::broker
