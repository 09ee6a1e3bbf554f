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

  // The fidelity product (issue #27, precision refresh) of the KV `request_id`'s lookup was
  // served: 1 for exact KV. The request's publish inherits it, since its worker's KV attended
  // over what it was served. A later lookup of the same request replaces it; the oldest of
  // kMaxPending age out.
  void served_product(const std::string& request_id, double product);
  // What the request's lookup was served; nullopt when no lookup of it is known. Kept for every
  // publish of the request (a worker may publish more than once).
  [[nodiscard]] std::optional<double> served_product_of(const std::string& request_id);

 private:
  std::mutex mutex_;
  std::deque<std::pair<std::string, Served>> pending_;
  std::deque<std::pair<std::string, double>> products_;
};

}  // namespace kvrelay::broker
