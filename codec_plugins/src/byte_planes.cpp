#include "kvrelay/codec_plugins/byte_planes.h"

#include <cstring>

namespace kvrelay::codec {

// Fixed-width inner loops (no per-element branch on the element size) so GCC vectorizes the
// strided loads with shuffles.
void split_byte_planes(const std::uint8_t* source, std::size_t elements, std::size_t element_size,
                       std::uint8_t* planes) noexcept {
  if (element_size == 1) {  // fp8: one plane, the elements themselves
    if (elements != 0) std::memcpy(planes, source, elements);
    return;
  }
  if (element_size == 2) {
    std::uint8_t* high = planes;
    std::uint8_t* low = planes + elements;
    for (std::size_t i = 0; i < elements; ++i) {
      low[i] = source[2 * i];
      high[i] = source[2 * i + 1];
    }
    return;
  }
  for (std::size_t i = 0; i < elements; ++i) {
    planes[i] = source[4 * i + 3];
    planes[elements + i] = source[4 * i + 2];
    planes[2 * elements + i] = source[4 * i + 1];
    planes[3 * elements + i] = source[4 * i];
  }
}

void merge_byte_planes(const std::uint8_t* planes, std::size_t elements, std::size_t element_size,
                       std::uint8_t* destination) noexcept {
  if (element_size == 1) {
    if (elements != 0) std::memcpy(destination, planes, elements);
    return;
  }
  if (element_size == 2) {
    const std::uint8_t* high = planes;
    const std::uint8_t* low = planes + elements;
    for (std::size_t i = 0; i < elements; ++i) {
      destination[2 * i] = low[i];
      destination[2 * i + 1] = high[i];
    }
    return;
  }
  for (std::size_t i = 0; i < elements; ++i) {
    destination[4 * i + 3] = planes[i];
    destination[4 * i + 2] = planes[elements + i];
    destination[4 * i + 1] = planes[2 * elements + i];
    destination[4 * i] = planes[3 * elements + i];
  }
}

}  // namespace kvrelay::codec
