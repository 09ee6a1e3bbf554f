#pragma once

// Turns audit trials into cost-model parameters for the policy's optional "cost_model" section
// (docs/audit.md, docs/configuration.md): each receiving agent's prefill fit from its T0
// (tokens) trials, its decode time per token, and each codec's fidelity and extra decode
// fraction from the top-1 agreement and output lengths of its trials.

#include <nlohmann/json_fwd.hpp>

#include "kvrelay/audit/trials.h"

namespace kvrelay::audit {

struct CalibrationOptions {
  std::string baseline = "T0";
  std::size_t min_trials = 3;  // per agent or medium before a parameter is proposed
};

// {"cost_model": {"agents": {...}, "media": {...}}, "calibration": {evidence per parameter}}.
// The "cost_model" object is what an operator copies into the policy after review.
[[nodiscard]] nlohmann::json calibrate(const TrialSet& trials, const CalibrationOptions& options);

}  // namespace kvrelay::audit
