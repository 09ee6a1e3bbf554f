#include "kvrelay/core/kv_layout.h"

#include <fmt/format.h>

namespace kvrelay {

Result<std::uint64_t> checked_mul(std::uint64_t lhs, std::uint64_t rhs) {
  std::uint64_t product = 0;
  if (__builtin_mul_overflow(lhs, rhs, &product)) {
    return fail(ErrorCode::kOverflow, fmt::format("{} * {} overflows 64 bits", lhs, rhs));
  }
  return product;
}

Result<std::uint64_t> checked_add(std::uint64_t lhs, std::uint64_t rhs) {
  std::uint64_t sum = 0;
  if (__builtin_add_overflow(lhs, rhs, &sum)) {
    return fail(ErrorCode::kOverflow, fmt::format("{} + {} overflows 64 bits", lhs, rhs));
  }
  return sum;
}

Status KvLayout::validate() const {
  if (layers == 0 || layers > kMaxLayers) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("layout layers {} outside 1..{}", layers, kMaxLayers));
  }
  if (kv_heads == 0 || kv_heads > kMaxKvHeads) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("layout kv_heads {} outside 1..{}", kv_heads, kMaxKvHeads));
  }
  if (head_dim == 0 || head_dim > kMaxHeadDim) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("layout head_dim {} outside 1..{}", head_dim, kMaxHeadDim));
  }
  if (!dtype_from_wire(static_cast<std::uint8_t>(dtype))) {
    return fail(ErrorCode::kInvalidArgument, fmt::format("layout dtype {} unknown", static_cast<unsigned>(dtype)));
  }
  return ok();
}

Result<std::uint64_t> KvLayout::elements_per_token_row() const {
  KVRELAY_TRY(validate());
  return static_cast<std::uint64_t>(kv_heads) * head_dim;  // both bounded: cannot overflow
}

Result<std::uint64_t> KvLayout::tensor_bytes() const {
  KVRELAY_TRY(auto row, elements_per_token_row());
  KVRELAY_TRY(auto elements, checked_mul(row, tokens));
  return checked_mul(elements, dtype_size(dtype));
}

Result<std::uint64_t> KvLayout::bytes_per_token() const {
  KVRELAY_TRY(auto row, elements_per_token_row());
  return row * dtype_size(dtype) * 2U * layers;  // bounded fields: at most 2^43
}

Result<std::uint64_t> KvLayout::total_bytes() const {
  KVRELAY_TRY(auto per_tensor, tensor_bytes());
  KVRELAY_TRY(auto per_layer, checked_mul(per_tensor, 2));
  return checked_mul(per_layer, layers);
}

Result<std::uint64_t> KvLayout::tensor_offset(std::uint32_t layer, bool is_value) const {
  if (layer >= layers) {
    return fail(ErrorCode::kOutOfRange, fmt::format("layer {} >= layers {}", layer, layers));
  }
  KVRELAY_TRY(auto per_tensor, tensor_bytes());
  const std::uint64_t index = static_cast<std::uint64_t>(layer) * 2U + (is_value ? 1U : 0U);
  return checked_mul(per_tensor, index);
}

std::string KvLayout::describe() const {
  return fmt::format("{}x{}x{} {}, {} tokens", layers, kv_heads, head_dim, dtype_name(dtype), tokens);
}

}  // namespace kvrelay
