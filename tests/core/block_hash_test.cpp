#include "kvrelay/core/block_hash.h"

#include <xxhash.h>

#include <catch2/catch.hpp>

#include <cstring>
#include <numeric>
#include <vector>

using kvrelay::BlockHash;
using kvrelay::TokenId;

namespace {

std::vector<TokenId> iota_tokens(std::size_t count, TokenId first = 1) {
  std::vector<TokenId> tokens(count);
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

}  // namespace

TEST_CASE("block hash is xxh3 over parent, fingerprint and tokens", "[core][block_hash]") {
  const auto tokens = iota_tokens(16);
  unsigned char bytes[16 + 64];
  const BlockHash parent = kvrelay::kRootBlockHash;
  const std::uint64_t fingerprint = 0x1234;
  std::memcpy(bytes, &parent, 8);
  std::memcpy(bytes + 8, &fingerprint, 8);
  std::memcpy(bytes + 16, tokens.data(), 64);
  CHECK(kvrelay::hash_block(parent, fingerprint, tokens) == XXH3_64bits(bytes, sizeof(bytes)));
}

TEST_CASE("block hashes are stable (fixed vectors)", "[core][block_hash]") {
  const auto hashes = kvrelay::hash_blocks(0x1234, iota_tokens(40));
  REQUIRE(hashes.size() == 2);  // 40 tokens: two full blocks, the partial third has no hash
  CHECK(hashes[0] == 0x7d0460db43f4307dULL);
  CHECK(hashes[1] == 0x994dc6f2b2b7e84aULL);
}

TEST_CASE("block hashes chain: a shared prefix gives shared hashes, a change propagates", "[core][block_hash]") {
  auto tokens_a = iota_tokens(64);
  auto tokens_b = tokens_a;
  tokens_b[20] = 999;  // inside block 1
  const auto hashes_a = kvrelay::hash_blocks(7, tokens_a);
  const auto hashes_b = kvrelay::hash_blocks(7, tokens_b);
  REQUIRE(hashes_a.size() == 4);
  CHECK(hashes_a[0] == hashes_b[0]);
  for (std::size_t block = 1; block < 4; ++block)
    CHECK(hashes_a[block] != hashes_b[block]);

  // Extending a context keeps every earlier hash: delta KV needs nothing more.
  auto extended = tokens_a;
  extended.insert(extended.end(), {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20});
  const auto hashes_extended = kvrelay::hash_blocks(7, extended);
  REQUIRE(hashes_extended.size() == 5);
  CHECK(std::equal(hashes_a.begin(), hashes_a.end(), hashes_extended.begin()));
}

TEST_CASE("block hashes depend on the model fingerprint and the block size", "[core][block_hash]") {
  const auto tokens = iota_tokens(32);
  CHECK(kvrelay::hash_blocks(1, tokens) != kvrelay::hash_blocks(2, tokens));
  CHECK(kvrelay::hash_blocks(1, tokens, 8).size() == 4);
  CHECK(kvrelay::hash_blocks(1, tokens, 8)[0] != kvrelay::hash_blocks(1, tokens, 16)[0]);
  CHECK(kvrelay::hash_blocks(1, iota_tokens(15)).empty());
  CHECK(kvrelay::hash_blocks(1, tokens, 0).empty());
}
