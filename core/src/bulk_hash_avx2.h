#pragma once

// xxhash.h's XXH3-64 built for AVX2 (bulk_hash_avx2.cpp), behind plain functions so that no
// other translation unit sees the inlined copy of the library. Call only where the CPU has AVX2.

#include <cstddef>
#include <cstdint>

namespace kvrelay::detail {

[[nodiscard]] std::uint64_t xxh3_64_avx2(const void* data, std::size_t size) noexcept;

// A streaming state: nullptr when allocation failed.
[[nodiscard]] void* xxh3_avx2_state_new() noexcept;
void xxh3_avx2_state_free(void* state) noexcept;
void xxh3_avx2_update(void* state, const void* data, std::size_t size) noexcept;
// Copies `size` bytes from `source` to `destination` (no overlap) and hashes the copy in one pass;
// false, having done nothing, where this xxhash version does not allow it.
[[nodiscard]] bool xxh3_avx2_update_copy(void* state, void* destination, const void* source, std::size_t size) noexcept;
[[nodiscard]] std::uint64_t xxh3_avx2_digest(const void* state) noexcept;

}  // namespace kvrelay::detail
