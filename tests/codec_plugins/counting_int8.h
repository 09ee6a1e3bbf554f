#pragma once

// The CPU int8 codec behind a second plugin struct that counts its encode and decode calls: a
// stand-in for another implementation of the same codec (EncodeOptions::implementation,
// CodecRegistry::set_executor), such as the GPU's.

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/codec_abi.h"

namespace kvrelay::test {

inline int counting_int8_calls = 0;

inline int counting_int8_encode(const kvrelay_codec_layout* layout, const void* params, size_t params_size,
                                const void* input, size_t input_size, void* output, size_t capacity, size_t* written) {
  ++counting_int8_calls;
  return codec::int8_codec()->encode(layout, params, params_size, input, input_size, output, capacity, written);
}

inline int counting_int8_decode(const kvrelay_codec_layout* layout, const void* params, size_t params_size,
                                const void* input, size_t input_size, void* output, size_t output_size) {
  ++counting_int8_calls;
  return codec::int8_codec()->decode(layout, params, params_size, input, input_size, output, output_size);
}

inline kvrelay_codec_plugin counting_int8() {
  kvrelay_codec_plugin plugin = *codec::int8_codec();
  plugin.encode = counting_int8_encode;
  plugin.decode = counting_int8_decode;
  return plugin;
}

}  // namespace kvrelay::test
