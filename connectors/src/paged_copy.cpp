// Gather/scatter between a paged cache tensor and KvLayout rows. All validation happens before the
// first byte moves, so a refused call leaves both sides untouched; the copy loops then use the
// widest contiguous run the strides allow.

#include "kvrelay/connectors/paged_copy.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>
#include <string>

#include "kvrelay/core/kv_layout.h"

namespace kvrelay::connectors {

namespace paged_copy_detail {

// Byte strides and extents of the five logical axes, whatever order the layout stores them in.
struct Geometry {
  std::byte* base = nullptr;
  std::uint64_t num_blocks = 0;
  std::uint64_t block_size = 0;
  std::uint64_t heads = 0;
  std::uint64_t head_dim = 0;
  std::uint64_t elem = 0;
  std::uint64_t kv_stride = 0;
  std::uint64_t block_stride = 0;
  std::uint64_t slot_stride = 0;
  std::uint64_t head_stride = 0;
  std::uint64_t dim_stride = 0;
  std::uint64_t row_bytes = 0;  // one token's kv_heads * head_dim elements, contiguous in the region
};

// Index of each logical axis in the layout's shape: kv, block, slot, head, dim.
struct AxisOrder {
  int kv, block, slot, head, dim;
};

Result<AxisOrder> axis_order(PagedLayout layout) {
  switch (layout) {
    case PagedLayout::kFlashAttn:
      return AxisOrder{0, 1, 2, 3, 4};
    case PagedLayout::kFlashInfer:
      return AxisOrder{1, 0, 2, 3, 4};
    case PagedLayout::kCpu:
      return AxisOrder{0, 1, 3, 2, 4};
  }
  return fail(ErrorCode::kInvalidArgument,
              "paged layout " + std::to_string(static_cast<std::uint32_t>(layout)) + " is unknown");
}

Result<Geometry> describe(const PagedTensorView& cache) {
  KVRELAY_TRY(const AxisOrder order, axis_order(cache.layout));
  if (cache.elem_size != 1 && cache.elem_size != 2 && cache.elem_size != 4) {
    return fail(ErrorCode::kInvalidArgument,
                "paged elem_size " + std::to_string(cache.elem_size) + " is not 1, 2 or 4");
  }
  if (cache.data == nullptr) return fail(ErrorCode::kInvalidArgument, "paged cache data is null");
  // The highest element offset the tensor addresses, checked, so no copy can leave the tensor.
  std::uint64_t last_element = 0;
  for (std::size_t axis = 0; axis < 5; ++axis) {
    if (cache.shape[axis] <= 0) {
      return fail(ErrorCode::kInvalidArgument, "paged shape[" + std::to_string(axis) + "] is " +
                                                   std::to_string(cache.shape[axis]) + ", not positive");
    }
    if (cache.strides[axis] < 0) {
      return fail(ErrorCode::kInvalidArgument, "paged strides[" + std::to_string(axis) + "] is negative (" +
                                                   std::to_string(cache.strides[axis]) + ")");
    }
    KVRELAY_TRY(const std::uint64_t reach, checked_mul(static_cast<std::uint64_t>(cache.shape[axis] - 1),
                                                       static_cast<std::uint64_t>(cache.strides[axis])));
    KVRELAY_TRY(last_element, checked_add(last_element, reach));
  }
  KVRELAY_TRY(const std::uint64_t end_element, checked_add(last_element, 1));
  KVRELAY_TRY(const std::uint64_t tensor_bytes, checked_mul(end_element, cache.elem_size));
  const auto address = reinterpret_cast<std::uintptr_t>(cache.data);
  if (tensor_bytes > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
      tensor_bytes > std::numeric_limits<std::uintptr_t>::max() - address) {
    return fail(ErrorCode::kOverflow, "paged tensor spans " + std::to_string(tensor_bytes) +
                                          " bytes from its data pointer, past the address space");
  }
  if (cache.shape[static_cast<std::size_t>(order.kv)] != 2) {
    return fail(ErrorCode::kInvalidArgument, "paged shape[" + std::to_string(order.kv) + "] (K and V) is " +
                                                 std::to_string(cache.shape[static_cast<std::size_t>(order.kv)]) +
                                                 ", not 2");
  }
  const auto extent = [&](int axis) { return static_cast<std::uint64_t>(cache.shape[static_cast<std::size_t>(axis)]); };
  // Byte strides fit: each is at most tensor_bytes (shape 1 axes aside, whose stride never multiplies).
  const auto stride = [&](int axis) {
    return extent(axis) == 1
               ? 0
               : static_cast<std::uint64_t>(cache.strides[static_cast<std::size_t>(axis)]) * cache.elem_size;
  };
  Geometry geometry;
  geometry.base = static_cast<std::byte*>(cache.data);
  geometry.num_blocks = extent(order.block);
  geometry.block_size = extent(order.slot);
  geometry.heads = extent(order.head);
  geometry.head_dim = extent(order.dim);
  geometry.elem = cache.elem_size;
  geometry.kv_stride = stride(order.kv);
  geometry.block_stride = stride(order.block);
  geometry.slot_stride = stride(order.slot);
  geometry.head_stride = stride(order.head);
  geometry.dim_stride = stride(order.dim);
  KVRELAY_TRY(const std::uint64_t row_elements, checked_mul(geometry.heads, geometry.head_dim));
  KVRELAY_TRY(geometry.row_bytes, checked_mul(row_elements, geometry.elem));
  return geometry;
}

// The span fits the block list and the cache, and the region buffers' size is representable.
Status check_span(const Geometry& geometry, const PagedSpan& span) {
  KVRELAY_TRY(const std::uint64_t end_token, checked_add(span.first_token, span.tokens));
  KVRELAY_TRY(const std::uint64_t region_bytes, checked_mul(span.tokens, geometry.row_bytes));
  if (region_bytes > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
    return fail(ErrorCode::kOverflow, "paged copy of " + std::to_string(span.tokens) + " tokens is " +
                                          std::to_string(region_bytes) + " bytes per K or V");
  }
  if (span.tokens == 0) return ok();
  const std::uint64_t needed_blocks = end_token / geometry.block_size + (end_token % geometry.block_size != 0 ? 1 : 0);
  if (span.block_ids.size() < needed_blocks) {
    return fail(ErrorCode::kOutOfRange, "paged copy up to token " + std::to_string(end_token) + " needs " +
                                            std::to_string(needed_blocks) + " block ids, got " +
                                            std::to_string(span.block_ids.size()));
  }
  for (std::uint64_t index = span.first_token / geometry.block_size; index < needed_blocks; ++index) {
    const std::int32_t block = span.block_ids[index];
    if (block < 0 || static_cast<std::uint64_t>(block) >= geometry.num_blocks) {
      return fail(ErrorCode::kOutOfRange, "paged block_ids[" + std::to_string(index) + "] = " + std::to_string(block) +
                                              " is outside the cache's " + std::to_string(geometry.num_blocks) +
                                              " blocks");
    }
  }
  return ok();
}

template <bool kGather>
inline void move_bytes(std::byte* cache, std::byte* flat, std::size_t bytes) {
  if constexpr (kGather) {
    std::memcpy(flat, cache, bytes);
  } else {
    std::memcpy(cache, flat, bytes);
  }
}

// A fixed-size copy the compiler turns into one load and store.
template <bool kGather, std::size_t kElem>
void move_elements(const Geometry& geometry, std::byte* slot_base, std::byte* flat) {
  for (std::uint64_t head = 0; head < geometry.heads; ++head) {
    std::byte* head_base = slot_base + head * geometry.head_stride;
    for (std::uint64_t dim = 0; dim < geometry.head_dim; ++dim) {
      move_bytes<kGather>(head_base + dim * geometry.dim_stride, flat, kElem);
      flat += kElem;
    }
  }
}

// Slots [first_slot, first_slot + count) of one block's K or V, to or from count contiguous rows.
template <bool kGather>
void move_block_run(const Geometry& geometry, std::byte* block_base, std::uint64_t first_slot, std::uint64_t count,
                    std::byte* flat) {
  const std::uint64_t head_bytes = geometry.head_dim * geometry.elem;
  const bool dims_contiguous = geometry.dim_stride == geometry.elem || geometry.head_dim == 1;
  const bool row_contiguous = dims_contiguous && (geometry.head_stride == head_bytes || geometry.heads == 1);
  if (row_contiguous && (geometry.slot_stride == geometry.row_bytes || count == 1)) {
    move_bytes<kGather>(block_base + first_slot * geometry.slot_stride, flat, count * geometry.row_bytes);
    return;
  }
  if (row_contiguous) {
    for (std::uint64_t slot = 0; slot < count; ++slot) {
      move_bytes<kGather>(block_base + (first_slot + slot) * geometry.slot_stride, flat + slot * geometry.row_bytes,
                          geometry.row_bytes);
    }
    return;
  }
  if (dims_contiguous) {
    // Heads apart (the CPU layout, sliced heads): head_dim runs, in the order that reads the
    // source sequentially (measured: scatter 46 -> 41 ms for 256 MiB, gather unchanged).
    if constexpr (!kGather) {
      for (std::uint64_t slot = 0; slot < count; ++slot) {
        std::byte* slot_base = block_base + (first_slot + slot) * geometry.slot_stride;
        for (std::uint64_t head = 0; head < geometry.heads; ++head) {
          move_bytes<kGather>(slot_base + head * geometry.head_stride,
                              flat + slot * geometry.row_bytes + head * head_bytes, head_bytes);
        }
      }
    } else {
      for (std::uint64_t head = 0; head < geometry.heads; ++head) {
        std::byte* head_base = block_base + head * geometry.head_stride + first_slot * geometry.slot_stride;
        for (std::uint64_t slot = 0; slot < count; ++slot) {
          move_bytes<kGather>(head_base + slot * geometry.slot_stride,
                              flat + slot * geometry.row_bytes + head * head_bytes, head_bytes);
        }
      }
    }
    return;
  }
  for (std::uint64_t slot = 0; slot < count; ++slot) {
    std::byte* slot_base = block_base + (first_slot + slot) * geometry.slot_stride;
    std::byte* row = flat + slot * geometry.row_bytes;
    switch (geometry.elem) {
      case 1:
        move_elements<kGather, 1>(geometry, slot_base, row);
        break;
      case 2:
        move_elements<kGather, 2>(geometry, slot_base, row);
        break;
      default:
        move_elements<kGather, 4>(geometry, slot_base, row);
        break;
    }
  }
}

template <bool kGather>
void move_span(const Geometry& geometry, const PagedSpan& span, std::byte* k_flat, std::byte* v_flat) {
  const std::uint64_t end_token = span.first_token + span.tokens;
  for (std::uint64_t kv = 0; kv < 2; ++kv) {
    std::byte* flat = kv == 0 ? k_flat : v_flat;
    std::byte* kv_base = geometry.base + kv * geometry.kv_stride;
    std::uint64_t token = span.first_token;
    while (token < end_token) {
      const std::uint64_t index = token / geometry.block_size;
      const std::uint64_t slot = token % geometry.block_size;
      const std::uint64_t count = std::min(geometry.block_size - slot, end_token - token);
      std::byte* block_base = kv_base + static_cast<std::uint64_t>(span.block_ids[index]) * geometry.block_stride;
      move_block_run<kGather>(geometry, block_base, slot, count,
                              flat + (token - span.first_token) * geometry.row_bytes);
      token += count;
    }
  }
}

template <bool kGather>
Status copy_paged(const PagedTensorView& cache, const PagedSpan& span, std::byte* k_flat, std::byte* v_flat) {
  KVRELAY_TRY(const Geometry geometry, describe(cache));
  if (k_flat == nullptr || v_flat == nullptr) {
    return fail(ErrorCode::kInvalidArgument,
                kGather ? "paged gather destination is null" : "paged scatter source is null");
  }
  if (span.block_ids.data() == nullptr && !span.block_ids.empty()) {
    return fail(ErrorCode::kInvalidArgument, "paged block_ids is null");
  }
  KVRELAY_TRY(check_span(geometry, span));
  move_span<kGather>(geometry, span, k_flat, v_flat);
  return ok();
}

}  // namespace paged_copy_detail

Status gather_paged(const PagedTensorView& cache, const PagedSpan& span, void* k_dst, void* v_dst) {
  return paged_copy_detail::copy_paged<true>(cache, span, static_cast<std::byte*>(k_dst),
                                             static_cast<std::byte*>(v_dst));
}

Status scatter_paged(const PagedTensorView& cache, const PagedSpan& span, const void* k_src, const void* v_src) {
  // The flat side is only read when scattering; one loop body serves both directions.
  return paged_copy_detail::copy_paged<false>(cache, span, static_cast<std::byte*>(const_cast<void*>(k_src)),
                                              static_cast<std::byte*>(const_cast<void*>(v_src)));
}

}  // namespace kvrelay::connectors
