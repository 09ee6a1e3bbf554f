#pragma once

// The last N KV-path decisions (route, request, medium, cost breakdown, outcome), newest last,
// for GET /admin/decisions. Bounded: the oldest record is dropped when the ring is full.

#include <nlohmann/json.hpp>

#include <cstddef>
#include <deque>
#include <mutex>

namespace kvrelay::broker {

class DecisionLog {
 public:
  explicit DecisionLog(std::size_t capacity = 1024) : capacity_(capacity == 0 ? 1 : capacity) {}

  void record(nlohmann::json decision);
  // The `limit` most recent decisions, newest first.
  [[nodiscard]] nlohmann::json recent(std::size_t limit) const;
  [[nodiscard]] std::size_t capacity() const { return capacity_; }

 private:
  std::size_t capacity_;
  mutable std::mutex mutex_;
  std::deque<nlohmann::json> records_;
};

}  // namespace kvrelay::broker
