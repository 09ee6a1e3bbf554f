#include "kvrelay/broker/live_calibration.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>

namespace kvrelay::broker {

namespace {

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const std::size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

std::optional<double> predicted_for(const AuditedOutcome& outcome, const std::string& medium) {
  for (const auto& [name, seconds] : outcome.predicted_s)
    if (name == medium) return seconds;
  return std::nullopt;
}

bool fitted_span(const AuditedOutcome& outcome) {
  return outcome.span == KvSpan::kAll || outcome.span == KvSpan::kNone;
}

}  // namespace

nlohmann::json refit_json(const Refit& refit) {
  nlohmann::json media = nlohmann::json::array();
  for (const auto& m : refit.media) {
    media.push_back({{"medium", m.medium},
                     {"samples", m.samples},
                     {"median_residual_s", m.median_residual_s},
                     {"target_s", m.target_s},
                     {"before_s", m.before_s},
                     {"after_s", m.after_s},
                     {"bounded", m.bounded}});
  }
  return {{"kind", "calibration"},
          {"route", refit.route},
          {"time_unix_ms", refit.time_unix_ms},
          {"trials", refit.trials},
          {"tokens_samples", refit.tokens_samples},
          {"tokens_median_residual_s", refit.tokens_median_residual_s},
          {"media", std::move(media)}};
}

std::optional<Refit> LiveCalibration::fit(const RoutePolicy& route, const std::vector<AuditedOutcome>& window,
                                          const std::vector<std::pair<std::string, double>>& corrections) {
  // Residuals by delivered medium.
  std::map<std::string, std::vector<double>> residuals;
  for (const auto& outcome : window) {
    if (!fitted_span(outcome) || !std::isfinite(outcome.ttft_s)) continue;
    const auto predicted = predicted_for(outcome, outcome.medium);
    if (!predicted) continue;
    residuals[outcome.medium].push_back(outcome.ttft_s - *predicted);
  }
  const auto tokens = residuals.find("tokens");
  if (tokens == residuals.end() || tokens->second.size() < kMinSamples) return std::nullopt;
  Refit refit;
  refit.route = route.id;
  refit.time_unix_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  refit.trials = window.size();
  refit.tokens_samples = tokens->second.size();
  refit.tokens_median_residual_s = median(tokens->second);
  const double step = route.audit.calibrate_max_step_s;
  for (const auto& [medium, values] : residuals) {
    if (medium == "tokens" || values.size() < kMinSamples) continue;
    MediumRefit m;
    m.medium = medium;
    m.samples = values.size();
    m.median_residual_s = median(values);
    m.target_s = m.median_residual_s - refit.tokens_median_residual_s;
    for (const auto& [name, seconds] : corrections)
      if (name == medium) m.before_s = seconds;
    const double change = std::clamp(m.target_s - m.before_s, -step, step);
    m.after_s = m.before_s + change;
    m.bounded = change != m.target_s - m.before_s;
    refit.media.push_back(std::move(m));
  }
  if (refit.media.empty()) return std::nullopt;
  return refit;
}

nlohmann::json LiveCalibration::snapshot() const {
  std::lock_guard lock(mutex_);
  nlohmann::json refits = nlohmann::json::array();
  for (const auto& refit : log_)
    refits.push_back(refit_json(refit));
  nlohmann::json pending = nlohmann::json::object();
  for (const auto& [route, window] : windows_)
    pending[route] = window.size();
  return {{"refits", std::move(refits)}, {"pending", std::move(pending)}};
}

}  // namespace kvrelay::broker
