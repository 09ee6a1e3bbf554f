#pragma once

// One link's transfer scheduler: which transfer may put its next chunk on the link. Pure logic:
// it reads no clock and starts no thread; every call that depends on time takes `now` in
// seconds on the caller's monotonic clock (broker::LinkQueues passes steady_clock, the tests and
// bench/decision_sim a virtual one).
//
// A transfer is submitted, then asks for each chunk (set_waiting); grant() answers which waiting
// transfer sends next, in this order:
//   0. the stall guard: one that has waited >= max_stall_s (a receiver must not time it out);
//   1. reservations: the critical transfer furthest behind its reserved share of the bytes the
//      link sent since it arrived;
//   2. deadline-raised transfers, earliest deadline first; a transfer is raised (for good) when
//      its remaining bytes at its current share of the link cannot finish before its deadline;
//   3. the running transfer while its time slice lasts, unless a waiting one weighs more than
//      preempt_factor x its weight while it is less than preempt_max_done done (preemption);
//      past its slice, only a transfer that arrived after it took the link preempts it;
//   4. smooth weighted round robin with
//        weight = prio(src) + prio(dst) + route_priority + base + alpha * exp(beta * queue_delay)
//      (queue_delay: the time it spent asking while other transfers were granted; the exponent
//      is capped);
//   5. prefetch transfers, only when nothing else asks; anything preempts them at any progress.
// At most window_chunks chunks are granted and not yet acknowledged on the link. In FIFO mode
// (the benchmarks' baseline) transfers are sent one at a time in submit order.
// A preempted transfer keeps its offset: its next grant continues where it stopped.

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string_view>
#include <vector>

#include "kvrelay/core/result.h"

namespace kvrelay::decision {

enum class SchedulerMode : std::uint8_t { kWrr, kFifo };

enum class TransferClass : std::uint8_t { kCritical, kNormal, kPrefetch };
inline constexpr std::size_t kTransferClasses = 3;
[[nodiscard]] std::string_view transfer_class_name(TransferClass klass) noexcept;

// The most of a link that reservations may take together, whatever the configuration says:
// reservations alone must never starve everyone else.
inline constexpr double kMaxReservedShare = 0.9;

struct SchedulerConfig {
  SchedulerMode mode = SchedulerMode::kWrr;
  double time_slice_s = 0.010;  // the policy allows 5..20 ms
  std::uint64_t chunk_bytes = 256 * 1024;
  std::uint32_t window_chunks = 4;  // granted and unacknowledged, per link
  double base = 1.0;
  double alpha = 1.0;
  double beta = 10.0;          // per second of queue delay
  double max_exponent = 40.0;  // caps exp() so weights stay finite; aged transfers then share fairly
  double preempt_factor = 2.0;
  double preempt_max_done = 0.4;
  double max_reserved_share = 0.5;   // the sum of reserved shares; at most kMaxReservedShare
  double link_bytes_per_s = 1.25e8;  // the link's estimate: deadline raising, and step()'s clock
  double max_stall_s = 0.0;          // 0: no stall guard
};

// Checks ranges; the messages name the policy keys' JSON pointers (/scheduler/...).
[[nodiscard]] Status validate(const SchedulerConfig& config);

struct TransferSpec {
  std::uint64_t id = 0;
  std::uint64_t bytes = 0;  // an estimate: a transfer that asks for more grows (set_waiting)
  int src_priority = 0;     // role priorities 0..7
  int dst_priority = 0;
  double reserved_share = 0.0;  // > 0: a reserved share of the link (class kCritical only)
  int route_priority = 0;       // 0..7
  TransferClass klass = TransferClass::kNormal;
  std::optional<double> deadline_s;  // on the scheduler's clock
};

enum class GrantReason : std::uint8_t { kStallGuard, kReserved, kDeadline, kRunning, kWrr, kPrefetch, kFifo };
[[nodiscard]] std::string_view grant_reason_name(GrantReason reason) noexcept;

struct Grant {
  std::uint64_t id = 0;
  std::uint64_t offset = 0;  // bytes granted to this transfer before this chunk
  std::uint64_t bytes = 0;
  GrantReason reason = GrantReason::kWrr;
  bool preempting = false;  // this grant took the link from a running transfer
  bool resumed = false;     // first grant of a transfer since it was preempted
  bool raised = false;      // the transfer is deadline-raised
  bool last = false;        // covers the transfer's last (estimated) bytes
  double waited_s = 0.0;    // since it asked for this chunk
};

enum class SchedulerEventKind : std::uint8_t { kPreempted, kResumed, kDeadlineRaised, kStallGuard };
[[nodiscard]] std::string_view scheduler_event_name(SchedulerEventKind kind) noexcept;

struct SchedulerEvent {
  SchedulerEventKind kind = SchedulerEventKind::kPreempted;
  std::uint64_t transfer = 0;
  std::uint64_t other = 0;  // kPreempted: the transfer that took the link; else 0
  double time_s = 0.0;
};

struct SchedulerStats {
  std::size_t queued = 0;   // submitted and not finished
  std::size_t waiting = 0;  // asking for a chunk now
  std::uint32_t inflight_chunks = 0;
  std::uint64_t inflight_bytes = 0;
  std::uint64_t grants = 0;
  std::uint64_t preemptions = 0;
  std::uint64_t resumes = 0;
  std::uint64_t deadline_raises = 0;
  std::uint64_t stall_guards = 0;
  std::uint64_t completed = 0;
  std::uint64_t aborted = 0;
  double wait_sum_s = 0.0;  // over grants: from asking to the grant
  double wait_max_s = 0.0;
  std::array<std::uint64_t, kTransferClasses> bytes_by_class{};  // indexed by TransferClass
  std::uint64_t link_bytes = 0;                                  // every byte granted
  std::uint64_t reserved_bytes = 0;                              // granted to transfers with a reserved share
  std::uint64_t bytes_while_reserved = 0;                        // granted while a reserved transfer had bytes left
  std::uint64_t events_dropped = 0;                              // events not drained before the buffer filled
};

// One chunk of step(), the simulation wrapper.
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
  // Out-of-range values are clamped (validate() says what is wrong with them).
  explicit LinkScheduler(SchedulerConfig config);

  // Queues a transfer, not yet asking. Fails on a duplicate id, zero bytes, a reserved share
  // outside [0, 1) or on a class other than critical, or reservations above max_reserved_share.
  [[nodiscard]] Status submit(const TransferSpec& spec, double now);
  // The transfer asks for its next chunk (its stream waits at a chunk boundary), or stops
  // asking. want_bytes: the chunk it will send (0: chunk_bytes, or what is left); a transfer
  // that asks past its submitted size grows. Unknown ids are ignored.
  void set_waiting(std::uint64_t id, bool waiting, double now, std::uint64_t want_bytes = 0) noexcept;
  // The next chunk to send, or nullopt when the window is full or nobody who asks may send.
  // Call again until nullopt: each grant is one chunk.
  [[nodiscard]] std::optional<Grant> grant(double now);
  // `bytes` more of the transfer's granted chunks were acknowledged by the receiver, which
  // frees their window slots. Unknown ids are ignored.
  void acknowledged(std::uint64_t id, std::uint64_t bytes) noexcept;
  // Removes a transfer (completed, or abandoned); its unacknowledged chunks leave the window.
  [[nodiscard]] Status finish(std::uint64_t id, bool completed);

  [[nodiscard]] SchedulerStats stats() const noexcept;
  // Events since the last drain, oldest first (bounded; stats().events_dropped counts the rest).
  [[nodiscard]] std::vector<SchedulerEvent> drain_events();
  // How much reserved share a new transfer could still be given.
  [[nodiscard]] double reserved_left() const noexcept;

  // Simulation: every transfer asks all the time and each chunk is acknowledged as soon as it
  // is sent. Sends the next chunk and advances the clock by chunk / link_bytes_per_s; nullopt
  // when nothing is queued.
  std::optional<ChunkEvent> step();
  // Moves the clock forward (never backwards); every call taking `now` does the same.
  void advance_to(double time_s) noexcept;

  [[nodiscard]] double now() const noexcept { return now_; }
  [[nodiscard]] std::size_t queued() const noexcept { return transfers_.size(); }
  [[nodiscard]] std::uint64_t preemptions() const noexcept { return stats_.preemptions; }
  [[nodiscard]] const SchedulerConfig& config() const noexcept { return config_; }
  // Current weight of a queued transfer; nullopt when it is not queued.
  [[nodiscard]] std::optional<double> urgency(std::uint64_t id) const noexcept;

 private:
  struct Active {
    TransferSpec spec;
    std::uint64_t seq = 0;  // submit order
    std::uint64_t granted = 0;
    std::uint64_t acked = 0;
    std::deque<std::uint64_t> unacked;  // end offsets of granted chunks not yet fully acknowledged
    bool waiting = false;
    double waiting_since = 0.0;
    std::uint64_t want = 0;
    // The aging term's queue delay: time spent asking while other transfers were granted.
    double passed_s = 0.0;
    double pass_mark = 0.0;  // when passed_s was last brought up to date
    std::uint64_t link_bytes_at_submit = 0;
    double credit = 0.0;  // smooth WRR state
    bool raised = false;
    bool preempted = false;  // lost the link: its next grant is a resume
  };

  [[nodiscard]] double weight(const Active& transfer) const noexcept;
  [[nodiscard]] bool eligible(const Active& transfer) const noexcept;
  [[nodiscard]] std::size_t index_of(std::uint64_t id) const noexcept;
  [[nodiscard]] std::size_t pick_wrr(bool prefetch) noexcept;
  [[nodiscard]] std::size_t pick_fifo() const noexcept;
  [[nodiscard]] bool slice_live() const noexcept;
  void refresh_raises();
  void emit(SchedulerEventKind kind, std::uint64_t transfer, std::uint64_t other);
  [[nodiscard]] Grant issue(std::size_t index, GrantReason reason, bool preempting);

  SchedulerConfig config_;
  std::vector<Active> transfers_;
  double now_ = 0.0;
  std::uint64_t next_seq_ = 0;
  std::optional<std::uint64_t> running_;
  // Transfers submitted from this seq on arrived after running_ took the link.
  std::uint64_t running_since_seq_ = 0;
  double slice_end_ = 0.0;
  std::uint32_t inflight_chunks_ = 0;
  std::uint64_t inflight_bytes_ = 0;
  SchedulerStats stats_;
  std::deque<SchedulerEvent> events_;
};

}  // namespace kvrelay::decision
