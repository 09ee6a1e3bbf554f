#include "kvrelay/core/stream_copy.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

namespace kvrelay {
namespace {

#if defined(__x86_64__)
// Below this, the cache-allocating copy costs nothing worth avoiding.
constexpr std::size_t kStreamingMinBytes = 64 * 1024;

__attribute__((target("avx2"))) void copy_streaming_avx2(std::byte* destination, const std::byte* source,
                                                         std::size_t size) noexcept {
  // Bring the destination to a 32-byte boundary with an ordinary copy.
  const auto misalignment = reinterpret_cast<std::uintptr_t>(destination) & 31U;
  if (misalignment != 0) {
    const std::size_t head = 32 - misalignment;
    std::memcpy(destination, source, head);
    destination += head;
    source += head;
    size -= head;
  }
  std::size_t offset = 0;
  for (; offset + 128 <= size; offset += 128) {
    const auto* in = reinterpret_cast<const __m256i*>(source + offset);
    auto* out = reinterpret_cast<__m256i*>(destination + offset);
    const __m256i first = _mm256_loadu_si256(in);
    const __m256i second = _mm256_loadu_si256(in + 1);
    const __m256i third = _mm256_loadu_si256(in + 2);
    const __m256i fourth = _mm256_loadu_si256(in + 3);
    _mm256_stream_si256(out, first);
    _mm256_stream_si256(out + 1, second);
    _mm256_stream_si256(out + 2, third);
    _mm256_stream_si256(out + 3, fourth);
  }
  _mm_sfence();
  if (offset < size) std::memcpy(destination + offset, source + offset, size - offset);
}
#endif

}  // namespace

void copy_streaming(void* destination, const void* source, std::size_t size) noexcept {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2") != 0;
  if (avx2 && size >= kStreamingMinBytes) {
    copy_streaming_avx2(static_cast<std::byte*>(destination), static_cast<const std::byte*>(source), size);
    return;
  }
#endif
  if (size != 0) std::memcpy(destination, source, size);
}

}  // namespace kvrelay
