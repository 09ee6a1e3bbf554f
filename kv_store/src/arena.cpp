#include "kvrelay/kv_store/arena.h"

#include <fcntl.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace kvrelay::kv_store {

namespace {

std::uint64_t round_up(std::uint64_t value, std::uint64_t granule) {
  return (value + granule - 1) / granule * granule;
}

// What a block of `size` bytes holds of the arena (an empty one still takes a granule).
std::uint64_t reserved_bytes(std::uint64_t size) {
  return round_up(std::max<std::uint64_t>(size, 1), ShmArena::kGranule);
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
  auto block = allocate_once(size);
  if (block || !reclaimer_ || size > capacity() || !reclaimer_(size)) return block;
  return allocate_once(size);
}

bool ShmArena::fits(std::uint64_t bytes) const {
  const std::uint64_t reserved = reserved_bytes(bytes);
  std::lock_guard lock(mutex_);
  return first_fit_locked(reserved) != free_.end();
}

std::map<std::uint64_t, std::uint64_t>::const_iterator ShmArena::first_fit_locked(std::uint64_t reserved) const {
  return std::find_if(free_.begin(), free_.end(), [&](const auto& range) { return range.second >= reserved; });
}

Result<std::shared_ptr<ArenaBlock>> ShmArena::allocate_once(std::uint64_t size) {
  const std::uint64_t reserved = reserved_bytes(size);
  std::uint64_t offset = 0;
  {
    std::lock_guard lock(mutex_);
    const auto fit = first_fit_locked(reserved);
    if (fit == free_.end()) {
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
  // Kernel mode too: the peer plane receives into arena blocks.
  return prefault_pages(mapping_.bytes(), PrefaultViews::kUserAndKernel, stop);
}

ArenaStats ShmArena::stats() const {
  std::lock_guard lock(mutex_);
  return {capacity(), in_use_, blocks_, failures_};
}

}  // namespace kvrelay::kv_store
