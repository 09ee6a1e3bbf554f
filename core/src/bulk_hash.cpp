#include "kvrelay/core/bulk_hash.h"

#if defined(KVRELAY_CORE_HAVE_AVX2_HASH)
#include "bulk_hash_avx2.h"
#endif

#include <algorithm>
#include <cstring>

namespace kvrelay {
namespace {

bool use_avx2() noexcept {
#if defined(KVRELAY_CORE_HAVE_AVX2_HASH)
  static const bool supported = __builtin_cpu_supports("avx2") != 0;
  return supported;
#else
  return false;
#endif
}

}  // namespace

std::uint64_t bulk_hash64(const void* data, std::size_t size) noexcept {
#if defined(KVRELAY_CORE_HAVE_AVX2_HASH)
  if (use_avx2()) return detail::xxh3_64_avx2(data, size);
#endif
  return XXH3_64bits(data, size);
}

std::uint64_t bulk_copy_hash64(void* destination, const void* source, std::size_t size) noexcept {
  BulkHashStream hash;
  if (!hash.valid()) {
    if (size != 0) std::memcpy(destination, source, size);
    return bulk_hash64(destination, size);
  }
  hash.update_copy(destination, source, size);
  return hash.digest();
}

BulkHashStream::BulkHashStream() noexcept : avx2_(use_avx2()) {
#if defined(KVRELAY_CORE_HAVE_AVX2_HASH)
  if (avx2_) {
    state_ = detail::xxh3_avx2_state_new();
    return;
  }
#endif
  XXH3_state_t* state = XXH3_createState();
  if (state != nullptr) (void)XXH3_64bits_reset(state);
  state_ = state;
}

BulkHashStream::~BulkHashStream() {
  if (state_ == nullptr) return;
#if defined(KVRELAY_CORE_HAVE_AVX2_HASH)
  if (avx2_) {
    detail::xxh3_avx2_state_free(state_);
    return;
  }
#endif
  (void)XXH3_freeState(static_cast<XXH3_state_t*>(state_));
}

void BulkHashStream::update(const void* data, std::size_t size) noexcept {
#if defined(KVRELAY_CORE_HAVE_AVX2_HASH)
  if (avx2_) {
    detail::xxh3_avx2_update(state_, data, size);
    return;
  }
#endif
  (void)XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, size);
}

void BulkHashStream::update_copy(void* destination, const void* source, std::size_t size) noexcept {
#if defined(KVRELAY_CORE_HAVE_AVX2_HASH)
  if (avx2_ && detail::xxh3_avx2_update_copy(state_, destination, source, size)) return;
#endif
  // Page by page, so each page is hashed while the copy left it in L1.
  constexpr std::size_t kPage = 4096;
  for (std::size_t offset = 0; offset < size; offset += kPage) {
    const std::size_t take = std::min(kPage, size - offset);
    std::memcpy(static_cast<char*>(destination) + offset, static_cast<const char*>(source) + offset, take);
    update(static_cast<const char*>(destination) + offset, take);
  }
}

std::uint64_t BulkHashStream::digest() const noexcept {
#if defined(KVRELAY_CORE_HAVE_AVX2_HASH)
  if (avx2_) return detail::xxh3_avx2_digest(state_);
#endif
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_));
}

}  // namespace kvrelay
