// `raw`: the identity, the baseline every other medium is compared against.

#include <cstring>

#include "kvrelay/codec_plugins/builtin_codecs.h"

#include "codec_common.h"

namespace kvrelay::codec {
namespace {

using detail::Shape;

std::uint64_t raw_max_size(const kvrelay_codec_layout* layout, const void* /*params*/, std::size_t /*size*/) {
  Shape shape;
  return detail::make_shape(layout, shape) == KVRELAY_CODEC_OK ? shape.total_bytes : 0;
}

int raw_encode(const kvrelay_codec_layout* layout, const void* /*params*/, std::size_t /*params_size*/,
               const void* input, std::size_t input_size, void* output, std::size_t output_capacity,
               std::size_t* output_size) {
  Shape shape;
  if (const int code = detail::make_shape(layout, shape); code != KVRELAY_CODEC_OK) return code;
  if (input_size != shape.total_bytes || output_capacity < shape.total_bytes || output_size == nullptr) {
    return KVRELAY_CODEC_E_INVALID_ARGUMENT;
  }
  if (shape.total_bytes != 0) std::memcpy(output, input, shape.total_bytes);
  *output_size = shape.total_bytes;
  return KVRELAY_CODEC_OK;
}

int raw_decode(const kvrelay_codec_layout* layout, const void* /*params*/, std::size_t /*params_size*/,
               const void* input, std::size_t input_size, void* output, std::size_t output_size) {
  Shape shape;
  if (const int code = detail::make_shape(layout, shape); code != KVRELAY_CODEC_OK) return code;
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

}  // namespace kvrelay::codec
