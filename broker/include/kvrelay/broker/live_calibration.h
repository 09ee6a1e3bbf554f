#pragma once

// Live audit calibration (issue #28, routes[].audit.calibrate "live"): the engine's predictions
// are checked against what the route's audited requests measured, and the difference refits a
// per-medium correction the engine adds to that medium's predicted cost. An audited request's
// time to first token is its handoff plus the receiver's prefill plus overheads the model does
// not see (HTTP, queueing, the first decode step); those overheads hit every medium alike, so
// each KV medium's correction is its median residual (measured - predicted) less the tokens
// medium's, over one window of audited outcomes. Each refit moves a correction at most
// calibrate_max_step_s, so one noisy window cannot swing the engine. Pure: the KV path applies
// refits to its engine and logs them.

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvrelay/core/policy.h"
#include "kvrelay/core/treatment.h"

namespace kvrelay::broker {

struct AuditedOutcome {
  std::string medium;  // what was delivered: "tokens" when no KV moved
  KvSpan span = KvSpan::kNone;
  double ttft_s = 0.0;
  // The engine's prediction for each medium at the lookup, audit correction left out.
  std::vector<std::pair<std::string, double>> predicted_s;
};

struct MediumRefit {
  std::string medium;
  std::size_t samples = 0;
  double median_residual_s = 0.0;  // measured - predicted
  double target_s = 0.0;           // its residual less the tokens medium's
  double before_s = 0.0;
  double after_s = 0.0;
  bool bounded = false;  // the step limit held it short of the target
};

struct Refit {
  std::string route;
  std::int64_t time_unix_ms = 0;
  std::size_t trials = 0;  // outcomes in the window
  std::size_t tokens_samples = 0;
  double tokens_median_residual_s = 0.0;
  std::vector<MediumRefit> media;  // the media refitted (enough samples)
};
[[nodiscard]] nlohmann::json refit_json(const Refit& refit);

class LiveCalibration {
 public:
  static constexpr std::size_t kMinSamples = 2;   // per medium per window, tokens included
  static constexpr std::size_t kKeptRefits = 64;  // the log GET /admin/audit/calibration shows

  // Files one audited outcome of `route` (which calibrates live); when it completes the route's
  // window, the refit of the media with enough samples. `current` gives a medium's correction
  // now. Outcomes whose span is not "all" or "none" are counted but not fitted: the engine
  // predicts whole handoffs only.
  template <typename Current>
  [[nodiscard]] std::optional<Refit> observe(const RoutePolicy& route, const AuditedOutcome& outcome,
                                             Current&& current) {
    std::vector<std::pair<std::string, double>> corrections;
    std::lock_guard lock(mutex_);
    auto& window = windows_[route.id];
    window.push_back(outcome);
    if (window.size() < route.audit.calibrate_window) return std::nullopt;
    for (const auto& [medium, predicted] : outcome.predicted_s)
      corrections.emplace_back(medium, current(medium));
    auto refit = fit(route, window, corrections);
    window.clear();
    if (refit) {
      if (log_.size() >= kKeptRefits) log_.pop_front();
      log_.push_back(*refit);
    }
    return refit;
  }

  // {"refits": [newest last], "pending": {route: outcomes in its current window}}.
  [[nodiscard]] nlohmann::json snapshot() const;

 private:
  [[nodiscard]] static std::optional<Refit> fit(const RoutePolicy& route, const std::vector<AuditedOutcome>& window,
                                                const std::vector<std::pair<std::string, double>>& corrections);

  mutable std::mutex mutex_;
  std::map<std::string, std::vector<AuditedOutcome>> windows_;
  std::deque<Refit> log_;
};

}  // namespace kvrelay::broker
