#include "kvrelay/decision/link_scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace kvrelay::decision {

namespace {
constexpr std::size_t kNoTransfer = std::numeric_limits<std::size_t>::max();
// Slices end on sums of chunk durations: a slice of 4 x 1 ms must end after the fourth chunk.
constexpr double kSliceEpsilonS = 1e-9;
constexpr std::size_t kMaxSchedulerEvents = 4096;
// What an unknown link (link_bytes_per_s 0) is taken to carry: 1 Gbit/s.
constexpr double kUnknownLinkBytesPerS = 1.25e8;

std::size_t class_index(TransferClass klass) noexcept {
  return static_cast<std::size_t>(klass);
}
}  // namespace

std::string_view transfer_class_name(TransferClass klass) noexcept {
  switch (klass) {
    case TransferClass::kCritical:
      return "critical";
    case TransferClass::kNormal:
      return "normal";
    case TransferClass::kPrefetch:
      return "prefetch";
  }
  return "unknown";
}

std::string_view grant_reason_name(GrantReason reason) noexcept {
  switch (reason) {
    case GrantReason::kStallGuard:
      return "stall_guard";
    case GrantReason::kReserved:
      return "reserved";
    case GrantReason::kDeadline:
      return "deadline";
    case GrantReason::kRunning:
      return "running";
    case GrantReason::kWrr:
      return "wrr";
    case GrantReason::kPrefetch:
      return "prefetch";
    case GrantReason::kFifo:
      return "fifo";
  }
  return "unknown";
}

std::string_view scheduler_event_name(SchedulerEventKind kind) noexcept {
  switch (kind) {
    case SchedulerEventKind::kPreempted:
      return "preempted";
    case SchedulerEventKind::kResumed:
      return "resumed";
    case SchedulerEventKind::kDeadlineRaised:
      return "deadline_raised";
    case SchedulerEventKind::kStallGuard:
      return "stall_guard";
  }
  return "unknown";
}

Status validate(const SchedulerConfig& config) {
  std::string problems;
  const auto expect = [&problems](bool good, std::string_view pointer, std::string_view range, double value) {
    if (good) return;
    if (!problems.empty()) problems += '\n';
    problems +=
        "/scheduler/" + std::string(pointer) + ": expected " + std::string(range) + ", got " + std::to_string(value);
  };
  const double slice_ms = config.time_slice_s * 1e3;
  expect(slice_ms >= 5.0 - 1e-9 && slice_ms <= 20.0 + 1e-9, "time_slice_ms", "5..20", slice_ms);
  expect(config.chunk_bytes >= 1024 && config.chunk_bytes <= (64ULL << 20), "chunk_bytes", "1024..67108864",
         static_cast<double>(config.chunk_bytes));
  expect(config.window_chunks >= 2 && config.window_chunks <= 1024, "window_chunks", "2..1024",
         static_cast<double>(config.window_chunks));
  expect(config.base >= 0.0, "base", ">= 0", config.base);
  expect(config.alpha >= 0.0, "alpha", ">= 0", config.alpha);
  expect(config.beta >= 0.0, "beta", ">= 0", config.beta);
  expect(config.max_exponent > 0.0 && config.max_exponent <= 700.0, "max_exponent", "(0, 700]", config.max_exponent);
  expect(config.preempt_factor >= 1.0, "preempt_factor", ">= 1", config.preempt_factor);
  expect(config.preempt_max_done >= 0.0 && config.preempt_max_done <= 1.0, "preempt_max_done", "0..1",
         config.preempt_max_done);
  expect(config.max_reserved_share >= 0.0 && config.max_reserved_share <= kMaxReservedShare, "max_reserved_share",
         "0..0.9", config.max_reserved_share);
  expect(config.link_bytes_per_s >= 0.0 && std::isfinite(config.link_bytes_per_s), "link_bytes_per_s", ">= 0",
         config.link_bytes_per_s);
  expect(config.max_stall_s >= 0.0 && std::isfinite(config.max_stall_s), "max_stall_ms", ">= 0",
         config.max_stall_s * 1e3);
  if (!problems.empty()) return fail(ErrorCode::kInvalidArgument, problems);
  return ok();
}

LinkScheduler::LinkScheduler(SchedulerConfig config) : config_(config) {
  config_.chunk_bytes = std::max<std::uint64_t>(config_.chunk_bytes, 1);
  config_.window_chunks = std::max<std::uint32_t>(config_.window_chunks, 1);
  if (!(config_.time_slice_s > 0.0)) config_.time_slice_s = SchedulerConfig{}.time_slice_s;
  if (!(config_.link_bytes_per_s > 0.0) || !std::isfinite(config_.link_bytes_per_s)) {
    config_.link_bytes_per_s = kUnknownLinkBytesPerS;
  }
  config_.max_reserved_share = std::clamp(config_.max_reserved_share, 0.0, kMaxReservedShare);
  if (!(config_.max_stall_s > 0.0)) config_.max_stall_s = 0.0;
}

Status LinkScheduler::submit(const TransferSpec& spec, double now) {
  advance_to(now);
  const std::string name = "transfer " + std::to_string(spec.id);
  if (spec.bytes == 0) return fail(ErrorCode::kInvalidArgument, name + " has no bytes");
  if (index_of(spec.id) != kNoTransfer) return fail(ErrorCode::kAlreadyExists, name + " already queued");
  if (!(spec.reserved_share >= 0.0) || spec.reserved_share >= 1.0) {
    return fail(ErrorCode::kInvalidArgument, name + ": reserved share must be in [0, 1)");
  }
  if (spec.reserved_share > 0.0 && spec.klass != TransferClass::kCritical) {
    return fail(ErrorCode::kInvalidArgument, name + ": only critical transfers have a reserved share");
  }
  if (spec.deadline_s && !std::isfinite(*spec.deadline_s)) {
    return fail(ErrorCode::kInvalidArgument, name + ": deadline is not a finite time");
  }
  if (spec.reserved_share > reserved_left() + 1e-12) {
    return fail(ErrorCode::kResourceExhausted, name + ": reservations would exceed max_reserved_share (" +
                                                   std::to_string(config_.max_reserved_share) + ") of the link");
  }
  Active active;
  active.spec = spec;
  active.seq = next_seq_++;
  active.link_bytes_at_submit = stats_.link_bytes;
  transfers_.push_back(std::move(active));
  refresh_raises();
  return ok();
}

void LinkScheduler::set_waiting(std::uint64_t id, bool waiting, double now, std::uint64_t want_bytes) noexcept {
  advance_to(now);
  const std::size_t index = index_of(id);
  if (index == kNoTransfer) return;
  Active& t = transfers_[index];
  if (waiting && !t.waiting) {
    t.waiting = true;
    t.waiting_since = now_;
    t.pass_mark = now_;
  } else if (!waiting && t.waiting) {
    t.waiting = false;
  }
  t.want = waiting ? want_bytes : 0;
}

void LinkScheduler::acknowledged(std::uint64_t id, std::uint64_t bytes) noexcept {
  const std::size_t index = index_of(id);
  if (index == kNoTransfer) return;
  Active& t = transfers_[index];
  const std::uint64_t acked = std::min(t.granted, t.acked + std::min(bytes, t.granted));
  inflight_bytes_ -= acked - t.acked;
  t.acked = acked;
  while (!t.unacked.empty() && t.unacked.front() <= t.acked) {
    t.unacked.pop_front();
    --inflight_chunks_;
  }
}

Status LinkScheduler::finish(std::uint64_t id, bool completed) {
  const std::size_t index = index_of(id);
  if (index == kNoTransfer) return fail(ErrorCode::kNotFound, "transfer " + std::to_string(id) + " is not queued");
  const Active& t = transfers_[index];
  inflight_chunks_ -= static_cast<std::uint32_t>(t.unacked.size());
  inflight_bytes_ -= t.granted - t.acked;
  if (running_ == id) running_.reset();
  // Smooth WRR keeps its pool's credits summing to zero. A short transfer leaves in debt (it was
  // served and paid); left with the others, that debt became their surplus, so long-lived bulk
  // transfers grew rich enough to outbid newly arrived urgent ones. Its credit is spread back.
  const bool prefetch_pool = t.spec.klass == TransferClass::kPrefetch;
  std::size_t others = 0;
  for (const Active& other : transfers_)
    if (other.spec.id != id && (other.spec.klass == TransferClass::kPrefetch) == prefetch_pool) ++others;
  if (others > 0) {
    const double share = t.credit / static_cast<double>(others);
    for (Active& other : transfers_)
      if (other.spec.id != id && (other.spec.klass == TransferClass::kPrefetch) == prefetch_pool) other.credit += share;
  }
  transfers_.erase(transfers_.begin() + static_cast<std::ptrdiff_t>(index));
  ++(completed ? stats_.completed : stats_.aborted);
  return ok();
}

void LinkScheduler::advance_to(double time_s) noexcept {
  if (time_s > now_) now_ = time_s;
}

double LinkScheduler::weight(const Active& t) const noexcept {
  const double delay = t.passed_s;
  const double exponent = std::min(config_.beta * delay, config_.max_exponent);
  return static_cast<double>(t.spec.src_priority + t.spec.dst_priority + t.spec.route_priority) + config_.base +
         config_.alpha * std::exp(exponent);
}

bool LinkScheduler::eligible(const Active& t) const noexcept {
  return t.waiting && (t.want > 0 || t.granted < t.spec.bytes);
}

std::optional<double> LinkScheduler::urgency(std::uint64_t id) const noexcept {
  const std::size_t index = index_of(id);
  if (index == kNoTransfer) return std::nullopt;
  return weight(transfers_[index]);
}

std::size_t LinkScheduler::index_of(std::uint64_t id) const noexcept {
  for (std::size_t i = 0; i < transfers_.size(); ++i) {
    if (transfers_[i].spec.id == id) return i;
  }
  return kNoTransfer;
}

double LinkScheduler::reserved_left() const noexcept {
  double reserved = 0.0;
  for (const Active& t : transfers_)
    reserved += t.spec.reserved_share;
  return std::max(0.0, config_.max_reserved_share - reserved);
}

bool LinkScheduler::slice_live() const noexcept {
  return running_.has_value() && now_ < slice_end_ - kSliceEpsilonS;
}

void LinkScheduler::emit(SchedulerEventKind kind, std::uint64_t transfer, std::uint64_t other) {
  if (events_.size() >= kMaxSchedulerEvents) {
    events_.pop_front();
    ++stats_.events_dropped;
  }
  events_.push_back(SchedulerEvent{kind, transfer, other, now_});
}

std::vector<SchedulerEvent> LinkScheduler::drain_events() {
  std::vector<SchedulerEvent> out(events_.begin(), events_.end());
  events_.clear();
  return out;
}

void LinkScheduler::refresh_raises() {
  // Shares as WRR would give them now, among everyone with bytes left to send.
  double total = 0.0;
  for (const Active& t : transfers_) {
    if (t.granted < t.spec.bytes) total += weight(t);
  }
  for (Active& t : transfers_) {
    if (t.raised || !t.spec.deadline_s || t.granted >= t.spec.bytes) continue;
    const double left_s = *t.spec.deadline_s - now_;
    const double rate = total > 0.0 ? weight(t) / total * config_.link_bytes_per_s : config_.link_bytes_per_s;
    const double needed_s = static_cast<double>(t.spec.bytes - t.granted) / rate;
    if (left_s <= 0.0 || needed_s > left_s) {
      t.raised = true;  // sticky: a raised transfer stays raised until it finishes
      ++stats_.deadline_raises;
      emit(SchedulerEventKind::kDeadlineRaised, t.spec.id, 0);
    }
  }
}

std::size_t LinkScheduler::pick_wrr(bool prefetch) noexcept {
  // Smooth weighted round robin (as in nginx): everyone asking earns its weight, the richest is
  // served and pays the total, which interleaves transfers in proportion to weight.
  std::size_t pick = kNoTransfer;
  double total = 0.0;
  for (std::size_t i = 0; i < transfers_.size(); ++i) {
    Active& t = transfers_[i];
    if (!eligible(t) || (t.spec.klass == TransferClass::kPrefetch) != prefetch) continue;
    const double w = weight(t);
    t.credit += w;
    total += w;
    if (pick == kNoTransfer || t.credit > transfers_[pick].credit) pick = i;
  }
  if (pick != kNoTransfer) transfers_[pick].credit -= total;
  return pick;
}

std::size_t LinkScheduler::pick_fifo() const noexcept {
  // The oldest transfer with something left to send; nobody else goes until it has sent it all.
  for (std::size_t i = 0; i < transfers_.size(); ++i) {
    const Active& t = transfers_[i];
    if (t.granted < t.spec.bytes || (t.waiting && t.want > 0)) return i;
  }
  return kNoTransfer;
}

Grant LinkScheduler::issue(std::size_t index, GrantReason reason, bool preempting) {
  bool reserved_active = false;
  for (const Active& other : transfers_) {
    reserved_active = reserved_active || (other.spec.reserved_share > 0.0 && other.granted < other.spec.bytes);
  }
  Active& t = transfers_[index];
  const std::uint64_t left = t.spec.bytes > t.granted ? t.spec.bytes - t.granted : 0;
  const std::uint64_t chunk = t.want > 0 ? t.want : std::min(config_.chunk_bytes, left);
  t.spec.bytes = std::max(t.spec.bytes, t.granted + chunk);  // a transfer that asks for more grows
  Grant grant;
  grant.id = t.spec.id;
  grant.offset = t.granted;
  grant.bytes = chunk;
  grant.reason = reason;
  grant.preempting = preempting;
  grant.raised = t.raised;
  grant.waited_s = std::max(0.0, now_ - t.waiting_since);
  // Aging counts the time a transfer asked while others were granted: waiting on the window or
  // the pacer alone is not being passed over.
  for (Active& other : transfers_) {
    if (&other == &t || !other.waiting) continue;
    other.passed_s += std::max(0.0, now_ - other.pass_mark);
    other.pass_mark = now_;
  }
  t.pass_mark = now_;
  if (t.preempted) {
    t.preempted = false;
    grant.resumed = true;
    ++stats_.resumes;
    emit(SchedulerEventKind::kResumed, t.spec.id, 0);
  }
  t.waiting = false;
  t.want = 0;
  t.granted += chunk;
  t.unacked.push_back(t.granted);
  grant.last = t.granted >= t.spec.bytes;
  ++inflight_chunks_;
  inflight_bytes_ += chunk;
  ++stats_.grants;
  stats_.wait_sum_s += grant.waited_s;
  stats_.wait_max_s = std::max(stats_.wait_max_s, grant.waited_s);
  stats_.bytes_by_class[class_index(t.spec.klass)] += chunk;
  stats_.link_bytes += chunk;
  if (t.spec.reserved_share > 0.0) stats_.reserved_bytes += chunk;
  if (reserved_active) stats_.bytes_while_reserved += chunk;
  return grant;
}

std::optional<Grant> LinkScheduler::grant(double now) {
  advance_to(now);
  if (transfers_.empty() || inflight_chunks_ >= config_.window_chunks) return std::nullopt;

  if (config_.mode == SchedulerMode::kFifo) {
    const std::size_t head = pick_fifo();
    if (head == kNoTransfer || !eligible(transfers_[head])) return std::nullopt;
    return issue(head, GrantReason::kFifo, false);
  }

  refresh_raises();

  // 0. The stall guard: the longest wait at or past max_stall_s.
  if (config_.max_stall_s > 0.0) {
    std::size_t stalled = kNoTransfer;
    double longest = 0.0;
    for (std::size_t i = 0; i < transfers_.size(); ++i) {
      const Active& t = transfers_[i];
      const double waited = now_ - t.waiting_since;
      if (eligible(t) && waited >= config_.max_stall_s && (stalled == kNoTransfer || waited > longest)) {
        stalled = i;
        longest = waited;
      }
    }
    if (stalled != kNoTransfer) {
      ++stats_.stall_guards;
      emit(SchedulerEventKind::kStallGuard, transfers_[stalled].spec.id, 0);
      return issue(stalled, GrantReason::kStallGuard, false);
    }
  }

  // 1. Reservations: the critical transfer furthest behind its share of the link since it arrived.
  {
    std::size_t pick = kNoTransfer;
    double worst = 0.0;
    for (std::size_t i = 0; i < transfers_.size(); ++i) {
      const Active& t = transfers_[i];
      if (t.spec.reserved_share <= 0.0 || !eligible(t)) continue;
      const double link_since = static_cast<double>(stats_.link_bytes - t.link_bytes_at_submit);
      const double deficit = t.spec.reserved_share * link_since - static_cast<double>(t.granted);
      if (deficit >= 0.0 && (pick == kNoTransfer || deficit > worst)) {
        pick = i;
        worst = deficit;
      }
    }
    if (pick != kNoTransfer) return issue(pick, GrantReason::kReserved, false);
  }

  // 2. Deadline-raised transfers, earliest deadline first.
  {
    std::size_t pick = kNoTransfer;
    for (std::size_t i = 0; i < transfers_.size(); ++i) {
      const Active& t = transfers_[i];
      if (!t.raised || !eligible(t)) continue;
      if (pick == kNoTransfer || *t.spec.deadline_s < *transfers_[pick].spec.deadline_s) pick = i;
    }
    if (pick != kNoTransfer) return issue(pick, GrantReason::kDeadline, false);
  }

  // 3. The running transfer keeps the link while its slice lasts, unless it is preempted: by a
  // much heavier transfer while the slice lasts, or, once it has run out, by one that arrived
  // after the running one took the link (transfers queued together share it by weight below).
  const std::size_t run = running_ ? index_of(*running_) : kNoTransfer;
  bool take_over = true;  // whoever step 4 or 5 picks becomes the running transfer
  bool preempting = false;
  if (run != kNoTransfer) {
    Active& r = transfers_[run];
    const bool live = slice_live();
    const bool has_more = r.granted < r.spec.bytes || (r.waiting && r.want > 0);
    if (!has_more) {
      // Everything granted: its slice is over, whoever comes next takes the link.
    } else if (r.spec.klass == TransferClass::kPrefetch) {
      // Anything else asking preempts a prefetch, whatever its progress.
      bool other = false;
      for (const Active& t : transfers_)
        other = other || (eligible(t) && t.spec.klass != TransferClass::kPrefetch);
      if (other) {
        preempting = true;
      } else if (live && eligible(r)) {
        return issue(run, GrantReason::kRunning, false);
      } else if (live) {
        take_over = false;
      }
    } else {
      std::size_t heaviest = kNoTransfer;
      double heaviest_w = 0.0;
      for (std::size_t i = 0; i < transfers_.size(); ++i) {
        const Active& t = transfers_[i];
        if (i == run || !eligible(t) || t.spec.klass == TransferClass::kPrefetch) continue;
        if (!live && t.seq < running_since_seq_) continue;
        const double w = weight(t);
        if (heaviest == kNoTransfer || w > heaviest_w) {
          heaviest = i;
          heaviest_w = w;
        }
      }
      const double done = static_cast<double>(r.granted) / static_cast<double>(r.spec.bytes);
      if (heaviest != kNoTransfer && heaviest_w > config_.preempt_factor * weight(r) &&
          done < config_.preempt_max_done) {
        r.preempted = true;
        ++stats_.preemptions;
        emit(SchedulerEventKind::kPreempted, r.spec.id, transfers_[heaviest].spec.id);
        running_ = transfers_[heaviest].spec.id;
        running_since_seq_ = next_seq_;
        slice_end_ = now_ + config_.time_slice_s;
        return issue(heaviest, GrantReason::kWrr, true);
      }
      if (live && eligible(r)) return issue(run, GrantReason::kRunning, false);
      if (live) take_over = false;  // it is not asking this moment: someone else sends, it keeps its slice
    }
  }

  // 4. Weighted round robin among the rest; 5. prefetch only when nobody else asks.
  GrantReason reason = GrantReason::kWrr;
  std::size_t pick = pick_wrr(false);
  if (pick == kNoTransfer) {
    pick = pick_wrr(true);
    reason = GrantReason::kPrefetch;
  }
  if (pick == kNoTransfer) return std::nullopt;
  if (preempting) {
    Active& victim = transfers_[run];
    victim.preempted = true;
    ++stats_.preemptions;
    emit(SchedulerEventKind::kPreempted, victim.spec.id, transfers_[pick].spec.id);
  }
  if (take_over) {
    running_ = transfers_[pick].spec.id;
    running_since_seq_ = next_seq_;
    slice_end_ = now_ + config_.time_slice_s;
  }
  return issue(pick, reason, preempting);
}

SchedulerStats LinkScheduler::stats() const noexcept {
  SchedulerStats out = stats_;
  out.queued = transfers_.size();
  out.waiting = static_cast<std::size_t>(
      std::count_if(transfers_.begin(), transfers_.end(), [](const Active& t) { return t.waiting; }));
  out.inflight_chunks = inflight_chunks_;
  out.inflight_bytes = inflight_bytes_;
  return out;
}

std::optional<ChunkEvent> LinkScheduler::step() {
  if (transfers_.empty()) return std::nullopt;
  for (Active& t : transfers_) {
    if (!t.waiting) {
      t.waiting = true;
      t.waiting_since = now_;
      t.pass_mark = now_;
    }
  }
  const auto granted = grant(now_);
  if (!granted) return std::nullopt;  // not reached: acknowledgements are instant, the window is empty
  ChunkEvent event;
  event.transfer = granted->id;
  event.offset = granted->offset;
  event.bytes = granted->bytes;
  event.start_s = now_;
  event.preempting = granted->preempting;
  now_ += static_cast<double>(granted->bytes) / config_.link_bytes_per_s;
  event.end_s = now_;
  acknowledged(granted->id, granted->bytes);
  if (granted->last) {
    event.completed = true;
    (void)finish(granted->id, true);
  }
  return event;
}

}  // namespace kvrelay::decision
