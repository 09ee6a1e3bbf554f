#pragma once

// Byte-plane transposition for the lossless codec: plane 0 gets the most significant byte of
// every element (sign and exponent), the last plane the least significant mantissa byte.

#include <cstddef>
#include <cstdint>

namespace kvrelay::codec {

// `elements` elements of `element_size` (1, 2 or 4) bytes -> element_size planes of `elements` bytes.
void split_byte_planes(const std::uint8_t* source, std::size_t elements, std::size_t element_size,
                       std::uint8_t* planes) noexcept;
void merge_byte_planes(const std::uint8_t* planes, std::size_t elements, std::size_t element_size,
                       std::uint8_t* destination) noexcept;

}  // namespace kvrelay::codec
