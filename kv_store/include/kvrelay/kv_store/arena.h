#pragma once

// A sidecar-owned shared-memory arena: one memfd, allocated once (fallocate) and mapped for the
// process's lifetime, cut into granule-aligned blocks for entries.
//
// Why: a fresh segment per entry pays for new pages and a new mapping every time; blocks of an
// arena that stays mapped in the sidecar and in each worker reuse pages that are already mapped.
// The price is isolation: the arena cannot be sealed against writes, so workers that map it must
// be trusted not to write outside the blocks they were granted (limits.shm_arena_bytes = 0
// keeps one sealed memfd per entry instead).

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "kvrelay/core/result.h"
#include "kvrelay/core/unique_fd.h"
#include "kvrelay/kv_store/memfd.h"
#include "kvrelay/kv_store/memory_strategy.h"

namespace kvrelay::kv_store {

class ShmArena;

// One allocated range; returns to the arena when the last owner lets go.
class ArenaBlock {
 public:
  ~ArenaBlock();
  ArenaBlock(const ArenaBlock&) = delete;
  ArenaBlock& operator=(const ArenaBlock&) = delete;

  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
  // The arena bytes it holds: size rounded up to the granule.
  [[nodiscard]] std::uint64_t reserved() const noexcept { return reserved_; }
  [[nodiscard]] std::span<std::byte> bytes() const noexcept;
  [[nodiscard]] const ShmArena& arena() const noexcept { return *arena_; }

 private:
  friend class ShmArena;
  ArenaBlock(std::shared_ptr<ShmArena> arena, std::uint64_t offset, std::uint64_t size, std::uint64_t reserved)
      : arena_(std::move(arena)), offset_(offset), size_(size), reserved_(reserved) {}
  std::shared_ptr<ShmArena> arena_;
  std::uint64_t offset_;
  std::uint64_t size_;
  std::uint64_t reserved_;  // size rounded up to the granule
};

struct ArenaStats {
  std::uint64_t capacity = 0;
  std::uint64_t in_use = 0;  // reserved by live blocks
  std::uint64_t blocks = 0;
  std::uint64_t allocation_failures = 0;
};

class ShmArena : public std::enable_shared_from_this<ShmArena> {
 public:
  // Block offsets are multiples of this, so any block can be mapped on its own.
  static constexpr std::uint64_t kGranule = 64 * 1024;

  // Creates, reserves (fallocate: a full machine fails here, at startup, not with a SIGBUS
  // later) and maps `capacity` bytes, rounded up to the granule.
  [[nodiscard]] static Result<std::shared_ptr<ShmArena>> create(std::uint64_t capacity);

  // The lowest-addressed free range that fits, so recently used (warm) memory is reused first.
  // When none does, asks the reclaimer (if set) to free some and tries once more;
  // kResourceExhausted when there is still no free range large enough.
  [[nodiscard]] Result<std::shared_ptr<ArenaBlock>> allocate(std::uint64_t size);

  // Called without the arena's lock when an allocation of `bytes` does not fit: frees blocks
  // (the daemon evicts the least recently used arena entries from its store) and says whether
  // it freed any. Set once, before the arena is shared.
  using Reclaimer = std::function<bool(std::uint64_t bytes)>;
  void set_reclaimer(Reclaimer reclaimer) { reclaimer_ = std::move(reclaimer); }

  // Whether a block of `bytes` would fit now.
  [[nodiscard]] bool fits(std::uint64_t bytes) const;

  // The whole mapping as one span (what a PageWarmer prefaults).
  [[nodiscard]] std::span<std::byte> bytes() const noexcept { return mapping_.bytes(); }

  // Prefaults every page now, on the calling thread, from user and then kernel mode
  // (prefault_pages, PrefaultViews::kUserAndKernel): what MemoryStrategy::kPrefault does in the
  // background. Stops early when `stop` becomes true; returns the bytes covered by both.
  std::uint64_t warm(const std::atomic<bool>* stop = nullptr);

  [[nodiscard]] int fd() const noexcept { return fd_.get(); }
  [[nodiscard]] std::uint64_t capacity() const noexcept { return mapping_.size(); }
  [[nodiscard]] std::byte* base() const noexcept { return mapping_.data(); }
  [[nodiscard]] ArenaStats stats() const;

 private:
  friend class ArenaBlock;
  ShmArena() = default;
  [[nodiscard]] Result<std::shared_ptr<ArenaBlock>> allocate_once(std::uint64_t size);
  // The lowest free range of at least `reserved` bytes, or free_.end().
  [[nodiscard]] std::map<std::uint64_t, std::uint64_t>::const_iterator first_fit_locked(std::uint64_t reserved) const;
  void release(std::uint64_t offset, std::uint64_t reserved) noexcept;

  UniqueFd fd_;
  Mapping mapping_;
  mutable std::mutex mutex_;
  std::map<std::uint64_t, std::uint64_t> free_;  // offset -> length, coalesced
  std::uint64_t in_use_ = 0;
  std::uint64_t blocks_ = 0;
  std::uint64_t failures_ = 0;
  Reclaimer reclaimer_;
};

}  // namespace kvrelay::kv_store
