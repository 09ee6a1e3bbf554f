#include "kvrelay/core/block_hash.h"

#include <xxhash.h>

#include <fmt/format.h>

#include <charconv>
#include <cstring>

namespace kvrelay {

BlockHash hash_block(BlockHash parent, std::uint64_t fingerprint_id, std::span<const TokenId> block_tokens) noexcept {
  // One contiguous buffer keeps this a single XXH3 call; blocks are small (64 bytes at 16 tokens).
  constexpr std::size_t kInlineBytes = 16 + 64 * sizeof(TokenId);
  const std::size_t bytes = 16 + block_tokens.size_bytes();
  unsigned char inline_buffer[kInlineBytes];
  std::vector<unsigned char> heap_buffer;
  unsigned char* buffer = inline_buffer;
  if (bytes > kInlineBytes) {
    heap_buffer.resize(bytes);
    buffer = heap_buffer.data();
  }
  std::memcpy(buffer, &parent, sizeof(parent));
  std::memcpy(buffer + 8, &fingerprint_id, sizeof(fingerprint_id));
  if (!block_tokens.empty()) std::memcpy(buffer + 16, block_tokens.data(), block_tokens.size_bytes());
  return XXH3_64bits(buffer, bytes);
}

std::vector<BlockHash> hash_blocks(std::uint64_t fingerprint_id, std::span<const TokenId> tokens,
                                   std::uint32_t block_tokens, BlockHash root) {
  std::vector<BlockHash> hashes;
  if (block_tokens == 0) return hashes;
  const std::size_t full_blocks = tokens.size() / block_tokens;
  hashes.reserve(full_blocks);
  BlockHash parent = root;
  for (std::size_t block = 0; block < full_blocks; ++block) {
    parent = hash_block(parent, fingerprint_id, tokens.subspan(block * block_tokens, block_tokens));
    hashes.push_back(parent);
  }
  return hashes;
}

std::string block_hash_hex(BlockHash hash) {
  return fmt::format("{:016x}", hash);
}

std::optional<BlockHash> parse_block_hash_hex(std::string_view text) {
  if (text.size() != 16) return std::nullopt;
  BlockHash hash = 0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), hash, 16);
  if (error != std::errc() || end != text.data() + text.size()) return std::nullopt;
  return hash;
}

}  // namespace kvrelay
