#include "kvrelay/decision/decision_json.h"

#include <string>

namespace kvrelay::decision {

namespace {

std::string medium_name(const DecisionEngine& engine, MediumId id) {
  return id == kNoMedium || id >= engine.media_count() ? std::string() : engine.medium(id).name;
}

// Why a candidate that was eligible still lost: to the argmin on cost, or to hysteresis.
std::string lost_because(const Decision& decision, const CandidateCost& candidate) {
  if (candidate.excluded != Exclusion::kNone) {
    return std::string(exclusion_name(candidate.excluded));
  }
  if (candidate.medium == decision.chosen) {
    return "";
  }
  if (candidate.medium == decision.argmin) {
    return std::string(decision_reason_name(decision.reason));
  }
  return "higher_cost";
}

}  // namespace

nlohmann::json decision_to_json(const Decision& decision, const DecisionEngine& engine) {
  nlohmann::json candidates = nlohmann::json::array();
  for (std::size_t i = 0; i < decision.candidate_count; ++i) {
    const CandidateCost& c = decision.candidates[i];
    nlohmann::json entry = {
        {"medium", medium_name(engine, c.medium)},
        {"eligible", c.excluded == Exclusion::kNone},
        {"c_comm_s", c.comm_s},
        {"c_codec_s", c.codec_s},
        {"c_comp_s", c.comp_s},
        {"c_loss_s", c.loss_s},
        {"audit_correction_s", c.audit_s},
        {"total_s", c.total_s},
        {"wire_bytes", c.wire_bytes},
    };
    const std::string lost = lost_because(decision, c);
    if (!lost.empty()) {
      entry["lost_because"] = lost;
    }
    candidates.push_back(std::move(entry));
  }
  nlohmann::json out = {
      {"route", decision.route < engine.route_count() ? engine.route_name(decision.route) : std::string()},
      {"chosen", medium_name(engine, decision.chosen)},
      {"argmin", medium_name(engine, decision.argmin)},
      {"reason", std::string(decision_reason_name(decision.reason))},
      {"hysteresis_held", decision.hysteresis_held},
      {"predicted_gain", decision.predicted_gain},
      {"deadline_miss", decision.deadline_miss},
      {"missing_tokens", decision.missing_tokens},
      {"dtype", std::string(dtype_name(decision.dtype))},
      {"chain_fidelity_after", decision.chain_fidelity_after},
      {"candidates", std::move(candidates)},
  };
  if (decision.previous != kNoMedium) {
    out["previous"] = medium_name(engine, decision.previous);
  }
  return out;
}

}  // namespace kvrelay::decision
