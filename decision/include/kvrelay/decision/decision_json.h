#pragma once

// The decision log's record: every candidate's terms, why each loser lost, and whether
// hysteresis held the previous choice. Kept apart from decide() so the hot path never builds
// strings; the log serialises only the decisions it keeps.

#include <nlohmann/json.hpp>

#include "kvrelay/decision/decision_engine.h"

namespace kvrelay::decision {

[[nodiscard]] nlohmann::json decision_to_json(const Decision& decision, const DecisionEngine& engine);

}  // namespace kvrelay::decision
