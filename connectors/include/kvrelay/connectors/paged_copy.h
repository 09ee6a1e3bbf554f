#pragma once

#include <array>
#include <cstdint>
#include <span>

#include "kvrelay/core/result.h"

namespace kvrelay::connectors {

// How an engine's per-layer paged cache tensor orders its five dimensions (the values are
// kvrelay_paged.h's KVRELAY_PAGED_*).
enum class PagedLayout : std::uint32_t {
  kFlashAttn = 1,   // (2, num_blocks, block_size, kv_heads, head_dim)
  kFlashInfer = 2,  // (num_blocks, 2, block_size, kv_heads, head_dim)
  kCpu = 3,         // (2, num_blocks, kv_heads, block_size, head_dim)
};

// One layer's cache tensor as the engine describes it: shape in the layout's order and strides in
// elements (tensor.stride()), never assumed contiguous. Elements are moved as elem_size opaque bytes.
struct PagedTensorView {
  PagedLayout layout = PagedLayout::kFlashAttn;
  std::uint32_t elem_size = 0;  // 1, 2 or 4
  void* data = nullptr;
  std::array<std::int64_t, 5> shape{};
  std::array<std::int64_t, 5> strides{};
};

// The tokens [first_token, first_token + tokens) of one sequence whose i-th block of block_size
// tokens lives in cache block block_ids[i].
struct PagedSpan {
  std::span<const std::int32_t> block_ids;
  std::uint64_t first_token = 0;
  std::uint64_t tokens = 0;
};

// Copies the span out of the cache into k_dst and v_dst, each [tokens, kv_heads, head_dim]
// contiguous. Every input is validated before a byte moves: a failure (kInvalidArgument,
// kOutOfRange for a block id outside the cache or too few ids, kOverflow) writes nothing.
[[nodiscard]] Status gather_paged(const PagedTensorView& cache, const PagedSpan& span, void* k_dst, void* v_dst);

// The reverse: k_src and v_src into the span's cache slots; nothing else in the cache changes.
[[nodiscard]] Status scatter_paged(const PagedTensorView& cache, const PagedSpan& span, const void* k_src,
                                   const void* v_src);

}  // namespace kvrelay::connectors
