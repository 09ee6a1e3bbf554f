// `lossless`: byte-plane split then zstd per plane. The exponent-carrying high bytes of
// neighbouring KV values are highly repetitive while the low mantissa bytes are near random,
// so separating them lets zstd compress the former and store the latter almost for free.
//
// Payload: the tensor bytes are cut into chunks of kChunkBytes (the last may be shorter); each
// chunk is element_size planes, plane 0 holding the most significant byte of every element.
// Each plane is stored as u32 compressed length + one zstd frame.
//
// Speed: at the default level (1, and below) the planes are compressed with a 256-entry hash
// table and 7-byte minimum matches. Exponent planes are low-entropy bytes with few long repeats:
// short matches cost match-finding time and break up the literals that zstd's Huffman stage
// codes well, so these settings are both faster (about 2x) and tighter (exponent plane of the
// trained model's bf16 KV: 3.0x instead of 2.8x) than zstd's level 1 (measurements in
// docs/codecs.md). Planes that sample as near-random bytes skip zstd's attempt and are written
// as a zstd frame of raw blocks (stored_plane.h). All are ordinary zstd frames: decoding is
// unchanged.

#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/byte_planes.h"

#include "codec_common.h"
#include "stored_plane.h"

namespace kvrelay::codec {
namespace {

using detail::Shape;

constexpr std::size_t kChunkBytes = std::size_t{1} << 20;
constexpr int kFastHashLog = 8;
constexpr int kFastMinMatch = 7;

struct CctxDeleter {
  void operator()(ZSTD_CCtx* context) const { ZSTD_freeCCtx(context); }
};
struct DctxDeleter {
  void operator()(ZSTD_DCtx* context) const { ZSTD_freeDCtx(context); }
};

// zstd contexts are reused per thread: creating one, and its first use, allocates and clears
// tables that cost more than compressing a small KV.
ZSTD_CCtx* thread_compressor() {
  thread_local std::unique_ptr<ZSTD_CCtx, CctxDeleter> context(ZSTD_createCCtx());
  return context.get();
}
ZSTD_DCtx* thread_decompressor() {
  thread_local std::unique_ptr<ZSTD_DCtx, DctxDeleter> context(ZSTD_createDCtx());
  return context.get();
}

// One chunk's planes; kept per thread, as a fresh megabyte costs page faults on every call.
std::vector<std::uint8_t>& thread_plane_buffer(std::size_t size) {
  thread_local std::vector<std::uint8_t> buffer;
  if (buffer.size() < size) buffer.resize(size);
  return buffer;
}

bool configure(ZSTD_CCtx* context, int level) {
  ZSTD_CCtx_reset(context, ZSTD_reset_session_and_parameters);
  if (ZSTD_isError(ZSTD_CCtx_setParameter(context, ZSTD_c_compressionLevel, level))) return false;
  if (level > 1) return true;
  return !ZSTD_isError(ZSTD_CCtx_setParameter(context, ZSTD_c_hashLog, kFastHashLog)) &&
         !ZSTD_isError(ZSTD_CCtx_setParameter(context, ZSTD_c_minMatch, kFastMinMatch));
}

int check(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size, Shape& shape,
          BuiltinParams& parsed) {
  if (const int code = detail::make_shape(layout, detail::ElementAccess::kBytes, shape); code != KVRELAY_CODEC_OK)
    return code;
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
    ZSTD_CCtx* context = thread_compressor();
    if (context == nullptr) return KVRELAY_CODEC_E_RESOURCE_EXHAUSTED;
    if (!configure(context, parsed.zstd_level)) return KVRELAY_CODEC_E_INVALID_ARGUMENT;
    const std::size_t planes = shape.element_size;
    std::vector<std::uint8_t>& plane_buffer = thread_plane_buffer(std::min(kChunkBytes, shape.total_bytes));
    const auto* source = static_cast<const std::uint8_t*>(input);
    auto* out = static_cast<std::uint8_t*>(output);
    std::size_t written = 0;
    for (std::size_t offset = 0; offset < shape.total_bytes; offset += kChunkBytes) {
      const std::size_t chunk = std::min(kChunkBytes, shape.total_bytes - offset);
      const std::size_t plane_bytes = chunk / planes;
      split_byte_planes(source + offset, chunk / planes, planes, plane_buffer.data());
      for (std::size_t plane = 0; plane < planes; ++plane) {
        const std::uint8_t* bytes = plane_buffer.data() + plane * plane_bytes;
        std::uint8_t* target = out + written + 4;
        const std::size_t room = output_capacity - written - 4;
        const std::size_t result = detail::looks_incompressible(bytes, plane_bytes)
                                       ? detail::write_stored_zstd_frame(bytes, plane_bytes, target, room)
                                       : ZSTD_compress2(context, target, room, bytes, plane_bytes);
        if (result == 0 || ZSTD_isError(result)) return KVRELAY_CODEC_E_INTERNAL;
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
    ZSTD_DCtx* context = thread_decompressor();
    if (context == nullptr) return KVRELAY_CODEC_E_RESOURCE_EXHAUSTED;
    const std::size_t planes = shape.element_size;
    std::vector<std::uint8_t>& plane_buffer = thread_plane_buffer(std::min(kChunkBytes, shape.total_bytes));
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
        const std::size_t result =
            ZSTD_decompressDCtx(context, plane_buffer.data() + plane * plane_bytes, plane_bytes, in + read, length);
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
