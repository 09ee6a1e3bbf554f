// Entry chains: the token ids a receiver hashes to the key it is asked to file KV under.

#include "kvrelay/kv_store/entry_chain.h"

#include <catch2/catch.hpp>

#include <vector>

using namespace kvrelay;
using namespace kvrelay::kv_store;

namespace {

constexpr std::uint64_t kChainModel = 77;

EntryChain three_blocks() {
  EntryChain chain;
  chain.block_tokens = 4;
  for (TokenId token = 0; token < 12; ++token)
    chain.tokens.push_back(100 + token);
  return chain;
}

}  // namespace

TEST_CASE("a chain verifies against the key of its last block, and nothing else", "[kv_store][unit]") {
  const auto chain = three_blocks();
  const auto hashes = hash_blocks(kChainModel, chain.tokens, 4);
  REQUIRE(hashes.size() == 3);
  CHECK(chain_keys(kChainModel, chain, ChainScope::kUnscoped) == hashes);
  const EntryKey key{kChainModel, hashes.back()};
  CHECK(verify_chain(key, 12, chain, ChainScope::kUnscoped));
  CHECK(verify_chain_keys(kChainModel, chain, ChainScope::kUnscoped, hashes));

  auto changed = chain;
  changed.tokens[5] ^= 1U;
  CHECK(verify_chain(key, 12, changed, ChainScope::kUnscoped).error().code == ErrorCode::kChainMismatch);
  const auto mismatch = verify_chain_keys(kChainModel, changed, ChainScope::kUnscoped, hashes);
  REQUIRE_FALSE(mismatch);
  CHECK_THAT(mismatch.error().message, Catch::Contains("block 1"));  // the first block that differs
  CHECK_FALSE(verify_chain(key, 8, chain, ChainScope::kUnscoped));   // the entry holds fewer tokens
  CHECK_FALSE(verify_chain({kChainModel + 1, hashes.back()}, 12, chain, ChainScope::kUnscoped));  // another model
  CHECK_FALSE(verify_chain_keys(kChainModel, chain, ChainScope::kUnscoped, std::span(hashes).first(2)));

  // A prefix is the chain of its own blocks.
  const auto prefix = chain_prefix(chain, 8);
  CHECK(verify_chain({kChainModel, hashes[1]}, 8, prefix, ChainScope::kUnscoped));
}

TEST_CASE("a scoped store files a chain under its tenant's keys, and an unscoped one refuses a tenant",
          "[kv_store][unit]") {
  auto chain = three_blocks();
  chain.tenant = "acme";
  const auto unscoped = hash_blocks(kChainModel, chain.tokens, 4);
  const EntryKey scoped = tenant_scoped_key({kChainModel, unscoped.back()}, "acme");
  CHECK(verify_chain(scoped, 12, chain, ChainScope::kTenant));
  CHECK_FALSE(verify_chain({kChainModel, unscoped.back()}, 12, chain, ChainScope::kTenant));
  CHECK_THAT(verify_chain({kChainModel, unscoped.back()}, 12, chain, ChainScope::kUnscoped).error().message,
             Catch::Contains("tenant 'acme'"));
  auto globex = chain;
  globex.tenant = "globex";
  CHECK_FALSE(verify_chain(scoped, 12, globex, ChainScope::kTenant));
}

TEST_CASE("chains round-trip on the wire and hostile ones are refused by name", "[kv_store][unit]") {
  auto chain = three_blocks();
  chain.root = 0xfeedULL;
  chain.tenant = "t1";
  chain.prompt_tokens = 5;  // issue #28: where the publisher's prompt ends travels with the ids
  ByteWriter writer;
  encode_chain(writer, chain);
  CHECK(writer.bytes().size() == encoded_chain_bytes(chain));
  {
    ByteReader reader(writer.bytes());
    const auto decoded = decode_chain(reader);
    REQUIRE(decoded);
    CHECK(decoded.value() == chain);
    CHECK(reader.remaining() == 0);
  }
  {
    ByteReader reader(std::span(writer.bytes()).first(writer.bytes().size() - 1));
    CHECK(decode_chain(reader).error().code == ErrorCode::kTruncated);
  }
  const auto header_only = [](std::uint32_t block_tokens, std::uint32_t count) {
    ByteWriter hostile;
    hostile.put(block_tokens).put(std::uint64_t{1}).put_string("").put(count);
    return hostile;
  };
  {
    auto hostile = header_only(0, 0);
    ByteReader reader(hostile.bytes());
    CHECK(decode_chain(reader).error().code == ErrorCode::kProtocol);
  }
  {
    auto hostile = header_only(3, 4);  // not whole blocks
    ByteReader reader(hostile.bytes());
    CHECK(decode_chain(reader).error().code == ErrorCode::kProtocol);
  }
  {
    auto hostile = header_only(1, kMaxChainTokens + 1);  // refused before reading the ids
    ByteReader reader(hostile.bytes());
    CHECK(decode_chain(reader).error().code == ErrorCode::kResourceExhausted);
  }
}

TEST_CASE("a chain's prompt boundary is cut with its prefix and checked on the wire", "[kv_store][unit]") {
  auto chain = three_blocks();
  chain.prompt_tokens = static_cast<std::uint32_t>(chain.tokens.size() - 1);
  const auto head = chain_prefix(chain, chain.block_tokens);
  CHECK(head.prompt_tokens == chain.block_tokens);  // all of the head is prompt
  chain.prompt_tokens = 0;
  CHECK(chain_prefix(chain, chain.block_tokens).prompt_tokens == 0);  // unknown stays unknown

  chain.prompt_tokens = static_cast<std::uint32_t>(chain.tokens.size() + 1);  // past the ids
  ByteWriter writer;
  encode_chain(writer, chain);
  ByteReader reader(writer.bytes());
  const auto refused = decode_chain(reader);
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::kProtocol);
  CHECK(refused.error().message.find("prompt ends at token") != std::string::npos);
}
