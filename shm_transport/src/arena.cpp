#include "kvrelay/shm_transport/arena.h"

#include <fcntl.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

namespace kvrelay::shm {

namespace {

std::uint64_t round_up(std::uint64_t value, std::uint64_t granule) {
  return (value + granule - 1) / granule * granule;
}

}  // namespace

ArenaBlock::~ArenaBlock() {
  arena_->release(offset_, reserved_);
}

std::span<std::byte> ArenaBlock::bytes() const noexcept {
  return {arena_->base() + offset_, static_cast<std::size_t>(size_)};
}

Result<std::shared_ptr<ShmArena>> ShmArena::create(std::uint64_t capacity) {
  if (capacity == 0) return fail(ErrorCode::kInvalidArgument, "an arena needs a nonzero capacity");
  if (capacity > (1ULL << 46)) return fail(ErrorCode::kOverflow, fmt::format("arena of {} bytes", capacity));
  capacity = round_up(capacity, kGranule);
  std::shared_ptr<ShmArena> arena(new ShmArena());
  KVRELAY_TRY(arena->fd_, create_sealed_memfd("kvrelay-arena", capacity));
  // Size seals are on; F_SEAL_SEAL keeps anyone from adding F_SEAL_WRITE/FUTURE_WRITE under us.
  if (::fcntl(arena->fd_.get(), F_ADD_SEALS, F_SEAL_SEAL) != 0) {
    return fail(ErrorCode::kIo, fmt::format("arena F_SEAL_SEAL: {}", std::strerror(errno)));
  }
  KVRELAY_TRY(arena->mapping_, Mapping::map(arena->fd_.get(), capacity, true));
  arena->free_.emplace(0, capacity);
  return arena;
}

Result<std::shared_ptr<ArenaBlock>> ShmArena::allocate(std::uint64_t size) {
  const std::uint64_t reserved = round_up(std::max<std::uint64_t>(size, 1), kGranule);
  std::uint64_t offset = 0;
  {
    std::unique_lock lock(mutex_);
    const auto first_fit = [&] {
      auto fit = free_.begin();
      while (fit != free_.end() && fit->second < reserved)
        ++fit;
      return fit;
    };
    auto fit = first_fit();
    if (fit == free_.end() && warming_piece_) {
      // The range may be short only by the piece being warmed: wait for it (microseconds).
      warm_piece_back_.wait(lock, [&] { return !warming_piece_; });
      fit = first_fit();
    }
    if (fit == free_.end() || size > capacity()) {
      ++failures_;
      return fail(ErrorCode::kResourceExhausted,
                  fmt::format("arena has no free range of {} bytes ({} of {} in use)", reserved, in_use_, capacity()));
    }
    offset = fit->first;
    const std::uint64_t left = fit->second - reserved;
    free_.erase(fit);
    if (left > 0) free_.emplace(offset + reserved, left);
    in_use_ += reserved;
    ++blocks_;
  }
  return std::shared_ptr<ArenaBlock>(new ArenaBlock(shared_from_this(), offset, size, reserved));
}

void ShmArena::release(std::uint64_t offset, std::uint64_t reserved) noexcept {
  std::lock_guard lock(mutex_);
  in_use_ -= reserved;
  --blocks_;
  give_back_locked(offset, reserved);
}

void ShmArena::give_back_locked(std::uint64_t offset, std::uint64_t reserved) noexcept {
  auto [inserted, fresh] = free_.emplace(offset, reserved);
  (void)fresh;
  auto next = std::next(inserted);
  if (next != free_.end() && inserted->first + inserted->second == next->first) {
    inserted->second += next->second;
    free_.erase(next);
  }
  if (inserted != free_.begin()) {
    auto previous = std::prev(inserted);
    if (previous->first + previous->second == inserted->first) {
      previous->second += inserted->second;
      free_.erase(inserted);
    }
  }
}

std::uint64_t ShmArena::warm(const std::atomic<bool>* stop) {
  constexpr std::uint64_t kPiece = 32 * kGranule;  // 2 MiB: short lock holds, few round trips
  std::uint64_t cursor = 0;
  std::uint64_t warmed = 0;
  while (stop == nullptr || !stop->load(std::memory_order_relaxed)) {
    std::uint64_t offset = 0;
    std::uint64_t length = 0;
    {
      std::lock_guard lock(mutex_);
      // The first free range that still has bytes at or past the cursor.
      auto range = free_.upper_bound(cursor);
      if (range != free_.begin()) {
        auto previous = std::prev(range);
        if (previous->first + previous->second > cursor) range = previous;
      }
      if (range == free_.end()) break;
      const std::uint64_t range_end = range->first + range->second;
      offset = std::max(range->first, cursor);
      length = std::min(kPiece, range_end - offset);
      // Carve [offset, offset + length) out of the range; release() puts it back and coalesces.
      const std::uint64_t range_start = range->first;
      free_.erase(range);
      if (offset > range_start) free_.emplace(range_start, offset - range_start);
      if (offset + length < range_end) free_.emplace(offset + length, range_end - offset - length);
      warming_piece_ = true;
    }
    std::memset(base() + offset, 0, static_cast<std::size_t>(length));  // free memory: contents are no one's
    {
      std::lock_guard lock(mutex_);
      give_back_locked(offset, length);
      warming_piece_ = false;
    }
    warm_piece_back_.notify_all();
    warmed += length;
    cursor = offset + length;
  }
  return warmed;
}

ArenaStats ShmArena::stats() const {
  std::lock_guard lock(mutex_);
  return {capacity(), in_use_, blocks_, failures_};
}

}  // namespace kvrelay::shm
