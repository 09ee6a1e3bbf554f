#pragma once

// Which token positions position-sparse KV keeps: one rule for the `sparse` codec and the live
// kv_sparse medium (issue #28), and which positions a `sparse` frame kept, for receivers that
// mask attention accordingly.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvrelay/codec_plugins/builtin_params.h"
#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/kv_tokens.h"
#include "kvrelay/core/result.h"

namespace kvrelay::codec {

// The keep rule: the first `sink_tokens` positions, the last `recent_tokens` positions and the
// top ceil(middle * keep_permille / 1000) of the positions between them (the middle), ranked by
// their key L2 norms summed over every layer and kv head. Defaults: the `sparse` codec's.
struct SparseKeep {
  std::uint32_t sink_tokens = BuiltinParams{}.sink_tokens;
  std::uint32_t recent_tokens = BuiltinParams{}.recent_tokens;
  std::uint32_t keep_permille = BuiltinParams{}.keep_permille;  // 0..1000

  // The rule of a `sparse` codec's parameters.
  [[nodiscard]] static SparseKeep of(const BuiltinParams& params) noexcept {
    return {params.sink_tokens, params.recent_tokens, params.keep_permille};
  }
  friend bool operator==(const SparseKeep&, const SparseKeep&) = default;
};

// Positions `rule` keeps of `tokens`: sinks + recent + ceil(middle * keep_permille / 1000), where
// sinks = min(sink_tokens, tokens), recent = min(recent_tokens, tokens - sinks) and middle the rest.
[[nodiscard]] std::uint64_t sparse_kept_count(std::uint64_t tokens, const SparseKeep& rule) noexcept;

// The positions `rule` keeps of the KV `kv` (laid out by `layout`: K then V, layer by layer;
// fp32, fp16 or bf16) as ascending, disjoint, non-adjacent runs; the same positions for every
// layer and kv head, which a receiver attends over at their original positions. A middle
// position's score is the sum over layers and kv heads of its key's L2 norm (in double); higher
// scores first, ties to the earlier position, a score that is NaN (any NaN element) lowest.
// Empty for 0 tokens. kLayoutMismatch when `kv` is not the layout's size, kUnsupported for fp8
// KV, kInvalidArgument for keep_permille > 1000 or a bad layout, kOutOfRange beyond 2^32 tokens.
[[nodiscard]] Result<std::vector<TokenRun>> sparse_keep_positions(const KvLayout& layout, std::span<const std::byte> kv,
                                                                  const SparseKeep& rule);

// From a sparse codec payload (the frame's inner payload): 1 = kept, as [layers][kv_heads][tokens].
[[nodiscard]] Result<std::vector<std::uint8_t>> sparse_kept_mask(const KvLayout& layout,
                                                                 std::span<const std::uint8_t> params,
                                                                 std::span<const std::uint8_t> payload);

}  // namespace kvrelay::codec
