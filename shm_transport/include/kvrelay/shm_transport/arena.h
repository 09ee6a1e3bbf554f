#pragma once

// A sidecar-owned shared-memory arena: one memfd, allocated once (fallocate) and mapped for the
// process's lifetime, cut into granule-aligned blocks for entries.
//
// Why: a fresh segment per entry pays for new pages and, on hosts that build page tables
// lazily (shadow or nested paging), a fault per 4 KiB page on every new mapping (~4 ms/MiB).
// Blocks of an arena that stays mapped in the sidecar and in each worker are written and read
// at memcpy speed once their pages are warm. The price is isolation: the arena cannot be sealed
// against writes, so workers that map it must be trusted not to write outside the blocks they
// were granted (limits.shm_arena_bytes = 0 keeps one sealed memfd per entry instead).

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "kvrelay/core/result.h"
#include "kvrelay/shm_transport/memfd.h"
#include "kvrelay/shm_transport/unique_fd.h"

namespace kvrelay::shm {

class ShmArena;

// One allocated range; returns to the arena when the last owner lets go.
class ArenaBlock {
 public:
  ~ArenaBlock();
  ArenaBlock(const ArenaBlock&) = delete;
  ArenaBlock& operator=(const ArenaBlock&) = delete;

  [[nodiscard]] std::uint64_t offset() const noexcept { return offset_; }
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }
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
  // kResourceExhausted when no free range is large enough.
  [[nodiscard]] Result<std::shared_ptr<ArenaBlock>> allocate(std::uint64_t size);

  // Writes every free page once through this process's mapping, a piece at a time, each piece
  // taken out of the free list while it is written (so no block is ever touched). On hosts that
  // build page tables lazily the first write to a page through a mapping costs ~100x a later
  // one (~3 ms/MiB against ~0.07); warming moves that cost off the first transfers. Stops early
  // when `stop` becomes true. Returns the bytes written.
  std::uint64_t warm(const std::atomic<bool>* stop = nullptr);

  [[nodiscard]] int fd() const noexcept { return fd_.get(); }
  [[nodiscard]] std::uint64_t capacity() const noexcept { return mapping_.size(); }
  [[nodiscard]] std::byte* base() const noexcept { return mapping_.data(); }
  [[nodiscard]] ArenaStats stats() const;

 private:
  friend class ArenaBlock;
  ShmArena() = default;
  void release(std::uint64_t offset, std::uint64_t reserved) noexcept;
  void give_back_locked(std::uint64_t offset, std::uint64_t reserved) noexcept;

  UniqueFd fd_;
  Mapping mapping_;
  mutable std::mutex mutex_;
  std::condition_variable warm_piece_back_;
  bool warming_piece_ = false;                   // a piece is out of the free list being warmed (not in use)
  std::map<std::uint64_t, std::uint64_t> free_;  // offset -> length, coalesced
  std::uint64_t in_use_ = 0;
  std::uint64_t blocks_ = 0;
  std::uint64_t failures_ = 0;
};

}  // namespace kvrelay::shm
