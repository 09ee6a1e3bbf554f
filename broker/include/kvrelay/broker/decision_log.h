#pragma once

// The last N KV-path decisions (route, request, medium, cost breakdown, outcome), newest last,
// for GET /admin/decisions. Bounded: the oldest record is dropped when the ring is full. Each
// record gets `seq`, 1 for the first since start and one more for each after it, so that a
// reader can poll for what it has not seen (`kvrelay admin decisions --follow`). Each route's
// newest decision that names a medium is kept apart from the ring, so that a quiet route still
// shows what it last chose after busier ones pushed its records out.

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>

namespace kvrelay::broker {

class DecisionLog {
 public:
  // Routes whose newest decision is kept (route ids come from the policy; past this many, the
  // route whose newest decision is the oldest is forgotten).
  static constexpr std::size_t kMaxRoutesTracked = 1024;

  explicit DecisionLog(std::size_t capacity = 1024) : capacity_(capacity == 0 ? 1 : capacity) {}

  // Stamps the decision with the next `seq` (any `seq` it carries is replaced) and keeps it.
  void record(nlohmann::json decision);
  // The `limit` most recent decisions, newest first.
  [[nodiscard]] nlohmann::json recent(std::size_t limit) const;

  struct Query {
    // Only decisions after this sequence number, oldest first; absent: the newest, newest first.
    std::optional<std::uint64_t> since;
    std::string route;  // only decisions whose "route" is this one; "" for all
    std::size_t limit = 50;
  };
  struct Page {
    nlohmann::json decisions = nlohmann::json::array();
    // What to ask `since=` next: the last decision returned when `limit` cut the answer short,
    // else the newest sequence number recorded (0 before the first decision).
    std::uint64_t cursor = 0;
    // Decisions after `since` that the ring dropped before this read (of any route).
    std::uint64_t missed = 0;
  };
  [[nodiscard]] Page query(const Query& query) const;

  // Per route, its newest decision that named a medium: {seq, kind, medium, source, outcome,
  // time_unix_ms} (fields the record lacks are left out). An object keyed by route id.
  [[nodiscard]] nlohmann::json last_by_route() const;
  // The newest sequence number recorded; 0 before the first decision.
  [[nodiscard]] std::uint64_t last_seq() const;
  [[nodiscard]] std::size_t capacity() const { return capacity_; }

 private:
  void remember_route_locked(const nlohmann::json& decision);

  std::size_t capacity_;
  mutable std::mutex mutex_;
  std::deque<nlohmann::json> records_;
  std::uint64_t last_seq_ = 0;
  std::map<std::string, nlohmann::json, std::less<>> last_by_route_;
};

}  // namespace kvrelay::broker
