#pragma once

// Token ranges of a whole cache laid out as KvLayout describes (K0 V0 K1 V1 ..., each tensor
// [tokens, kv_heads, head_dim]). A token range is not contiguous across tensors, so slicing a
// cache and joining two caches copy tensor by tensor. Used to move only the blocks a receiver
// lacks: the sender slices the tail, the receiver joins it to the prefix it already holds.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/result.h"

namespace kvrelay {

// Copies tokens [begin, end) of every K and V tensor of `kv` (laid out by `layout`) into `out`,
// laid out by layout.with_tokens(end - begin). Sizes are checked against the layouts.
[[nodiscard]] Status copy_token_range(const KvLayout& layout, std::span<const std::byte> kv, std::uint64_t begin,
                                      std::uint64_t end, std::span<std::byte> out);

// Consecutive token positions [start, start + length): how a position-sparse selection (the
// kv_sparse medium) names the tokens it keeps, and a span that does not start at 0 its tokens.
struct TokenRun {
  std::uint32_t start = 0;
  std::uint32_t length = 0;
  friend bool operator==(const TokenRun&, const TokenRun&) = default;
};

// Tokens the runs select.
[[nodiscard]] std::uint64_t run_tokens(std::span<const TokenRun> runs) noexcept;
// kInvalidArgument unless every run is non-empty and they are ascending, disjoint and end within
// `tokens` (no runs at all passes).
[[nodiscard]] Status check_token_runs(std::span<const TokenRun> runs, std::uint64_t tokens);
// Merges runs across the smallest gaps (merging across gaps of 1, 2, 4, ... positions) until at
// most `max_runs` remain: a selection that must fit a bounded message keeps a few more positions,
// never fewer.
void coarsen_token_runs(std::vector<TokenRun>& runs, std::size_t max_runs);
// Copies the tokens `runs` select (check_token_runs against layout.tokens) of every K and V
// tensor of `kv` into `out`, laid out by layout.with_tokens(run_tokens(runs)).
[[nodiscard]] Status copy_token_runs(const KvLayout& layout, std::span<const std::byte> kv,
                                     std::span<const TokenRun> runs, std::span<std::byte> out);

// Writes `head` followed token-wise by `tail` into `out` (laid out for head + tail tokens). Both
// must share layers, kv_heads, head_dim and dtype.
[[nodiscard]] Status join_tokens(const KvLayout& head_layout, std::span<const std::byte> head,
                                 const KvLayout& tail_layout, std::span<const std::byte> tail,
                                 std::span<std::byte> out);

}  // namespace kvrelay
