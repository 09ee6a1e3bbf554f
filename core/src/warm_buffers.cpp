#include "kvrelay/core/warm_buffers.h"

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

namespace kvrelay {

struct WarmBufferPool::Shared {
  struct Kept {
    std::unique_ptr<std::byte[]> data;
    std::size_t capacity = 0;
  };
  Shared(std::size_t buffers, std::uint64_t bytes) : max_buffers(buffers), max_retained_bytes(bytes) {
    kept.reserve(max_buffers + 1);
  }
  const std::size_t max_buffers;
  const std::uint64_t max_retained_bytes;
  mutable std::mutex mutex;
  std::vector<Kept> kept;  // ascending capacity
  std::uint64_t kept_bytes = 0;

  // Keeps `buffer` when the bounds allow, dropping the smallest kept buffers to make room.
  void keep(Kept buffer) noexcept {
    std::lock_guard lock(mutex);
    const auto at = std::lower_bound(kept.begin(), kept.end(), buffer.capacity,
                                     [](const Kept& k, std::size_t capacity) { return k.capacity < capacity; });
    kept_bytes += buffer.capacity;
    kept.insert(at, std::move(buffer));  // never reallocates: reserved for max_buffers + 1
    while (!kept.empty() && (kept.size() > max_buffers || kept_bytes > max_retained_bytes)) {
      kept_bytes -= kept.front().capacity;
      kept.erase(kept.begin());
    }
  }
};

WarmBufferPool::WarmBufferPool(std::size_t max_buffers, std::uint64_t max_retained_bytes)
    : shared_(std::make_shared<Shared>(max_buffers, max_retained_bytes)) {}

WarmBufferPool::~WarmBufferPool() = default;

WarmBufferPool::Lease WarmBufferPool::take(std::size_t bytes) {
  Lease lease;
  lease.pool_ = shared_;
  lease.size_ = bytes;
  {
    std::lock_guard lock(shared_->mutex);
    auto& kept = shared_->kept;
    const auto fit = std::lower_bound(kept.begin(), kept.end(), bytes,
                                      [](const Shared::Kept& k, std::size_t wanted) { return k.capacity < wanted; });
    if (fit != kept.end()) {
      lease.data_ = std::move(fit->data);
      lease.capacity_ = fit->capacity;
      shared_->kept_bytes -= fit->capacity;
      kept.erase(fit);
      return lease;
    }
  }
  // Not value-initialized: zeroing would touch every page only for the caller to overwrite it.
  lease.data_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
  lease.capacity_ = bytes;
  return lease;
}

std::size_t WarmBufferPool::retained_buffers() const {
  std::lock_guard lock(shared_->mutex);
  return shared_->kept.size();
}

std::uint64_t WarmBufferPool::retained_bytes() const {
  std::lock_guard lock(shared_->mutex);
  return shared_->kept_bytes;
}

WarmBufferPool::Lease::~Lease() {
  release();
}

WarmBufferPool::Lease::Lease(Lease&& other) noexcept
    : pool_(std::move(other.pool_)),
      data_(std::move(other.data_)),
      capacity_(std::exchange(other.capacity_, 0)),
      size_(std::exchange(other.size_, 0)) {}

WarmBufferPool::Lease& WarmBufferPool::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    release();
    pool_ = std::move(other.pool_);
    data_ = std::move(other.data_);
    capacity_ = std::exchange(other.capacity_, 0);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void WarmBufferPool::Lease::release() noexcept {
  if (pool_ && data_) {
    pool_->keep(Shared::Kept{std::move(data_), capacity_});
  }
  pool_.reset();
  data_.reset();
  capacity_ = 0;
  size_ = 0;
}

}  // namespace kvrelay
