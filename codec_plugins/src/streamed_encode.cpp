#include "streamed_encode.h"

#include "kvrelay/codec_plugins/builtin_codecs.h"

namespace kvrelay::codec::detail {

StreamedEncodeFn streamed_encoder(const kvrelay_codec_plugin* plugin) noexcept {
  if (plugin == raw_codec()) return raw_encode_streamed;
  return quant_streamed_encoder(plugin);
}

}  // namespace kvrelay::codec::detail
