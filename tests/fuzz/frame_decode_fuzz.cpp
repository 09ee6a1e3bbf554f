// Fuzzes frame decoding end to end: header checks, checksum, every built-in codec's payload
// validation. Frames with a valid checksum are rare from random bytes, so half the inputs are
// resealed (checksum recomputed) to reach the codec decoders.

#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/registry.h"

namespace {

constexpr std::uint64_t kMaxOutput = std::uint64_t{64} << 20;

void decode(const kvrelay::codec::CodecRegistry& registry, const std::uint8_t* data, std::size_t size) {
  auto decoded = kvrelay::codec::decode_frame(registry, {data, size}, kMaxOutput);
  if (decoded) {
    // A frame that decodes must decode to exactly its layout's size.
    const auto header = kvrelay::codec::inspect_frame({data, size});
    if (!header || header.value().layout.total_bytes().value() != decoded.value().size()) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const auto registry = kvrelay::codec::CodecRegistry::with_builtins();
  decode(registry, data, size);
  if (size >= kvrelay::codec::kFrameHeaderSize + kvrelay::codec::kFrameTrailerSize) {
    std::vector<std::uint8_t> resealed(data, data + size);
    const std::size_t body = size - kvrelay::codec::kFrameTrailerSize;
    const std::uint64_t checksum = XXH3_64bits(resealed.data(), body);
    std::memcpy(resealed.data() + body, &checksum, sizeof checksum);
    decode(registry, resealed.data(), resealed.size());
  }
  return 0;
}
