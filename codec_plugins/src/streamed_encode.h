#pragma once

// Built-in encoders that hand each finished stretch of their output to the caller as they go,
// so encode_frame_into checksums the payload while it is still in cache instead of reading it
// back from DRAM afterwards. Internal to the library: plugins keep the one-call ABI.

#include <cstddef>
#include <cstdint>

#include "kvrelay/codec_plugins/codec_abi.h"

namespace kvrelay::codec::detail {

// Receives consecutive stretches of the output, in order, each exactly once and only when the
// encoder will not write it again; together they cover [0, *output_size).
struct OutputSink {
  void (*ready)(void* context, const std::uint8_t* bytes, std::size_t size) = nullptr;
  void* context = nullptr;
  // Optional, for stretches an encoder would only copy from its input: copies `size` bytes from
  // `source` to `destination` and takes them as ready, in one pass (the frame's checksum is
  // computed as each stripe is stored).
  void (*copy_ready)(void* context, std::uint8_t* destination, const std::uint8_t* source, std::size_t size) = nullptr;
};

using StreamedEncodeFn = int (*)(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size,
                                 const void* input, std::size_t input_size, void* output, std::size_t output_capacity,
                                 std::size_t* output_size, OutputSink sink);

// The streamed form of a built-in codec's encode, or nullptr when it has none.
[[nodiscard]] StreamedEncodeFn streamed_encoder(const kvrelay_codec_plugin* plugin) noexcept;

// The codecs' own halves of that lookup.
[[nodiscard]] StreamedEncodeFn quant_streamed_encoder(const kvrelay_codec_plugin* plugin) noexcept;
int raw_encode_streamed(const kvrelay_codec_layout* layout, const void* params, std::size_t params_size,
                        const void* input, std::size_t input_size, void* output, std::size_t output_capacity,
                        std::size_t* output_size, OutputSink sink);

}  // namespace kvrelay::codec::detail
