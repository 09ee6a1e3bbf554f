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

#include "bulk_hash_avx2.h"

static_assert(XXH_VECTOR == XXH_AVX2, "xxhash.h should pick its AVX2 loop under -mavx2");

namespace kvrelay::detail {

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

std::uint64_t xxh3_avx2_digest(const void* state) noexcept {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state));
}

}  // namespace kvrelay::detail
