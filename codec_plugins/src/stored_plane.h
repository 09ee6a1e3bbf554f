#pragma once

// Byte planes that zstd cannot shrink (low mantissa bytes are near random) are written as a
// zstd frame of raw blocks (RFC 8878: frame header, then blocks of type Raw_Block), which costs a
// memcpy instead of a compression attempt and decodes with the ordinary zstd decoder: the
// lossless payload format does not change.

#include <cstddef>
#include <cstdint>

namespace kvrelay::codec::detail {

// True when an order-0 entropy estimate over up to 4096 evenly spaced bytes is >= 7.9 bits per
// byte, where zstd gains at most a few percent (and only from repeats this test cannot see).
[[nodiscard]] bool looks_incompressible(const std::uint8_t* plane, std::size_t size) noexcept;

// Bytes write_stored_zstd_frame() needs for `size` bytes (never more than ZSTD_compressBound).
[[nodiscard]] std::size_t stored_zstd_frame_size(std::size_t size) noexcept;

// Writes `plane` as a single-segment zstd frame of raw blocks with its content size; returns
// the frame's size, or 0 when `capacity` is too small.
std::size_t write_stored_zstd_frame(const std::uint8_t* plane, std::size_t size, std::uint8_t* out,
                                    std::size_t capacity) noexcept;

}  // namespace kvrelay::codec::detail
