#pragma once

// Which token positions the kv_sparse medium keeps (issue #28): the first few (attention sinks,
// which most heads attend to whatever follows) and the most recent ones, as StreamingLLM keeps
// them, so that `keep_ratio` of the positions carry what the receiver attends over. The receiver
// attends over the kept positions at their original positions (accepts_sparse_kv).

#include <cstdint>
#include <vector>

#include "kvrelay/core/kv_tokens.h"

namespace kvrelay::broker {

inline constexpr std::uint32_t kSparseSinkTokens = 4;

// The kept runs of positions 0..tokens-1: ceil(keep_ratio * tokens) positions (at least one
// more than the sinks), the sinks first, then the most recent. Every position when the ratio
// keeps them all.
[[nodiscard]] std::vector<TokenRun> sparse_keep(std::uint64_t tokens, double keep_ratio);

// The share of positions kv_sparse keeps: the catalogue's ratio for it (decision/media.h), which
// is also what the engine prices its bytes by.
[[nodiscard]] double sparse_keep_ratio();

}  // namespace kvrelay::broker
