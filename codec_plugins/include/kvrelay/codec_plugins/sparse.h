#pragma once

// Which positions the `sparse` codec kept, for receivers that mask attention accordingly.

#include <cstdint>
#include <span>
#include <vector>

#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/result.h"

namespace kvrelay::codec {

// From a sparse codec payload (the frame's inner payload): 1 = kept, as [layers][kv_heads][tokens].
[[nodiscard]] Result<std::vector<std::uint8_t>> sparse_kept_mask(const KvLayout& layout,
                                                                 std::span<const std::uint8_t> params,
                                                                 std::span<const std::uint8_t> payload);

}  // namespace kvrelay::codec
