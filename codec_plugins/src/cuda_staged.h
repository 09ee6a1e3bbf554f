#pragma once

// The host-staged CUDA codec structs behind cuda_implementation() (CUDA builds only).

#include <cstdint>

#include "kvrelay/codec_plugins/codec_abi.h"
#include "kvrelay/core/result.h"

namespace kvrelay::codec::detail {

// Fails with kUnsupported when no CUDA device is present.
[[nodiscard]] Result<const kvrelay_codec_plugin*> staged_cuda_codec(std::uint32_t codec_id);

}  // namespace kvrelay::codec::detail
