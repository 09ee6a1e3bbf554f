#pragma once

// Byte buffers kept allocated between uses. On hosts that build page tables lazily (shadow or
// nested paging) the first write to a fresh multi-megabyte buffer costs ~4 ms/MiB, far more
// than the copy itself (docs/transports.md, "Why, measured"); a buffer taken back from this
// pool has its pages mapped already. Bounded: at most `max_buffers` buffers of at most
// `max_retained_bytes` bytes in all are kept; on a return the smallest go first.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace kvrelay {

class WarmBufferPool {
 public:
  WarmBufferPool(std::size_t max_buffers, std::uint64_t max_retained_bytes);
  ~WarmBufferPool();
  WarmBufferPool(const WarmBufferPool&) = delete;
  WarmBufferPool& operator=(const WarmBufferPool&) = delete;

  struct Shared;  // defined in warm_buffers.cpp; outlives the pool while leases are out

  // One buffer, exactly `size()` bytes long, back to the pool on destruction. Its contents are
  // whatever the previous user left: callers overwrite what they read.
  class Lease {
   public:
    Lease() = default;
    ~Lease();
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;

    [[nodiscard]] std::span<std::byte> bytes() const noexcept { return {data_.get(), size_}; }
    [[nodiscard]] std::span<std::uint8_t> u8() const noexcept {
      return {reinterpret_cast<std::uint8_t*>(data_.get()), size_};
    }
    [[nodiscard]] std::size_t size() const noexcept { return size_; }

   private:
    friend class WarmBufferPool;
    void release() noexcept;
    std::shared_ptr<Shared> pool_;
    std::unique_ptr<std::byte[]> data_;
    std::size_t capacity_ = 0;
    std::size_t size_ = 0;
  };

  // The smallest kept buffer of at least `bytes`, else a new one (which warms on first use).
  [[nodiscard]] Lease take(std::size_t bytes);

  [[nodiscard]] std::size_t retained_buffers() const;
  [[nodiscard]] std::uint64_t retained_bytes() const;

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace kvrelay
