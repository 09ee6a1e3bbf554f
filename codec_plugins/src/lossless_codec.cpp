// `lossless`: byte-plane split then zstd per plane. The exponent-carrying high bytes of
// neighbouring KV values are highly repetitive while the low mantissa bytes are near random,
// so separating them lets zstd compress the former and store the latter almost for free.
//
// Payload: the tensor bytes are cut into chunks of kChunkBytes (the last may be shorter); each
// chunk is element_size planes, plane 0 holding the most significant byte of every element.
// Each plane is stored as u32 compressed length + one zstd frame.

#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/byte_planes.h"

#include "codec_common.h"

namespace kvrelay::codec {
namespace {

using detail::Shape;

constexpr std::size_t kChunkBytes = std::size_t{1} << 20;

struct CctxDeleter {
  void operator()(ZSTD_CCtx* context) const { ZSTD_freeCCtx(context); }
};
struct DctxDeleter {
  void operator()(ZSTD_DCtx* context) const { ZSTD_freeDCtx(context); }
};

int check(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size, Shape& shape,
          BuiltinParams& parsed) {
  if (const int code = detail::make_shape(layout, shape); code != KVRELAY_CODEC_OK) return code;
  return detail::parse_params(params, params_size, parsed);
}

std::uint64_t lossless_max_size(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size) {
  Shape shape;
  BuiltinParams parsed;
  if (check(layout, params, params_size, shape, parsed) != KVRELAY_CODEC_OK) return 0;
  const std::size_t full_chunks = shape.total_bytes / kChunkBytes;
  const std::size_t tail = shape.total_bytes % kChunkBytes;
  const std::size_t planes = shape.element_size;
  const std::uint64_t per_full = planes * (4 + ZSTD_compressBound(kChunkBytes / planes));
  const std::uint64_t per_tail = tail == 0 ? 0 : planes * (4 + ZSTD_compressBound(tail / planes));
  return full_chunks * per_full + per_tail;
}

int lossless_encode(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size, const void* input,
                    std::size_t input_size, void* output, std::size_t output_capacity, std::size_t* output_size) {
  return detail::guarded([&] {
    Shape shape;
    BuiltinParams parsed;
    if (const int code = check(layout, params, params_size, shape, parsed); code != KVRELAY_CODEC_OK) return code;
    if (input_size != shape.total_bytes || output_size == nullptr) return KVRELAY_CODEC_E_INVALID_ARGUMENT;
    if (output_capacity < lossless_max_size(layout, params, params_size)) return KVRELAY_CODEC_E_INVALID_ARGUMENT;
    std::unique_ptr<ZSTD_CCtx, CctxDeleter> context(ZSTD_createCCtx());
    if (!context) return KVRELAY_CODEC_E_RESOURCE_EXHAUSTED;
    const std::size_t planes = shape.element_size;
    std::vector<std::uint8_t> plane_buffer(std::min(kChunkBytes, shape.total_bytes));
    const auto* source = static_cast<const std::uint8_t*>(input);
    auto* out = static_cast<std::uint8_t*>(output);
    std::size_t written = 0;
    for (std::size_t offset = 0; offset < shape.total_bytes; offset += kChunkBytes) {
      const std::size_t chunk = std::min(kChunkBytes, shape.total_bytes - offset);
      const std::size_t plane_bytes = chunk / planes;
      split_byte_planes(source + offset, chunk / planes, planes, plane_buffer.data());
      for (std::size_t plane = 0; plane < planes; ++plane) {
        const std::size_t result =
            ZSTD_compressCCtx(context.get(), out + written + 4, output_capacity - written - 4,
                              plane_buffer.data() + plane * plane_bytes, plane_bytes, parsed.zstd_level);
        if (ZSTD_isError(result)) return KVRELAY_CODEC_E_INTERNAL;
        const auto length = static_cast<std::uint32_t>(result);
        std::memcpy(out + written, &length, 4);
        written += 4 + result;
      }
    }
    *output_size = written;
    return KVRELAY_CODEC_OK;
  });
}

int lossless_decode(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size, const void* input,
                    std::size_t input_size, void* output, std::size_t output_size) {
  return detail::guarded([&] {
    Shape shape;
    BuiltinParams parsed;
    if (const int code = check(layout, params, params_size, shape, parsed); code != KVRELAY_CODEC_OK) return code;
    if (output_size != shape.total_bytes) return KVRELAY_CODEC_E_INVALID_ARGUMENT;
    std::unique_ptr<ZSTD_DCtx, DctxDeleter> context(ZSTD_createDCtx());
    if (!context) return KVRELAY_CODEC_E_RESOURCE_EXHAUSTED;
    const std::size_t planes = shape.element_size;
    std::vector<std::uint8_t> plane_buffer(std::min(kChunkBytes, shape.total_bytes));
    const auto* in = static_cast<const std::uint8_t*>(input);
    auto* destination = static_cast<std::uint8_t*>(output);
    std::size_t read = 0;
    for (std::size_t offset = 0; offset < shape.total_bytes; offset += kChunkBytes) {
      const std::size_t chunk = std::min(kChunkBytes, shape.total_bytes - offset);
      const std::size_t plane_bytes = chunk / planes;
      for (std::size_t plane = 0; plane < planes; ++plane) {
        if (input_size - read < 4) return KVRELAY_CODEC_E_TRUNCATED;
        std::uint32_t length;
        std::memcpy(&length, in + read, 4);
        read += 4;
        if (input_size - read < length) return KVRELAY_CODEC_E_TRUNCATED;
        const unsigned long long content = ZSTD_getFrameContentSize(in + read, length);
        if (content != plane_bytes) return KVRELAY_CODEC_E_CORRUPT;
        const std::size_t result = ZSTD_decompressDCtx(context.get(), plane_buffer.data() + plane * plane_bytes,
                                                       plane_bytes, in + read, length);
        if (ZSTD_isError(result) || result != plane_bytes) return KVRELAY_CODEC_E_CORRUPT;
        read += length;
      }
      merge_byte_planes(plane_buffer.data(), plane_bytes, planes, destination + offset);
    }
    if (read != input_size) return KVRELAY_CODEC_E_LAYOUT_MISMATCH;
    return KVRELAY_CODEC_OK;
  });
}

const BuiltinParams kDefaults{};
const auto kDefaultWire = kDefaults.serialize();

const kvrelay_codec_plugin kLossless = {KVRELAY_CODEC_ABI_VERSION,
                                        sizeof(kvrelay_codec_plugin),
                                        "lossless",
                                        kLosslessCodecId,
                                        KVRELAY_CODEC_FLAG_LOSSLESS | KVRELAY_CODEC_FLAG_HOST_MEMORY,
                                        kDefaultWire.data(),
                                        static_cast<std::uint32_t>(kDefaultWire.size()),
                                        lossless_max_size,
                                        lossless_encode,
                                        lossless_decode,
                                        detail::builtin_error_text};

}  // namespace

const kvrelay_codec_plugin* lossless_codec() noexcept {
  return &kLossless;
}

}  // namespace kvrelay::codec
