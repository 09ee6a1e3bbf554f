#pragma once

#include <cstdint>
#include <string>

#include "kvrelay/core/dtype.h"
#include "kvrelay/core/result.h"

namespace kvrelay {

// Shape of one context's KV cache: for each layer, K then V, each [tokens, kv_heads, head_dim]
// in row-major order. Layers are stored one after another (K0 V0 K1 V1 ...). Engines with
// other layouts (paged blocks) convert at the client edge.
struct KvLayout {
  std::uint32_t layers = 0;
  std::uint32_t kv_heads = 0;
  std::uint32_t head_dim = 0;
  DType dtype = DType::kFloat32;
  std::uint64_t tokens = 0;

  // Bounds that keep every size below 2^63 even with hostile input; real models are far inside.
  static constexpr std::uint32_t kMaxLayers = 1024;
  static constexpr std::uint32_t kMaxKvHeads = 1024;
  static constexpr std::uint32_t kMaxHeadDim = 4096;

  // Checks the structural fields (non-zero, within bounds). Token count 0 is valid.
  [[nodiscard]] Status validate() const;

  // Elements in one K (or V) row of one token: kv_heads * head_dim.
  [[nodiscard]] Result<std::uint64_t> elements_per_token_row() const;
  // Bytes of one layer's K (or V) tensor.
  [[nodiscard]] Result<std::uint64_t> tensor_bytes() const;
  // Bytes of all layers, K and V, for one token.
  [[nodiscard]] Result<std::uint64_t> bytes_per_token() const;
  // Bytes of the whole cache: layers * 2 * tensor_bytes().
  [[nodiscard]] Result<std::uint64_t> total_bytes() const;
  // Byte offset of layer `layer`'s K (is_value == false) or V tensor within the whole cache.
  [[nodiscard]] Result<std::uint64_t> tensor_offset(std::uint32_t layer, bool is_value) const;

  [[nodiscard]] KvLayout with_tokens(std::uint64_t token_count) const {
    KvLayout copy = *this;
    copy.tokens = token_count;
    return copy;
  }

  // "5x4x8 fp32, 300 tokens"
  [[nodiscard]] std::string describe() const;

  friend bool operator==(const KvLayout&, const KvLayout&) = default;
};

// Overflow-checked arithmetic for sizes derived from untrusted input.
[[nodiscard]] Result<std::uint64_t> checked_mul(std::uint64_t lhs, std::uint64_t rhs);
[[nodiscard]] Result<std::uint64_t> checked_add(std::uint64_t lhs, std::uint64_t rhs);

}  // namespace kvrelay
