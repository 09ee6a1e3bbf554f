#include "kvrelay/decision/link_scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace kvrelay::decision {

namespace {
constexpr std::size_t kNone = std::numeric_limits<std::size_t>::max();
}

LinkScheduler::LinkScheduler(SchedulerConfig config) : config_(config) {
  config_.chunk_bytes = std::max<std::uint64_t>(config_.chunk_bytes, 1);
  config_.slice_chunks = std::max<std::uint32_t>(config_.slice_chunks, 1);
  if (!(config_.link_bytes_per_s > 0.0)) {
    config_.link_bytes_per_s = 1.0;
  }
}

Status LinkScheduler::submit(const TransferSpec& spec) {
  if (spec.bytes == 0) {
    return fail(ErrorCode::kInvalidArgument, "transfer " + std::to_string(spec.id) + " has no bytes");
  }
  if (index_of(spec.id) != kNone) {
    return fail(ErrorCode::kAlreadyExists, "transfer " + std::to_string(spec.id) + " already queued");
  }
  if (!(spec.reserved_share >= 0.0) || spec.reserved_share >= 1.0) {
    return fail(ErrorCode::kInvalidArgument, "reserved share must be in [0, 1)");
  }
  double reserved = spec.reserved_share;
  for (const Active& t : transfers_) {
    reserved += t.spec.reserved_share;
  }
  // Keep some of the link for everyone else, or reservations alone could starve them.
  if (reserved > 0.9) {
    return fail(ErrorCode::kResourceExhausted, "reservations would exceed 90% of the link");
  }
  Active active;
  active.spec = spec;
  active.submitted_s = now_;
  active.link_bytes_at_submit = link_bytes_;
  transfers_.push_back(active);
  if (running_) {
    const Active& run = transfers_[index_of(*running_)];
    const double run_done = static_cast<double>(run.sent) / static_cast<double>(run.spec.bytes);
    if (weight(transfers_.back()) > config_.preempt_factor * weight(run) && run_done < config_.preempt_max_done &&
        (!preempt_by_ || weight(transfers_.back()) > weight(transfers_[index_of(*preempt_by_)]))) {
      preempt_by_ = spec.id;
    }
  }
  return ok();
}

void LinkScheduler::advance_to(double time_s) noexcept {
  now_ = std::max(now_, time_s);
}

double LinkScheduler::weight(const Active& t) const noexcept {
  const double delay = std::max(0.0, now_ - t.submitted_s - t.served_s);
  const double exponent = std::min(config_.beta * delay, config_.max_exponent);
  return static_cast<double>(t.spec.src_priority + t.spec.dst_priority) + config_.base +
         config_.alpha * std::exp(exponent);
}

std::optional<double> LinkScheduler::urgency(std::uint64_t id) const noexcept {
  const std::size_t index = index_of(id);
  if (index == kNone) {
    return std::nullopt;
  }
  return weight(transfers_[index]);
}

std::size_t LinkScheduler::index_of(std::uint64_t id) const noexcept {
  for (std::size_t i = 0; i < transfers_.size(); ++i) {
    if (transfers_[i].spec.id == id) {
      return i;
    }
  }
  return kNone;
}

std::size_t LinkScheduler::pick_next() noexcept {
  // Reservations first: the critical flow furthest behind its share of the link since it arrived.
  std::size_t pick = kNone;
  double worst_deficit = 0.0;
  for (std::size_t i = 0; i < transfers_.size(); ++i) {
    const Active& t = transfers_[i];
    if (t.spec.reserved_share <= 0.0) {
      continue;
    }
    const double link_since = static_cast<double>(link_bytes_ - t.link_bytes_at_submit);
    const double deficit = t.spec.reserved_share * link_since - static_cast<double>(t.sent);
    if (deficit >= 0.0 && (pick == kNone || deficit > worst_deficit)) {
      pick = i;
      worst_deficit = deficit;
    }
  }
  if (pick != kNone) {
    return pick;
  }
  // Smooth weighted round robin (as in nginx): everyone earns its weight, the richest is served
  // and pays the total, which interleaves transfers in proportion to weight.
  double total = 0.0;
  for (std::size_t i = 0; i < transfers_.size(); ++i) {
    Active& t = transfers_[i];
    const double w = weight(t);
    t.credit += w;
    total += w;
    if (pick == kNone || t.credit > transfers_[pick].credit) {
      pick = i;
    }
  }
  transfers_[pick].credit -= total;
  return pick;
}

std::optional<ChunkEvent> LinkScheduler::step() {
  if (transfers_.empty()) {
    return std::nullopt;
  }
  std::size_t index = running_ ? index_of(*running_) : kNone;
  bool preempting = false;
  if (preempt_by_ && index_of(*preempt_by_) != kNone) {
    index = index_of(*preempt_by_);
    preempting = true;
    ++preemptions_;
    slice_left_ = config_.slice_chunks;
  } else if (index == kNone || slice_left_ == 0) {
    index = pick_next();
    slice_left_ = config_.slice_chunks;
  }
  preempt_by_.reset();
  Active& t = transfers_[index];
  running_ = t.spec.id;
  ChunkEvent event;
  event.transfer = t.spec.id;
  event.offset = t.sent;
  event.bytes = std::min(config_.chunk_bytes, t.spec.bytes - t.sent);
  event.start_s = now_;
  const double duration = static_cast<double>(event.bytes) / config_.link_bytes_per_s;
  now_ += duration;
  event.end_s = now_;
  event.preempting = preempting;
  t.sent += event.bytes;
  t.served_s += duration;
  link_bytes_ += event.bytes;
  --slice_left_;
  if (t.sent == t.spec.bytes) {
    event.completed = true;
    transfers_.erase(transfers_.begin() + static_cast<std::ptrdiff_t>(index));
    running_.reset();
    slice_left_ = 0;
  }
  return event;
}

}  // namespace kvrelay::decision
