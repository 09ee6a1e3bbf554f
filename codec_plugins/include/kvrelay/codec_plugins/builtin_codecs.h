#pragma once

// The statically registered codecs. Each returns the same C struct a plugin would export.

#include "kvrelay/codec_plugins/codec_abi.h"

namespace kvrelay::codec {

// Wire ids of the built-ins (never renumber).
inline constexpr unsigned kRawCodecId = 1;
inline constexpr unsigned kLosslessCodecId = 2;
inline constexpr unsigned kFp8CodecId = 3;
inline constexpr unsigned kInt8CodecId = 4;
inline constexpr unsigned kInt4CodecId = 5;
inline constexpr unsigned kSparseCodecId = 6;

const kvrelay_codec_plugin* raw_codec() noexcept;
const kvrelay_codec_plugin* lossless_codec() noexcept;
const kvrelay_codec_plugin* fp8_codec() noexcept;
const kvrelay_codec_plugin* int8_codec() noexcept;
const kvrelay_codec_plugin* int4_codec() noexcept;
const kvrelay_codec_plugin* sparse_codec() noexcept;

}  // namespace kvrelay::codec
