#pragma once

// XXH3 for bulk data (frames, chunks, KV payloads). The packaged libxxhash's XXH3_64bits is its
// portable SSE2 build; where the library exports its CPU-dispatching entry (AVX2 / AVX-512, same
// hash values, ~2.3x faster), xxh_x86dispatch.h turns every XXH3_64bits call below into it.
// KVRELAY_HAVE_XXH3_DISPATCH comes with kvrelay::dep::xxhash (cmake/KvrelayDependencies.cmake).

#include <xxhash.h>
#if defined(KVRELAY_HAVE_XXH3_DISPATCH)
#include <xxh_x86dispatch.h>
#endif

#include <cstddef>
#include <cstdint>

namespace kvrelay {

// XXH3-64 of bulk data (the values of XXH3_64bits). Where the CPU has AVX2 it runs xxhash.h's
// AVX2 loop inlined into core and built with -O3, about twice the library's dispatching build on
// this project's VM (28-35 instead of 14-16 GB/s from DRAM, 42 instead of 30 GB/s in L2).
[[nodiscard]] std::uint64_t bulk_hash64(const void* data, std::size_t size) noexcept;

// Copies `size` bytes from `source` to `destination` (no overlap) and returns bulk_hash64 of the
// copy, in one pass where BulkHashStream::update_copy can (two if a hash state cannot be had).
[[nodiscard]] std::uint64_t bulk_copy_hash64(void* destination, const void* source, std::size_t size) noexcept;

// The same hash over consecutive pieces: digest() equals bulk_hash64 of their concatenation.
class BulkHashStream {
 public:
  BulkHashStream() noexcept;
  ~BulkHashStream();
  BulkHashStream(const BulkHashStream&) = delete;
  BulkHashStream& operator=(const BulkHashStream&) = delete;

  // False when the state could not be allocated; then nothing else may be called.
  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }
  void update(const void* data, std::size_t size) noexcept;
  // Copies `size` bytes from `source` to `destination` (which must not overlap) and hashes them
  // as update(destination, size) would. With AVX2 each 64-byte stripe is hashed as soon as it is
  // stored, so the copy costs about what memcpy alone does instead of a copy plus a hash pass
  // (docs/transports.md "Fused copy and hash"). What is hashed is what was written, even if
  // `source` changes meanwhile.
  void update_copy(void* destination, const void* source, std::size_t size) noexcept;
  [[nodiscard]] std::uint64_t digest() const noexcept;

 private:
  void* state_ = nullptr;
  bool avx2_ = false;
};

}  // namespace kvrelay
