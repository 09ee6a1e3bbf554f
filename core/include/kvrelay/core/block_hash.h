#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvrelay {

using TokenId = std::uint32_t;
using BlockHash = std::uint64_t;

inline constexpr std::uint32_t kDefaultBlockTokens = 16;

// Parent of the first block of the unsalted default chain. A constant (not a random seed as in
// vLLM) so that independent sidecars name the same context identically. Tenants and per-request
// cache salts start their chains at a root of their own (kv_transfer_params.kvrelay.chain_root,
// docs/security.md).
inline constexpr BlockHash kRootBlockHash = 0x6b7672656c6179ULL;  // "kvrelay"

// hash(i) = xxh3_64(hash(i-1) || fingerprint_id || token ids of block i), all little-endian.
[[nodiscard]] BlockHash hash_block(BlockHash parent, std::uint64_t fingerprint_id,
                                   std::span<const TokenId> block_tokens) noexcept;

// Chained hashes of every *full* block of `tokens`; a trailing partial block has no hash,
// since its KV cannot be shared until the block fills.
// `root` is hash(-1).
[[nodiscard]] std::vector<BlockHash> hash_blocks(std::uint64_t fingerprint_id, std::span<const TokenId> tokens,
                                                 std::uint32_t block_tokens = kDefaultBlockTokens,
                                                 BlockHash root = kRootBlockHash);

// A chain root as kv_transfer_params.kvrelay carries it: 16 lowercase hex digits.
[[nodiscard]] std::string block_hash_hex(BlockHash hash);
// Exactly 16 hex digits (either case); nullopt otherwise.
[[nodiscard]] std::optional<BlockHash> parse_block_hash_hex(std::string_view text);

}  // namespace kvrelay
