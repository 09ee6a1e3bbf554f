#pragma once

// The per-link queues of issue #27 (plan §2.1, slice S4): the peer plane's LinkGate, with one
// decision::LinkScheduler per peer on the real clock (steady_clock) behind one mutex. Each
// transfer's tag becomes a TransferSpec from the live policy: the role priorities of its route's
// from and to agents, the route's priority and deadline; spills go as normal class at priority
// 0, prefetches and probes as prefetch class. A chunk request waits until its link's scheduler
// grants it; acknowledgements and closes feed the scheduler and may grant others. Callbacks run
// outside the lock, on whichever thread caused the grant.
//
// With link_bytes_per_s > 0 a token bucket per link paces the grants (the NIC model of
// bench/sched_bench) and a pacer thread hands out grants as tokens refill; without it no thread
// is started. Everything it does is visible: kvrelay_link_* metrics, a bounded event ring and
// state_json() (the links' part of GET /admin/state).

#include <nlohmann/json.hpp>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "kvrelay/broker/decision_log.h"
#include "kvrelay/broker/policy_source.h"
#include "kvrelay/core/metrics.h"
#include "kvrelay/core/result.h"
#include "kvrelay/decision/link_scheduler.h"
#include "kvrelay/peer/link_gate.h"

namespace kvrelay::broker {

// The scheduler settings of the policy's scheduler section (mode off is the caller's business:
// no queues at all).
[[nodiscard]] decision::SchedulerConfig scheduler_config(const SchedulerPolicy& policy);

[[nodiscard]] std::string_view transfer_purpose_name(peer::TransferPurpose purpose) noexcept;

// The link queues' metric families (kvrelay_link_*), registered once per daemon.
struct LinkQueuesMetrics {
  explicit LinkQueuesMetrics(metrics::Registry& registry);
  metrics::Family<metrics::Gauge>& queue_depth;        // {peer}: open transfers
  metrics::Family<metrics::Histogram>& wait_seconds;   // {peer, purpose}: chunk request to grant
  metrics::Family<metrics::Counter>& preemptions;      // {peer}
  metrics::Family<metrics::Counter>& resumes;          // {peer}
  metrics::Family<metrics::Counter>& deadline_raises;  // {peer}
  metrics::Family<metrics::Counter>& stall_guards;     // {peer}
  metrics::Family<metrics::Counter>& bytes;            // {peer, class}: granted
  metrics::Family<metrics::Gauge>& reserved_share;     // {peer}: achieved, over recent grants
};

enum class LinkEventKind : std::uint8_t {
  kOpened,
  kPreempted,
  kResumed,
  kDeadlineRaised,
  kStallGuard,
  kCompleted,
  kAborted,
};
[[nodiscard]] std::string_view link_event_name(LinkEventKind kind) noexcept;

struct LinkEvent {
  std::uint64_t seq = 0;  // increasing by one per event: a gap means the ring dropped some
  LinkEventKind kind = LinkEventKind::kOpened;
  std::string peer;
  std::uint64_t transfer = 0;  // the ticket
  std::string route;
  peer::TransferPurpose purpose = peer::TransferPurpose::kFetchReply;
  std::uint64_t other = 0;  // kPreempted: the ticket that took the link
  double time_s = 0.0;      // seconds since the queues were created
};

struct LinkQueuesOptions {
  using Clock = std::function<std::chrono::steady_clock::time_point()>;
  Clock clock;               // empty: steady_clock::now (tests inject a fake one)
  bool pacer_thread = true;  // with link_bytes_per_s > 0; false: the caller calls pump()
  std::size_t event_capacity = 1024;
  DecisionLog* decision_log = nullptr;  // preemptions and deadline raises as {"kind":"schedule"}
  // The reserved share of a route's transfers (> 0: critical class); empty: the route's own
  // critical and reserved_share.
  std::function<double(const RoutePolicy&)> reserved_share;
};

class LinkQueues final : public peer::LinkGate {
 public:
  // Fails on a scheduler setting out of range (naming its /scheduler/... pointer); a link
  // window below 2 chunks is refused, since gated streams announce a window of 2 and the
  // receiver acknowledges every chunk only then. max_stall_s 0 becomes limits.read_timeout / 4,
  // so a receiver never times out a paused stream.
  [[nodiscard]] static Result<std::unique_ptr<LinkQueues>> create(std::shared_ptr<PolicySource> policy,
                                                                  decision::SchedulerConfig config,
                                                                  metrics::Registry& registry,
                                                                  LinkQueuesOptions options = {});
  ~LinkQueues() override;
  LinkQueues(const LinkQueues&) = delete;
  LinkQueues& operator=(const LinkQueues&) = delete;

  // 0 (ungated) when the tag names no peer. The transfer's spec comes from the policy now.
  std::uint64_t open(const peer::TransferTag& tag) override;
  // A ticket the queues do not know (0, closed) is granted at once: the gate never holds a
  // stream it cannot schedule.
  void request(std::uint64_t ticket, std::uint64_t bytes, std::function<void()> granted) override;
  void acknowledged(std::uint64_t ticket, std::uint64_t bytes) override;
  void close(std::uint64_t ticket, bool completed) override;
  [[nodiscard]] std::uint32_t chunk_bytes() const override;

  // Refills the pacing tokens and grants what they allow (the pacer thread calls it).
  void pump();

  // The spec a tag maps to under `policy`, at `now_s` on the queues' clock (for the tests).
  [[nodiscard]] decision::TransferSpec spec_for(const peer::TransferTag& tag, const Policy& policy, std::uint64_t id,
                                                double now_s) const;
  // The most recent `limit` events, oldest first.
  [[nodiscard]] std::vector<LinkEvent> events(std::size_t limit) const;
  [[nodiscard]] std::optional<decision::SchedulerStats> link_stats(const std::string& peer) const;
  // Bytes per second granted toward `peer` since the previous call for it (since the link opened
  // on the first); 0 for a link never used. Summaries to that peer report it (NodeState).
  [[nodiscard]] std::uint64_t sent_bytes_per_s(const std::string& peer);
  // {"scheduler": settings, "links": {peer: stats}, "events": [the last `events`], "events_dropped"}.
  [[nodiscard]] nlohmann::json state_json(std::size_t events = 64) const;
  [[nodiscard]] const decision::SchedulerConfig& config() const noexcept { return config_; }

 private:
  using Callbacks = std::vector<std::function<void()>>;
  struct Link;
  struct Ticket {
    std::string peer;
    std::string route;
    peer::TransferPurpose purpose = peer::TransferPurpose::kFetchReply;
    decision::TransferClass klass = decision::TransferClass::kNormal;
    bool reserved = false;
    std::deque<std::pair<std::uint64_t, std::function<void()>>> pending;  // bytes, callback
  };

  LinkQueues(std::shared_ptr<PolicySource> policy, decision::SchedulerConfig config, metrics::Registry& registry,
             LinkQueuesOptions options);
  [[nodiscard]] double now_s() const;
  Link& link_for(const std::string& peer);
  void drain(Link& link, double now, Callbacks& ready);
  void record(LinkEventKind kind, const std::string& peer, std::uint64_t transfer, std::uint64_t other, double now);
  void note_reserved(Link& link, std::uint64_t bytes, bool to_reserved);
  void run_pacer();

  std::shared_ptr<PolicySource> policy_;
  decision::SchedulerConfig config_;
  LinkQueuesOptions options_;
  LinkQueuesMetrics metrics_;
  std::chrono::steady_clock::time_point origin_;
  bool pacing_ = false;
  double burst_bytes_ = 0.0;

  mutable std::mutex mutex_;
  std::map<std::string, std::unique_ptr<Link>> links_;
  std::unordered_map<std::uint64_t, Ticket> tickets_;
  std::uint64_t next_ticket_ = 1;
  std::deque<LinkEvent> events_;
  std::uint64_t next_seq_ = 1;
  std::uint64_t events_dropped_ = 0;

  std::condition_variable pacer_wake_;
  bool stopping_ = false;
  std::thread pacer_;
};

}  // namespace kvrelay::broker
