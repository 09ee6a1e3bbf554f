// XXH3-64 from xxhash.h itself, inlined into this file and built with -mavx2 -O3: the same hash
// values as the library, and on this project's x86 VM about twice the speed of the packaged
// library's dispatching build (docs/codecs.md "CPU implementation"). Only the functions of
// bulk_hash_avx2.h leave this file.

#if !defined(__AVX2__)
#error "bulk_hash_avx2.cpp needs -mavx2"
#endif

#define XXH_INLINE_ALL
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wold-style-cast"
#pragma GCC diagnostic ignored "-Wcast-align"
#pragma GCC diagnostic ignored "-Wconversion"
#pragma GCC diagnostic ignored "-Wsign-conversion"
#pragma GCC diagnostic ignored "-Wshadow"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#include <xxhash.h>
#pragma GCC diagnostic pop

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bulk_hash_avx2.h"

static_assert(XXH_VECTOR == XXH_AVX2, "xxhash.h should pick its AVX2 loop under -mavx2");

namespace kvrelay::detail {
namespace {

#if XXH_VERSION_NUMBER == 801
// The fused copy drives xxhash.h's own streaming update (XXH3_update) with a stripe function that
// first copies the stripe into place, so the values stay the library's by construction. That
// internal signature (one callback per 64-byte stripe) is 0.8.1's; 0.8.2 changed it, so other
// versions take BulkHashStream's two-pass path.

// The destination range of the running fused copy and its distance from the source. Stripes the
// update reads from its own internal buffer lie outside the range and are only hashed.
struct CopyWindow {
  std::uintptr_t begin = 0;
  std::uintptr_t end = 0;
  std::uintptr_t source = 0;
};
thread_local CopyWindow copy_window;

void copy_then_accumulate(void* XXH_RESTRICT acc, const void* XXH_RESTRICT stripe, const void* XXH_RESTRICT secret) {
  const auto at = reinterpret_cast<std::uintptr_t>(stripe);
  if (at >= copy_window.begin && at < copy_window.end) {
    auto* destination = static_cast<__m256i*>(const_cast<void*>(stripe));
    const auto* source = reinterpret_cast<const __m256i*>(copy_window.source + (at - copy_window.begin));
    const __m256i low = _mm256_loadu_si256(source);
    const __m256i high = _mm256_loadu_si256(source + 1);
    _mm256_storeu_si256(destination, low);
    _mm256_storeu_si256(destination + 1, high);
  }
  XXH3_accumulate_512_avx2(acc, stripe, secret);
}
#endif

}  // namespace

std::uint64_t xxh3_64_avx2(const void* data, std::size_t size) noexcept {
  return XXH3_64bits(data, size);
}

void* xxh3_avx2_state_new() noexcept {
  XXH3_state_t* state = XXH3_createState();
  if (state != nullptr) (void)XXH3_64bits_reset(state);
  return state;
}

void xxh3_avx2_state_free(void* state) noexcept {
  (void)XXH3_freeState(static_cast<XXH3_state_t*>(state));
}

void xxh3_avx2_update(void* state, const void* data, std::size_t size) noexcept {
  (void)XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}

bool xxh3_avx2_update_copy(void* state, void* destination, const void* source, std::size_t size) noexcept {
#if XXH_VERSION_NUMBER == 801
  if (size == 0) return true;
  auto* xxh_state = static_cast<XXH3_state_t*>(state);
  auto* out = static_cast<unsigned char*>(destination);
  const auto* in = static_cast<const unsigned char*>(source);
  // The update copies into its internal buffer, from the destination, what it does not hash as
  // whole stripes in place: everything when it all fits the buffer, else the head that completes
  // the buffered bytes and a tail within the last buffer's length. Those bytes are copied here
  // first; the stripes in between are copied by copy_then_accumulate.
  constexpr std::size_t kBuffer = XXH3_INTERNALBUFFER_SIZE;
  const std::size_t buffered = xxh_state->bufferedSize;
  if (buffered + size <= kBuffer) {
    std::memcpy(out, in, size);
  } else {
    const std::size_t head = buffered == 0 ? 0 : kBuffer - buffered;
    std::memcpy(out, in, head);
    const std::size_t tail = std::min(size - head, kBuffer);
    std::memcpy(out + size - tail, in + size - tail, tail);
  }
  copy_window = CopyWindow{reinterpret_cast<std::uintptr_t>(out), reinterpret_cast<std::uintptr_t>(out + size),
                           reinterpret_cast<std::uintptr_t>(in)};
  (void)XXH3_update(xxh_state, out, size, copy_then_accumulate, XXH3_scrambleAcc_avx2);
  copy_window = CopyWindow{};
  return true;
#else
  (void)state;
  (void)destination;
  (void)source;
  (void)size;
  return false;
#endif
}

std::uint64_t xxh3_avx2_digest(const void* state) noexcept {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state));
}

}  // namespace kvrelay::detail
