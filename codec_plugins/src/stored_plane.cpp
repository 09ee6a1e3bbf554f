#include "stored_plane.h"

#include <array>
#include <cmath>
#include <cstring>

namespace kvrelay::codec::detail {
namespace {

constexpr std::size_t kSampleBytes = 4096;
// A sample of 4096 uniformly random bytes estimates about 7.955 bits; 7.9 leaves margin.
constexpr double kIncompressibleBits = 7.9;

constexpr std::uint32_t kZstdMagic = 0xFD2FB528U;
// Frame_Header_Descriptor: Frame_Content_Size_flag 2 (4-byte size), Single_Segment_flag 1 (no
// window descriptor), no checksum, no dictionary.
constexpr std::uint8_t kFrameDescriptor = 0xA0;
constexpr std::size_t kFrameHeaderBytes = 4 + 1 + 4;
constexpr std::size_t kBlockHeaderBytes = 3;
constexpr std::size_t kMaxBlockBytes = std::size_t{128} << 10;

}  // namespace

bool looks_incompressible(const std::uint8_t* plane, std::size_t size) noexcept {
  if (size < kSampleBytes) return false;  // small planes: let zstd decide
  std::array<std::uint32_t, 256> counts{};
  const std::size_t stride = size / kSampleBytes;
  for (std::size_t i = 0; i < kSampleBytes; ++i)
    ++counts[plane[i * stride]];
  double bits = 0;
  for (const std::uint32_t count : counts) {
    if (count == 0) continue;
    const double p = static_cast<double>(count) / static_cast<double>(kSampleBytes);
    bits -= p * std::log2(p);
  }
  return bits >= kIncompressibleBits;
}

std::size_t stored_zstd_frame_size(std::size_t size) noexcept {
  const std::size_t blocks = size == 0 ? 1 : (size + kMaxBlockBytes - 1) / kMaxBlockBytes;
  return kFrameHeaderBytes + blocks * kBlockHeaderBytes + size;
}

std::size_t write_stored_zstd_frame(const std::uint8_t* plane, std::size_t size, std::uint8_t* out,
                                    std::size_t capacity) noexcept {
  const std::size_t total = stored_zstd_frame_size(size);
  if (capacity < total || size > UINT32_MAX) return 0;
  std::memcpy(out, &kZstdMagic, 4);
  out[4] = kFrameDescriptor;
  const auto content_size = static_cast<std::uint32_t>(size);
  std::memcpy(out + 5, &content_size, 4);
  std::size_t written = kFrameHeaderBytes;
  std::size_t offset = 0;
  do {
    const std::size_t block = size - offset < kMaxBlockBytes ? size - offset : kMaxBlockBytes;
    const bool last = offset + block == size;
    // Block_Header, 3 bytes little-endian: Last_Block (bit 0), Block_Type 0 = Raw (bits 1-2),
    // Block_Size (bits 3-23).
    const auto header = static_cast<std::uint32_t>((block << 3) | (last ? 1U : 0U));
    out[written] = static_cast<std::uint8_t>(header);
    out[written + 1] = static_cast<std::uint8_t>(header >> 8);
    out[written + 2] = static_cast<std::uint8_t>(header >> 16);
    written += kBlockHeaderBytes;
    if (block != 0) std::memcpy(out + written, plane + offset, block);
    written += block;
    offset += block;
  } while (offset < size);
  return written;
}

}  // namespace kvrelay::codec::detail
