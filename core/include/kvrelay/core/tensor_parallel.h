#pragma once

#include <cstdint>

namespace kvrelay {

// KV heads one tensor-parallel rank holds: an equal share, or one replicated head where there are
// fewer heads than ranks (as vLLM shards them). kv_heads % tp_size != 0 has no shard: 0.
[[nodiscard]] constexpr std::uint32_t shard_kv_heads(std::uint32_t kv_heads, std::uint32_t tp_size) noexcept {
  if (tp_size <= 1) return kv_heads;
  if (tp_size > kv_heads) return 1;
  return kv_heads % tp_size == 0 ? kv_heads / tp_size : 0;
}

}  // namespace kvrelay
