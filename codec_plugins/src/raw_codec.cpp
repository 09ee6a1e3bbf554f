// `raw`: the identity, the baseline every other medium is compared against.

#include <cstring>

#include "kvrelay/codec_plugins/builtin_codecs.h"

#include "codec_common.h"
#include "streamed_encode.h"

namespace kvrelay::codec {
namespace {

using detail::Shape;

std::uint64_t raw_max_size(const kvrelay_codec_layout* layout, const void* /*params*/, std::size_t /*size*/) {
  Shape shape;
  return detail::make_shape(layout, detail::ElementAccess::kBytes, shape) == KVRELAY_CODEC_OK ? shape.total_bytes : 0;
}

int raw_encode(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size, const void* input,
               std::size_t input_size, void* output, std::size_t output_capacity, std::size_t* output_size) {
  return detail::raw_encode_streamed(layout, params, params_size, input, input_size, output, output_capacity,
                                     output_size, detail::OutputSink{});
}

int raw_decode(const kvrelay_codec_layout* layout, const void* /*params*/, std::size_t /*params_size*/,
               const void* input, std::size_t input_size, void* output, std::size_t output_size) {
  Shape shape;
  if (const int code = detail::make_shape(layout, detail::ElementAccess::kBytes, shape); code != KVRELAY_CODEC_OK)
    return code;
  if (output_size != shape.total_bytes) return KVRELAY_CODEC_E_INVALID_ARGUMENT;
  if (input_size < shape.total_bytes) return KVRELAY_CODEC_E_TRUNCATED;
  if (input_size > shape.total_bytes) return KVRELAY_CODEC_E_LAYOUT_MISMATCH;
  if (shape.total_bytes != 0) std::memcpy(output, input, shape.total_bytes);
  return KVRELAY_CODEC_OK;
}

const kvrelay_codec_plugin kRaw = {KVRELAY_CODEC_ABI_VERSION,
                                   sizeof(kvrelay_codec_plugin),
                                   "raw",
                                   kRawCodecId,
                                   KVRELAY_CODEC_FLAG_LOSSLESS | KVRELAY_CODEC_FLAG_HOST_MEMORY,
                                   nullptr,
                                   0,
                                   raw_max_size,
                                   raw_encode,
                                   raw_decode,
                                   detail::builtin_error_text};

}  // namespace

const kvrelay_codec_plugin* raw_codec() noexcept {
  return &kRaw;
}

// Copies in pieces that stay in L2, each reported once copied (or copied by the sink itself).
int detail::raw_encode_streamed(const kvrelay_codec_layout* layout, const void* /*params*/, std::size_t /*params_size*/,
                                const void* input, std::size_t input_size, void* output, std::size_t output_capacity,
                                std::size_t* output_size, OutputSink sink) {
  constexpr std::size_t kPiece = std::size_t{256} << 10;
  Shape shape;
  if (const int code = detail::make_shape(layout, detail::ElementAccess::kBytes, shape); code != KVRELAY_CODEC_OK)
    return code;
  if (input_size != shape.total_bytes || output_capacity < shape.total_bytes || output_size == nullptr) {
    return KVRELAY_CODEC_E_INVALID_ARGUMENT;
  }
  const auto* in = static_cast<const std::uint8_t*>(input);
  auto* out = static_cast<std::uint8_t*>(output);
  for (std::size_t done = 0; done < shape.total_bytes; done += kPiece) {
    const std::size_t piece = shape.total_bytes - done < kPiece ? shape.total_bytes - done : kPiece;
    if (sink.copy_ready != nullptr) {
      sink.copy_ready(sink.context, out + done, in + done, piece);
      continue;
    }
    std::memcpy(out + done, in + done, piece);
    if (sink.ready != nullptr) sink.ready(sink.context, out + done, piece);
  }
  *output_size = shape.total_bytes;
  return KVRELAY_CODEC_OK;
}

}  // namespace kvrelay::codec
