#pragma once

// The decision engine as the plan stage sees it: one question, which medium for this route and
// transfer shape. KvPath answers it from its engine; tests answer it with a fixed medium.

#include <nlohmann/json.hpp>

#include <optional>
#include <string>

#include "kvrelay/core/policy.h"
#include "kvrelay/decision/decision_engine.h"

namespace kvrelay::broker {

struct EngineAdvice {
  std::string medium;
  std::string reason;
};

class EngineAdvisor {
 public:
  virtual ~EngineAdvisor() = default;
  // `commit`: the engine's choice is used (decide(), which updates its hysteresis), else only
  // priced (predict()). `cost` receives the breakdown. nullopt: no engine, or it has no answer.
  [[nodiscard]] virtual std::optional<EngineAdvice> advise(const Policy& policy, const RoutePolicy& route,
                                                           decision::TransferShape shape, bool commit,
                                                           nlohmann::json& cost) = 0;
};

}  // namespace kvrelay::broker
