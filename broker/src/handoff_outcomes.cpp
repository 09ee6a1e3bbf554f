#include "kvrelay/broker/handoff_outcomes.h"

#include <algorithm>

namespace kvrelay::broker {

void HandoffOutcomes::served(const std::string& request_id, Served lookup) {
  if (request_id.empty()) return;
  const std::lock_guard lock(mutex_);
  if (pending_.size() >= kMaxPending) pending_.pop_front();
  pending_.emplace_back(request_id, std::move(lookup));
}

std::optional<HandoffOutcomes::Outcome> HandoffOutcomes::reported(const std::string& request_id, double prefill_seconds,
                                                                  Clock::time_point now) {
  if (request_id.empty()) return std::nullopt;
  const std::lock_guard lock(mutex_);
  const auto found =
      std::find_if(pending_.begin(), pending_.end(), [&](const auto& entry) { return entry.first == request_id; });
  if (found == pending_.end()) return std::nullopt;
  Outcome outcome{std::move(found->second), 0.0};
  pending_.erase(found);
  const double elapsed = std::chrono::duration<double>(now - outcome.served.started).count();
  outcome.seconds = std::max(0.0, elapsed - prefill_seconds);
  return outcome;
}

void HandoffOutcomes::served_product(const std::string& request_id, double product) {
  if (request_id.empty()) return;
  const std::lock_guard lock(mutex_);
  const auto found =
      std::find_if(products_.begin(), products_.end(), [&](const auto& entry) { return entry.first == request_id; });
  if (found != products_.end()) {
    found->second = product;
    return;
  }
  if (products_.size() >= kMaxPending) products_.pop_front();
  products_.emplace_back(request_id, product);
}

std::optional<double> HandoffOutcomes::served_product_of(const std::string& request_id) {
  if (request_id.empty()) return std::nullopt;
  const std::lock_guard lock(mutex_);
  const auto found =
      std::find_if(products_.begin(), products_.end(), [&](const auto& entry) { return entry.first == request_id; });
  if (found == products_.end()) return std::nullopt;
  return found->second;
}

}  // namespace kvrelay::broker
