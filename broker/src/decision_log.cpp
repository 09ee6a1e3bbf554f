#include "kvrelay/broker/decision_log.h"

namespace kvrelay::broker {

void DecisionLog::record(nlohmann::json decision) {
  std::lock_guard lock(mutex_);
  records_.push_back(std::move(decision));
  while (records_.size() > capacity_)
    records_.pop_front();
}

nlohmann::json DecisionLog::recent(std::size_t limit) const {
  nlohmann::json out = nlohmann::json::array();
  std::lock_guard lock(mutex_);
  for (auto it = records_.rbegin(); it != records_.rend() && out.size() < limit; ++it)
    out.push_back(*it);
  return out;
}

}  // namespace kvrelay::broker
