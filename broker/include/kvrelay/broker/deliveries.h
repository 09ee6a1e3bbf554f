#pragma once

// What the KV path delivered of each audited request's treatment (issue #28). The lookup records
// it; the front proxy takes it when the request ends and files it with the trial's outcome, so
// every trial says what was assigned and what was delivered, and why they differ.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvrelay/broker/request_context.h"
#include "kvrelay/core/treatment.h"

namespace kvrelay::broker {

struct Delivery {
  KvSpan span = KvSpan::kNone;    // what moved as KV; kNone: nothing (the worker prefilled)
  std::string medium = "tokens";  // the medium that carried it
  std::uint64_t tokens = 0;       // KV tokens served
  bool as_assigned = false;
  std::string reason;  // why it differs from the assignment; "" when as assigned
  // The engine's prediction for each medium at the lookup, its audit correction left out (what
  // live calibration compares the measured outcome with); empty without a route.
  std::vector<std::pair<std::string, double>> predicted_s;
};

// What an audited request was delivered when the front proxy summarised A's context: all of it,
// as a summary, no KV; as assigned when the treatment asked for a summary of all of it.
[[nodiscard]] Delivery summary_delivery(const Treatment& assigned, const SummaryApplied& summary);

class Deliveries {
 public:
  // Requests whose outcome never comes (a worker that died) age out, oldest first.
  static constexpr std::size_t kMaxPending = 4096;

  // A later lookup of the same request replaces its delivery.
  void record(const std::string& request_id, Delivery delivery);
  // The request's delivery, forgotten here; nullopt when no lookup of it was recorded.
  [[nodiscard]] std::optional<Delivery> take(const std::string& request_id);

 private:
  std::mutex mutex_;
  std::deque<std::pair<std::string, Delivery>> pending_;
};

}  // namespace kvrelay::broker
