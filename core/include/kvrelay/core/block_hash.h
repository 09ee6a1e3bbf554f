#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kvrelay {

using TokenId = std::uint32_t;
using BlockHash = std::uint64_t;

inline constexpr std::uint32_t kDefaultBlockTokens = 16;

// Parent of the first block. A constant (not a random seed as in vLLM) so that independent
// sidecars name the same context identically.
inline constexpr BlockHash kRootBlockHash = 0x6b7672656c6179ULL;  // "kvrelay"

// hash(i) = xxh3_64(hash(i-1) || fingerprint_id || token ids of block i), all little-endian.
[[nodiscard]] BlockHash hash_block(BlockHash parent, std::uint64_t fingerprint_id,
                                   std::span<const TokenId> block_tokens) noexcept;

// Chained hashes of every *full* block of `tokens`; a trailing partial block has no hash,
// since its KV cannot be shared until the block fills.
[[nodiscard]] std::vector<BlockHash> hash_blocks(std::uint64_t fingerprint_id, std::span<const TokenId> tokens,
                                                 std::uint32_t block_tokens = kDefaultBlockTokens);

}  // namespace kvrelay
