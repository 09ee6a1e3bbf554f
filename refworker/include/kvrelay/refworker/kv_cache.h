#pragma once

#include <cstddef>
#include <cstdint>

#include "kvrelay/core/result.h"

namespace kvrelay::refworker {

// K and V rows of every layer, [capacity, kv_dim] fp32 per tensor, that a session appends to.
//
// A serving worker keeps one, sized and written once at startup, and lends it to each request's
// session, as vLLM pre-allocates its paged KV cache. On this kind of VM the first write to fresh
// memory costs ~5 ms per MiB, so a KV import (or a long prefill) into freshly allocated pages
// pays that on every request (130 ms for 32 MiB); into the touched cache it pays a memcpy.
// Sessions that outgrow the capacity still work: the cache grows (and pays for the new pages).
class KvCache {
 public:
  // Empty: nothing is allocated until the first reserve().
  KvCache(std::size_t layers, std::size_t kv_dim);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  [[nodiscard]] std::size_t layers() const noexcept { return layers_; }
  [[nodiscard]] std::size_t kv_dim() const noexcept { return kv_dim_; }
  [[nodiscard]] std::size_t capacity() const noexcept { return capacity_; }

  [[nodiscard]] float* keys(std::size_t layer) noexcept { return tensor(2 * layer); }
  [[nodiscard]] float* values(std::size_t layer) noexcept { return tensor(2 * layer + 1); }
  [[nodiscard]] const float* keys(std::size_t layer) const noexcept { return tensor(2 * layer); }
  [[nodiscard]] const float* values(std::size_t layer) const noexcept { return tensor(2 * layer + 1); }

  // Makes room for `tokens` rows per tensor, keeping the first `keep` rows; new memory is written
  // once here. Grows at least geometrically, so decoding one token at a time does not copy the
  // cache at every step. kResourceExhausted when the memory cannot be had (the cache is unchanged).
  [[nodiscard]] Status reserve(std::size_t tokens, std::size_t keep);

 private:
  [[nodiscard]] float* tensor(std::size_t index) const noexcept { return data_ + index * capacity_ * kv_dim_; }

  std::size_t layers_;
  std::size_t kv_dim_;
  std::size_t capacity_ = 0;
  float* data_ = nullptr;
  std::size_t mapped_bytes_ = 0;
};

}  // namespace kvrelay::refworker
