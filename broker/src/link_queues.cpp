#include "kvrelay/broker/link_queues.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <limits>

namespace kvrelay::broker {

namespace {

constexpr std::array kAllPurposes = {peer::TransferPurpose::kFetchReply, peer::TransferPurpose::kPush,
                                     peer::TransferPurpose::kPrefetch, peer::TransferPurpose::kSpill,
                                     peer::TransferPurpose::kProbe};
constexpr std::array kAllClasses = {decision::TransferClass::kCritical, decision::TransferClass::kNormal,
                                    decision::TransferClass::kPrefetch};
// Grants the achieved reserved share is measured over (those made while a reservation had work).
constexpr std::size_t kReservedShareWindow = 256;
// The pacer never sleeps less than this: below it, waking costs more than the precision buys.
constexpr double kPacerMinSleepS = 50e-6;

int agent_role_priority(const Policy& policy, const std::string& agent_id) {
  const AgentPolicy* agent = policy.find_agent(agent_id);
  return agent == nullptr ? 0 : std::clamp(agent->role_priority, 0, 7);
}

LinkEventKind link_event_of(decision::SchedulerEventKind kind) {
  switch (kind) {
    case decision::SchedulerEventKind::kPreempted:
      return LinkEventKind::kPreempted;
    case decision::SchedulerEventKind::kResumed:
      return LinkEventKind::kResumed;
    case decision::SchedulerEventKind::kDeadlineRaised:
      return LinkEventKind::kDeadlineRaised;
    case decision::SchedulerEventKind::kStallGuard:
      return LinkEventKind::kStallGuard;
  }
  return LinkEventKind::kStallGuard;
}

std::string_view scheduler_mode_name(decision::SchedulerMode mode) {
  return mode == decision::SchedulerMode::kFifo ? "fifo" : "wrr";
}

}  // namespace

decision::SchedulerConfig scheduler_config(const SchedulerPolicy& policy) {
  decision::SchedulerConfig config;
  config.mode = policy.mode == SchedulerMode::kFifo ? decision::SchedulerMode::kFifo : decision::SchedulerMode::kWrr;
  config.time_slice_s = std::chrono::duration<double>(policy.time_slice).count();
  config.chunk_bytes = policy.chunk_bytes;
  config.window_chunks = policy.window_chunks;
  config.base = policy.base;
  config.alpha = policy.alpha;
  config.beta = policy.beta;
  config.preempt_factor = policy.preempt_factor;
  config.preempt_max_done = policy.preempt_max_done;
  config.max_reserved_share = policy.max_reserved_share;
  // 0: no pacing, and the scheduler takes an unknown link's rate for deadline raising.
  config.link_bytes_per_s = policy.link_bytes_per_s;
  config.max_stall_s = std::chrono::duration<double>(policy.max_stall).count();
  return config;
}

std::string_view transfer_purpose_name(peer::TransferPurpose purpose) noexcept {
  switch (purpose) {
    case peer::TransferPurpose::kFetchReply:
      return "fetch_reply";
    case peer::TransferPurpose::kPush:
      return "push";
    case peer::TransferPurpose::kPrefetch:
      return "prefetch";
    case peer::TransferPurpose::kSpill:
      return "spill";
    case peer::TransferPurpose::kProbe:
      return "probe";
  }
  return "unknown";
}

std::string_view link_event_name(LinkEventKind kind) noexcept {
  switch (kind) {
    case LinkEventKind::kOpened:
      return "opened";
    case LinkEventKind::kPreempted:
      return "preempted";
    case LinkEventKind::kResumed:
      return "resumed";
    case LinkEventKind::kDeadlineRaised:
      return "deadline_raised";
    case LinkEventKind::kStallGuard:
      return "stall_guard";
    case LinkEventKind::kCompleted:
      return "completed";
    case LinkEventKind::kAborted:
      return "aborted";
  }
  return "unknown";
}

LinkQueuesMetrics::LinkQueuesMetrics(metrics::Registry& registry)
    : queue_depth(registry.gauge("kvrelay_link_queue_depth", "Transfers open on the link to a peer", {"peer"})),
      wait_seconds(registry.histogram("kvrelay_link_wait_seconds",
                                      "Time a chunk waited for the link scheduler's grant, by peer and purpose",
                                      {"peer", "purpose"}, metrics::latency_buckets_seconds())),
      preemptions(registry.counter("kvrelay_link_preemptions_total",
                                   "Transfers preempted at a chunk boundary on the link to a peer", {"peer"})),
      resumes(registry.counter("kvrelay_link_resumes_total",
                               "Preempted transfers that resumed at their next chunk, per peer", {"peer"})),
      deadline_raises(registry.counter("kvrelay_link_deadline_raises_total",
                                       "Transfers raised to the top class to meet their deadline, per peer", {"peer"})),
      stall_guards(registry.counter("kvrelay_link_stall_guards_total",
                                    "Grants given to a transfer that had waited max_stall_ms, per peer", {"peer"})),
      bytes(registry.counter("kvrelay_link_bytes_total",
                             "Bytes granted on the link to a peer, by class (critical, normal, prefetch)",
                             {"peer", "class"})),
      reserved_share(registry.gauge("kvrelay_link_reserved_share",
                                    "Share of the link reserved transfers got over the recent grants made while "
                                    "one had work, per peer",
                                    {"peer"})) {}

struct LinkQueues::Link {
  Link(const decision::SchedulerConfig& config, LinkQueuesMetrics& m, const std::string& peer)
      : scheduler(config),
        depth(m.queue_depth.with({peer})),
        preemptions(m.preemptions.with({peer})),
        resumes(m.resumes.with({peer})),
        raises(m.deadline_raises.with({peer})),
        stalls(m.stall_guards.with({peer})),
        reserved_share(m.reserved_share.with({peer})) {
    for (const auto klass : kAllClasses) {
      bytes[static_cast<std::size_t>(klass)] = &m.bytes.with({peer, decision::transfer_class_name(klass)});
    }
    for (const auto purpose : kAllPurposes) {
      wait[static_cast<std::size_t>(purpose)] = &m.wait_seconds.with({peer, transfer_purpose_name(purpose)});
    }
  }

  decision::LinkScheduler scheduler;
  metrics::Gauge& depth;
  metrics::Counter& preemptions;
  metrics::Counter& resumes;
  metrics::Counter& raises;
  metrics::Counter& stalls;
  metrics::Gauge& reserved_share;
  std::array<metrics::Counter*, decision::kTransferClasses> bytes{};
  std::array<metrics::Histogram*, kAllPurposes.size()> wait{};
  // sent_bytes_per_s's last reading: the link's granted bytes and when.
  std::uint64_t rate_mark_bytes = 0;
  double rate_mark_s = 0.0;
  // Pacing: a token bucket that may go into debt by one grant, so a chunk larger than the
  // bucket still goes; over any interval the link carries at most burst + rate * t + one chunk.
  double tokens = 0.0;
  double refilled_s = 0.0;
  bool throttled = false;  // the bucket, not the window or the scheduler, holds a waiting chunk
  // Recent grants made while a reservation had work: (bytes, to a reserved transfer).
  std::deque<std::pair<std::uint64_t, bool>> recent;
  std::uint64_t recent_bytes = 0;
  std::uint64_t recent_reserved = 0;
};

Result<std::unique_ptr<LinkQueues>> LinkQueues::create(std::shared_ptr<PolicySource> policy,
                                                       decision::SchedulerConfig config, metrics::Registry& registry,
                                                       LinkQueuesOptions options) {
  if (!policy) return fail(ErrorCode::kInvalidArgument, "link queues need a policy");
  KVRELAY_TRY(decision::validate(config));
  if (config.chunk_bytes > std::numeric_limits<std::uint32_t>::max()) {
    return fail(ErrorCode::kInvalidArgument, "/scheduler/chunk_bytes: expected at most 4294967295");
  }
  if (config.max_stall_s <= 0.0) {
    config.max_stall_s = std::chrono::duration<double>(policy->current()->limits.read_timeout).count() / 4.0;
  }
  return std::unique_ptr<LinkQueues>(new LinkQueues(std::move(policy), config, registry, std::move(options)));
}

LinkQueues::LinkQueues(std::shared_ptr<PolicySource> policy, decision::SchedulerConfig config,
                       metrics::Registry& registry, LinkQueuesOptions options)
    : policy_(std::move(policy)), config_(config), options_(std::move(options)), metrics_(registry) {
  if (!options_.clock) options_.clock = [] { return std::chrono::steady_clock::now(); };
  options_.event_capacity = std::max<std::size_t>(options_.event_capacity, 1);
  origin_ = options_.clock();
  pacing_ = config_.link_bytes_per_s > 0.0;
  // Room for two chunks, or 2 ms at the link's rate if that is more (the pacer wakes that often).
  burst_bytes_ = std::max(2.0 * static_cast<double>(config_.chunk_bytes), config_.link_bytes_per_s * 0.002);
  if (pacing_ && options_.pacer_thread) pacer_ = std::thread([this] { run_pacer(); });
}

LinkQueues::~LinkQueues() {
  {
    const std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  pacer_wake_.notify_all();
  if (pacer_.joinable()) pacer_.join();
}

double LinkQueues::now_s() const {
  return std::chrono::duration<double>(options_.clock() - origin_).count();
}

std::uint32_t LinkQueues::chunk_bytes() const {
  return static_cast<std::uint32_t>(config_.chunk_bytes);
}

LinkQueues::Link& LinkQueues::link_for(const std::string& peer) {
  auto& link = links_[peer];
  if (!link) {
    link = std::make_unique<Link>(config_, metrics_, peer);
    link->tokens = burst_bytes_;
    link->refilled_s = now_s();
  }
  return *link;
}

decision::TransferSpec LinkQueues::spec_for(const peer::TransferTag& tag, const Policy& policy, std::uint64_t id,
                                            double now_s) const {
  decision::TransferSpec spec;
  spec.id = id;
  spec.bytes = std::max<std::uint64_t>(tag.bytes, 1);  // unknown sizes grow as the stream asks
  const RoutePolicy* route = policy.find_route(tag.route);
  const bool background =
      tag.purpose == peer::TransferPurpose::kPrefetch || tag.purpose == peer::TransferPurpose::kProbe;
  spec.klass = background ? decision::TransferClass::kPrefetch : decision::TransferClass::kNormal;
  // Spills and probes serve no route's handoff: priority 0. Prefetches keep their route's
  // priorities, which order them among themselves.
  const bool prioritised = route != nullptr && (tag.purpose == peer::TransferPurpose::kFetchReply ||
                                                tag.purpose == peer::TransferPurpose::kPush ||
                                                tag.purpose == peer::TransferPurpose::kPrefetch);
  if (prioritised) {
    spec.src_priority = agent_role_priority(policy, route->from_agent);
    spec.dst_priority = agent_role_priority(policy, route->to_agent);
    spec.route_priority = std::clamp(route->priority, 0, 7);
  }
  if (background) return spec;  // a deadline would raise it above everything: background has none
  if (tag.deadline) {
    spec.deadline_s = std::chrono::duration<double>(*tag.deadline - origin_).count();
  } else if (prioritised && route->deadline) {
    spec.deadline_s = now_s + std::chrono::duration<double>(*route->deadline).count();
  }
  if (prioritised) {
    // A critical route's reserved share (routes[].critical, reserved_share), unless the options
    // say otherwise.
    const double share =
        options_.reserved_share ? options_.reserved_share(*route) : (route->critical ? route->reserved_share : 0.0);
    if (share > 0.0) {
      spec.klass = decision::TransferClass::kCritical;
      spec.reserved_share = std::min(share, decision::kMaxReservedShare);
    }
  }
  return spec;
}

std::uint64_t LinkQueues::open(const peer::TransferTag& tag) {
  if (tag.peer.empty()) return 0;
  const std::shared_ptr<const Policy> policy = policy_->current();
  Callbacks ready;
  std::uint64_t ticket = 0;
  {
    const std::lock_guard lock(mutex_);
    const double now = now_s();
    ticket = next_ticket_++;
    decision::TransferSpec spec = spec_for(tag, *policy, ticket, now);
    Link& link = link_for(tag.peer);
    // Reservations beyond max_reserved_share are cut to what is left; the transfer still goes.
    spec.reserved_share = std::min(spec.reserved_share, link.scheduler.reserved_left());
    if (auto submitted = link.scheduler.submit(spec, now); !submitted) {
      spdlog::warn("link queues: transfer to {} on route '{}' goes unscheduled: {}", tag.peer, tag.route,
                   submitted.error().message);
      return 0;
    }
    tickets_.emplace(ticket, Ticket{tag.peer, tag.route, tag.purpose, spec.klass, spec.reserved_share > 0.0, {}});
    record(LinkEventKind::kOpened, tag.peer, ticket, 0, now);
    drain(link, now, ready);
  }
  for (auto& callback : ready)
    callback();
  return ticket;
}

void LinkQueues::request(std::uint64_t ticket, std::uint64_t bytes, std::function<void()> granted) {
  Callbacks ready;
  {
    const std::lock_guard lock(mutex_);
    const auto it = tickets_.find(ticket);
    if (it == tickets_.end()) {
      ready.push_back(std::move(granted));
    } else {
      const double now = now_s();
      Ticket& t = it->second;
      t.pending.emplace_back(bytes, std::move(granted));
      Link& link = link_for(t.peer);
      if (t.pending.size() == 1) link.scheduler.set_waiting(ticket, true, now, bytes);
      drain(link, now, ready);
    }
  }
  for (auto& callback : ready)
    callback();
}

void LinkQueues::acknowledged(std::uint64_t ticket, std::uint64_t bytes) {
  Callbacks ready;
  {
    const std::lock_guard lock(mutex_);
    const auto it = tickets_.find(ticket);
    if (it == tickets_.end()) return;
    Link& link = link_for(it->second.peer);
    link.scheduler.acknowledged(ticket, bytes);
    drain(link, now_s(), ready);
  }
  for (auto& callback : ready)
    callback();
}

void LinkQueues::close(std::uint64_t ticket, bool completed) {
  Callbacks ready;
  Ticket closed;  // its dropped callbacks are destroyed outside the lock
  {
    const std::lock_guard lock(mutex_);
    const auto it = tickets_.find(ticket);
    if (it == tickets_.end()) return;
    const double now = now_s();
    Link& link = link_for(it->second.peer);
    (void)link.scheduler.finish(ticket, completed);  // known ticket: always queued
    record(completed ? LinkEventKind::kCompleted : LinkEventKind::kAborted, it->second.peer, ticket, 0, now);
    closed = std::move(it->second);
    tickets_.erase(it);
    drain(link, now, ready);
  }
  for (auto& callback : ready)
    callback();
}

void LinkQueues::pump() {
  Callbacks ready;
  {
    const std::lock_guard lock(mutex_);
    const double now = now_s();
    for (auto& [peer, link] : links_)
      drain(*link, now, ready);
  }
  for (auto& callback : ready)
    callback();
}

void LinkQueues::drain(Link& link, double now, Callbacks& ready) {
  if (pacing_) {
    link.tokens = std::min(burst_bytes_, link.tokens + (now - link.refilled_s) * config_.link_bytes_per_s);
    link.refilled_s = now;
  }
  link.throttled = false;
  while (true) {
    if (pacing_ && link.tokens <= 0.0) {
      link.throttled = link.scheduler.stats().waiting > 0;
      break;
    }
    const std::uint64_t while_reserved = link.scheduler.stats().bytes_while_reserved;
    const auto grant = link.scheduler.grant(now);
    if (!grant) break;
    const auto it = tickets_.find(grant->id);
    if (it == tickets_.end() || it->second.pending.empty()) continue;  // not reached: only asking tickets are granted
    Ticket& t = it->second;
    ready.push_back(std::move(t.pending.front().second));
    t.pending.pop_front();
    if (!t.pending.empty()) link.scheduler.set_waiting(grant->id, true, now, t.pending.front().first);
    if (pacing_) link.tokens -= static_cast<double>(grant->bytes);
    link.wait[static_cast<std::size_t>(t.purpose)]->observe(grant->waited_s);
    link.bytes[static_cast<std::size_t>(t.klass)]->inc(static_cast<double>(grant->bytes));
    if (link.scheduler.stats().bytes_while_reserved > while_reserved) note_reserved(link, grant->bytes, t.reserved);
  }
  // Preemptions, resumes, raises and stall guards: the ring, the metrics and the decision log.
  for (const auto& event : link.scheduler.drain_events()) {
    const LinkEventKind kind = link_event_of(event.kind);
    const auto it = tickets_.find(event.transfer);
    if (it == tickets_.end()) continue;
    record(kind, it->second.peer, event.transfer, event.other, now);
    switch (kind) {
      case LinkEventKind::kPreempted:
        link.preemptions.inc();
        break;
      case LinkEventKind::kResumed:
        link.resumes.inc();
        break;
      case LinkEventKind::kDeadlineRaised:
        link.raises.inc();
        break;
      case LinkEventKind::kStallGuard:
        link.stalls.inc();
        break;
      default:
        break;
    }
  }
  link.depth.set(static_cast<double>(link.scheduler.queued()));
  if (link.throttled) pacer_wake_.notify_one();
}

void LinkQueues::note_reserved(Link& link, std::uint64_t bytes, bool to_reserved) {
  link.recent.emplace_back(bytes, to_reserved);
  link.recent_bytes += bytes;
  link.recent_reserved += to_reserved ? bytes : 0;
  if (link.recent.size() > kReservedShareWindow) {
    const auto [old_bytes, old_reserved] = link.recent.front();
    link.recent.pop_front();
    link.recent_bytes -= old_bytes;
    link.recent_reserved -= old_reserved ? old_bytes : 0;
  }
  link.reserved_share.set(link.recent_bytes == 0
                              ? 0.0
                              : static_cast<double>(link.recent_reserved) / static_cast<double>(link.recent_bytes));
}

void LinkQueues::record(LinkEventKind kind, const std::string& peer, std::uint64_t transfer, std::uint64_t other,
                        double now) {
  LinkEvent event;
  event.seq = next_seq_++;
  event.kind = kind;
  event.peer = peer;
  event.transfer = transfer;
  event.other = other;
  event.time_s = now;
  if (const auto it = tickets_.find(transfer); it != tickets_.end()) {
    event.route = it->second.route;
    event.purpose = it->second.purpose;
  }
  if (options_.decision_log != nullptr &&
      (kind == LinkEventKind::kPreempted || kind == LinkEventKind::kDeadlineRaised)) {
    nlohmann::json entry = {{"kind", "schedule"},   {"event", link_event_name(kind)},
                            {"peer", peer},         {"transfer", transfer},
                            {"route", event.route}, {"purpose", transfer_purpose_name(event.purpose)}};
    if (kind == LinkEventKind::kPreempted) entry["by"] = other;
    options_.decision_log->record(std::move(entry));
  }
  if (events_.size() >= options_.event_capacity) {
    events_.pop_front();
    ++events_dropped_;
  }
  events_.push_back(std::move(event));
}

void LinkQueues::run_pacer() {
  std::unique_lock lock(mutex_);
  while (!stopping_) {
    // Sleep until the most indebted throttled link's bucket is back above zero.
    double sleep_s = -1.0;
    const double now = now_s();
    for (const auto& [peer, link] : links_) {
      if (!link->throttled) continue;
      const double tokens = link->tokens + (now - link->refilled_s) * config_.link_bytes_per_s;
      const double need_s = std::max(kPacerMinSleepS, (1.0 - tokens) / config_.link_bytes_per_s);
      sleep_s = sleep_s < 0.0 ? need_s : std::min(sleep_s, need_s);
    }
    if (sleep_s < 0.0) {
      pacer_wake_.wait(lock);
    } else {
      pacer_wake_.wait_for(lock, std::chrono::duration<double>(sleep_s));
    }
    if (stopping_) break;
    Callbacks ready;
    const double then = now_s();
    for (auto& [peer, link] : links_) {
      if (link->throttled) drain(*link, then, ready);
    }
    if (ready.empty()) continue;
    lock.unlock();
    for (auto& callback : ready)
      callback();
    ready.clear();
    lock.lock();
  }
}

std::vector<LinkEvent> LinkQueues::events(std::size_t limit) const {
  const std::lock_guard lock(mutex_);
  const std::size_t n = std::min(limit, events_.size());
  return {events_.end() - static_cast<std::ptrdiff_t>(n), events_.end()};
}

std::optional<decision::SchedulerStats> LinkQueues::link_stats(const std::string& peer) const {
  const std::lock_guard lock(mutex_);
  const auto it = links_.find(peer);
  if (it == links_.end()) return std::nullopt;
  return it->second->scheduler.stats();
}

std::uint64_t LinkQueues::sent_bytes_per_s(const std::string& peer) {
  const std::lock_guard lock(mutex_);
  const auto it = links_.find(peer);
  if (it == links_.end()) return 0;
  Link& link = *it->second;
  const double now = now_s();
  const std::uint64_t bytes = link.scheduler.stats().link_bytes;
  const double elapsed = now - link.rate_mark_s;
  const std::uint64_t sent = bytes - link.rate_mark_bytes;
  link.rate_mark_bytes = bytes;
  link.rate_mark_s = now;
  return elapsed > 0.0 ? static_cast<std::uint64_t>(static_cast<double>(sent) / elapsed) : 0;
}

nlohmann::json LinkQueues::state_json(std::size_t events) const {
  using nlohmann::json;
  const std::lock_guard lock(mutex_);
  json out;
  out["scheduler"] = {{"mode", scheduler_mode_name(config_.mode)},
                      {"time_slice_ms", config_.time_slice_s * 1e3},
                      {"chunk_bytes", config_.chunk_bytes},
                      {"window_chunks", config_.window_chunks},
                      {"preempt_factor", config_.preempt_factor},
                      {"preempt_max_done", config_.preempt_max_done},
                      {"max_reserved_share", config_.max_reserved_share},
                      {"link_bytes_per_s", config_.link_bytes_per_s},
                      {"max_stall_ms", config_.max_stall_s * 1e3}};
  json links = json::object();
  for (const auto& [peer, link] : links_) {
    const auto s = link->scheduler.stats();
    json bytes = json::object();
    for (const auto klass : kAllClasses) {
      bytes[std::string(decision::transfer_class_name(klass))] = s.bytes_by_class[static_cast<std::size_t>(klass)];
    }
    links[peer] = {{"queue_depth", s.queued},
                   {"waiting", s.waiting},
                   {"inflight_chunks", s.inflight_chunks},
                   {"inflight_bytes", s.inflight_bytes},
                   {"grants", s.grants},
                   {"preemptions", s.preemptions},
                   {"resumes", s.resumes},
                   {"deadline_raises", s.deadline_raises},
                   {"stall_guards", s.stall_guards},
                   {"completed", s.completed},
                   {"aborted", s.aborted},
                   {"wait_mean_ms", s.grants == 0 ? 0.0 : s.wait_sum_s / static_cast<double>(s.grants) * 1e3},
                   {"wait_max_ms", s.wait_max_s * 1e3},
                   {"bytes", std::move(bytes)},
                   {"reserved_bytes", s.reserved_bytes},
                   {"bytes_while_reserved", s.bytes_while_reserved},
                   {"reserved_share_achieved", link->reserved_share.value()}};
  }
  out["links"] = std::move(links);
  json ring = json::array();
  const std::size_t n = std::min(events, events_.size());
  for (auto it = events_.end() - static_cast<std::ptrdiff_t>(n); it != events_.end(); ++it) {
    json e = {{"seq", it->seq},      {"kind", link_event_name(it->kind)},
              {"peer", it->peer},    {"transfer", it->transfer},
              {"route", it->route},  {"purpose", transfer_purpose_name(it->purpose)},
              {"time_s", it->time_s}};
    if (it->kind == LinkEventKind::kPreempted) e["by"] = it->other;
    ring.push_back(std::move(e));
  }
  out["events"] = std::move(ring);
  out["events_dropped"] = events_dropped_;
  return out;
}

}  // namespace kvrelay::broker
