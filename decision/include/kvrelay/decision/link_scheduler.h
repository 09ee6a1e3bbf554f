#pragma once

// One link's transfer scheduler. Transfers are cut into chunks; the link sends one chunk at a
// time. Between time slices the next transfer is picked by smooth weighted round robin with
//   weight = prio(src) + prio(dst) + base + alpha * exp(beta * queue_delay)
// where queue_delay is the time the transfer has spent waiting (not being sent), so waiting
// raises a transfer's weight without bound and nothing starves. A new transfer whose urgency
// (its weight) exceeds the running one's by `preempt_factor` takes the link at the next chunk
// boundary if the running one is less than `preempt_max_done` finished; the preempted transfer
// keeps its progress and resumes later. Critical flows with a reserved share are served first
// whenever they are behind that share of the bytes sent since they arrived.
//
// Time is the caller's (virtual) clock: step() says how long each chunk takes at the link's
// bandwidth and advances the clock by exactly that, so tests and the simulator never sleep.

#include <cstdint>
#include <optional>
#include <vector>

#include "kvrelay/core/result.h"

namespace kvrelay::decision {

struct SchedulerConfig {
  double link_bytes_per_s = 1.25e8;
  std::uint64_t chunk_bytes = 256 * 1024;
  std::uint32_t slice_chunks = 4;
  double base = 1.0;
  double alpha = 1.0;
  double beta = 10.0;          // per second of queue delay
  double max_exponent = 40.0;  // caps exp() so weights stay finite; aged transfers then share fairly
  double preempt_factor = 2.0;
  double preempt_max_done = 0.5;
};

struct TransferSpec {
  std::uint64_t id = 0;
  std::uint64_t bytes = 0;
  int src_priority = 0;  // role priorities 0..7
  int dst_priority = 0;
  double reserved_share = 0.0;  // > 0 marks a critical flow with that share of the link
};

struct ChunkEvent {
  std::uint64_t transfer = 0;
  std::uint64_t offset = 0;
  std::uint64_t bytes = 0;
  double start_s = 0.0;
  double end_s = 0.0;
  bool completed = false;   // this chunk finished the transfer
  bool preempting = false;  // first chunk of a transfer that preempted another
};

class LinkScheduler {
 public:
  explicit LinkScheduler(SchedulerConfig config);

  // Queues a transfer at the scheduler's current time (advance_to() first for later arrivals).
  // Fails on a duplicate id, zero bytes, or a reservation that would overbook the link.
  [[nodiscard]] Status submit(const TransferSpec& spec);
  // Sends the next chunk and advances the clock past it; nullopt when nothing is queued.
  std::optional<ChunkEvent> step();
  // Moves the clock forward while idle (never backwards).
  void advance_to(double time_s) noexcept;

  [[nodiscard]] double now() const noexcept { return now_; }
  [[nodiscard]] std::size_t queued() const noexcept { return transfers_.size(); }
  [[nodiscard]] std::uint64_t preemptions() const noexcept { return preemptions_; }
  // Current weight of a queued transfer; nullopt when it is not queued.
  [[nodiscard]] std::optional<double> urgency(std::uint64_t id) const noexcept;

 private:
  struct Active {
    TransferSpec spec;
    std::uint64_t sent = 0;
    double submitted_s = 0.0;
    double served_s = 0.0;  // time spent being sent
    std::uint64_t link_bytes_at_submit = 0;
    double credit = 0.0;  // smooth WRR state
  };

  [[nodiscard]] double weight(const Active& transfer) const noexcept;
  [[nodiscard]] std::size_t pick_next() noexcept;
  [[nodiscard]] std::size_t index_of(std::uint64_t id) const noexcept;

  SchedulerConfig config_;
  std::vector<Active> transfers_;
  double now_ = 0.0;
  std::uint64_t link_bytes_ = 0;  // all bytes ever sent on this link
  std::optional<std::uint64_t> running_;
  std::uint32_t slice_left_ = 0;
  std::optional<std::uint64_t> preempt_by_;
  std::uint64_t preemptions_ = 0;
};

}  // namespace kvrelay::decision
