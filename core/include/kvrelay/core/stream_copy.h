#pragma once

// Copies that bypass the cache on their way out, for filling large shared buffers piece by piece.
//
// glibc's memcpy streams (non-temporal stores) only for copies larger than a threshold near the
// cache size, so a 256 MiB entry written in 256 KiB pieces (each hashed while it is in cache)
// goes through ordinary stores: every destination line is first read from DRAM, then written
// back, a third of the traffic spent for nothing.

#include <cstddef>

namespace kvrelay {

// memcpy's result; AVX2 non-temporal stores where the CPU has them, ordered with a store fence
// before returning, so the bytes are visible to other processes like memcpy's.
void copy_streaming(void* destination, const void* source, std::size_t size) noexcept;

}  // namespace kvrelay
