#include "kvrelay/refworker/kv_cache.h"

#include <sys/mman.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace kvrelay::refworker {

KvCache::KvCache(std::size_t layers, std::size_t kv_dim) : layers_(layers), kv_dim_(kv_dim) {}

KvCache::~KvCache() {
  if (data_ != nullptr) ::munmap(data_, mapped_bytes_);
}

Status KvCache::reserve(std::size_t tokens, std::size_t keep) {
  if (tokens <= capacity_) return ok();
  const std::size_t capacity = std::max(tokens, 2 * capacity_);
  const std::size_t bytes = 2 * layers_ * capacity * kv_dim_ * sizeof(float);
  void* memory = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) {
    return fail(ErrorCode::kResourceExhausted, fmt::format("cannot allocate a KV cache of {} tokens ({} bytes): {}",
                                                           capacity, bytes, std::strerror(errno)));
  }
  // Transparent huge pages (where the host grants them on request) make the one-time touch and
  // the attention's strided reads cheaper; without them this is a no-op.
  (void)::madvise(memory, bytes, MADV_HUGEPAGE);
  auto* data = static_cast<float*>(memory);
  keep = std::min(keep, capacity_);
  for (std::size_t index = 0; index < 2 * layers_; ++index) {
    float* to = data + index * capacity * kv_dim_;
    if (keep > 0) std::memcpy(to, tensor(index), keep * kv_dim_ * sizeof(float));
    // Write every new page now, so that no later request pays for its first touch.
    std::memset(to + keep * kv_dim_, 0, (capacity - keep) * kv_dim_ * sizeof(float));
  }
  if (data_ != nullptr) ::munmap(data_, mapped_bytes_);
  data_ = data;
  mapped_bytes_ = bytes;
  capacity_ = capacity;
  return ok();
}

}  // namespace kvrelay::refworker
