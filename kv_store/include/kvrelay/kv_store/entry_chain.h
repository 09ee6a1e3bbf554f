#pragma once

// The token ids an entry's key is the block-hash chain of (issue #25, "integrity of what
// arrives"). An entry that leaves its node carries them, and every receiver recomputes the
// chain before filing it: a buggy or hostile peer cannot file KV under another context's key.

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/byte_io.h"
#include "kvrelay/core/result.h"
#include "kvrelay/kv_store/entry.h"

namespace kvrelay::kv_store {

struct EntryChain {
  std::uint32_t block_tokens = kDefaultBlockTokens;
  BlockHash root = kRootBlockHash;  // hash(-1): the unsalted root, or a tenant's (broker/tenant_chain.h)
  std::string tenant;               // the store scope the entry is filed in; "" the default tenant
  std::vector<TokenId> tokens;      // whole blocks only
  // Where the publisher's prompt ends among `tokens` (issue #28): the tokens before it are the
  // prompt's KV, the rest the answer it generated (what audit spans T1 and T2 move). 0: unknown.
  std::uint32_t prompt_tokens = 0;
  friend bool operator==(const EntryChain&, const EntryChain&) = default;
};

// The most token ids one chain carries on a wire (4 MiB of them).
inline constexpr std::uint32_t kMaxChainTokens = 1U << 20;

// Where a policy has tenants, every entry is filed under a key that also names its tenant:
// xxh3_64 of a tag, the chain hash and the tenant id. Never equal to the unscoped key (with
// overwhelming probability), so nothing filed unscoped is served scoped.
[[nodiscard]] EntryKey tenant_scoped_key(const EntryKey& key, std::string_view tenant);

// How a store files chains: unscoped (a policy without tenants) or by tenant.
enum class ChainScope : std::uint8_t { kUnscoped, kTenant };

// The key each block of `chain` is filed under, first block first.
[[nodiscard]] std::vector<BlockHash> chain_keys(std::uint64_t model_id, const EntryChain& chain, ChainScope scope);

// kChainMismatch unless `chain` is whole blocks of exactly `tokens` tokens whose last block is
// filed under `key` (a tenant only in a scoped store).
[[nodiscard]] Status verify_chain(const EntryKey& key, std::uint64_t tokens, const EntryChain& chain, ChainScope scope);

// kChainMismatch unless the keys of `chain`'s blocks are exactly `expected`, first block first
// (a fetched prefix against the chain that was asked for).
[[nodiscard]] Status verify_chain_keys(std::uint64_t model_id, const EntryChain& chain, ChainScope scope,
                                       std::span<const BlockHash> expected);

// The first `tokens` tokens (whole blocks) of `chain`; its prompt boundary within them.
[[nodiscard]] EntryChain chain_prefix(const EntryChain& chain, std::uint64_t tokens);

// Wire form (docs/wire-format.md, "Entry chains"): u32 block_tokens, u64 root, u16-length tenant,
// u32 count, count u32 token ids, u32 prompt_tokens (wire version 6). Decoding refuses more than
// kMaxChainTokens, a zero block size, a count that is not whole blocks and a prompt boundary
// past the ids.
void encode_chain(ByteWriter& writer, const EntryChain& chain);
[[nodiscard]] Result<EntryChain> decode_chain(ByteReader& reader);
[[nodiscard]] std::size_t encoded_chain_bytes(const EntryChain& chain) noexcept;

}  // namespace kvrelay::kv_store
