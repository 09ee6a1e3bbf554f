#pragma once

#include <chrono>
#include <cstddef>
#include <deque>
#include <mutex>
#include <optional>
#include <string>

namespace kvrelay::broker {

// Lookups answered with KV, waiting for the worker's prefill report of the same request. The
// time from the lookup to the report, less the prefill the report names, is what the handoff
// cost the receiver (fetch, decode, shared-memory handoff, import): the outcome the decision
// engine learns each medium's receiver-side cost from.
class HandoffOutcomes {
 public:
  using Clock = std::chrono::steady_clock;
  struct Served {
    std::string route;
    std::string medium;
    double raw_bytes = 0.0;
    Clock::time_point started;
  };
  struct Outcome {
    Served served;
    double seconds = 0.0;
  };

  // Lookups whose report never comes (a worker without reports, a failed request) age out.
  static constexpr std::size_t kMaxPending = 256;

  void served(const std::string& request_id, Served lookup);
  // The outcome of `request_id`'s lookup, now that its prefill took `prefill_seconds`; nullopt
  // when no lookup of that request is pending.
  [[nodiscard]] std::optional<Outcome> reported(const std::string& request_id, double prefill_seconds,
                                                Clock::time_point now = Clock::now());

 private:
  std::mutex mutex_;
  std::deque<std::pair<std::string, Served>> pending_;
};

}  // namespace kvrelay::broker
