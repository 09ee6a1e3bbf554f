#include "kvrelay/kv_store/entry_chain.h"

#include <xxhash.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace kvrelay::kv_store {

namespace {

constexpr std::string_view kScopeLabel{"kvrelay tenant scope v1\0", 24};

}  // namespace

EntryKey tenant_scoped_key(const EntryKey& key, std::string_view tenant) {
  std::string message(kScopeLabel);
  message.append(reinterpret_cast<const char*>(&key.context_hash), sizeof(key.context_hash));
  message.append(tenant);
  return {key.model_id, XXH3_64bits(message.data(), message.size())};
}

std::vector<BlockHash> chain_keys(std::uint64_t model_id, const EntryChain& chain, ChainScope scope) {
  auto hashes = hash_blocks(model_id, chain.tokens, chain.block_tokens, chain.root);
  if (scope == ChainScope::kTenant) {
    for (auto& hash : hashes)
      hash = tenant_scoped_key({model_id, hash}, chain.tenant).context_hash;
  }
  return hashes;
}

Status verify_chain(const EntryKey& key, std::uint64_t tokens, const EntryChain& chain, ChainScope scope) {
  if (chain.block_tokens == 0 || chain.tokens.size() != tokens || tokens % chain.block_tokens != 0 || tokens == 0) {
    return fail(ErrorCode::kChainMismatch,
                fmt::format("the entry holds {} tokens but carries {} token ids in blocks of {}", tokens,
                            chain.tokens.size(), chain.block_tokens));
  }
  if (scope == ChainScope::kUnscoped && !chain.tenant.empty()) {
    return fail(ErrorCode::kChainMismatch,
                fmt::format("the entry names tenant '{}', and this node's policy has no tenants", chain.tenant));
  }
  const auto keys = chain_keys(key.model_id, chain, scope);
  if (keys.back() != key.context_hash) {
    return fail(ErrorCode::kChainMismatch,
                fmt::format("the entry's {} token ids hash to {:016x}, not to the key {:016x} it is filed under",
                            tokens, keys.back(), key.context_hash));
  }
  return ok();
}

Status verify_chain_keys(std::uint64_t model_id, const EntryChain& chain, ChainScope scope,
                         std::span<const BlockHash> expected) {
  if (chain.block_tokens == 0 || chain.tokens.size() != expected.size() * chain.block_tokens) {
    return fail(ErrorCode::kChainMismatch, fmt::format("{} token ids in blocks of {} cannot name {} blocks",
                                                       chain.tokens.size(), chain.block_tokens, expected.size()));
  }
  const auto keys = chain_keys(model_id, chain, scope);
  const auto differs = std::mismatch(keys.begin(), keys.end(), expected.begin());
  if (differs.first != keys.end()) {
    return fail(ErrorCode::kChainMismatch,
                fmt::format("the token ids of block {} hash to {:016x}, not to the {:016x} asked for",
                            differs.first - keys.begin(), *differs.first, *differs.second));
  }
  return ok();
}

EntryChain chain_prefix(const EntryChain& chain, std::uint64_t tokens) {
  EntryChain prefix;
  prefix.block_tokens = chain.block_tokens;
  prefix.root = chain.root;
  prefix.tenant = chain.tenant;
  const auto kept = std::min<std::uint64_t>(tokens, chain.tokens.size());
  prefix.tokens.assign(chain.tokens.begin(), chain.tokens.begin() + static_cast<std::ptrdiff_t>(kept));
  prefix.prompt_tokens = static_cast<std::uint32_t>(std::min<std::uint64_t>(chain.prompt_tokens, kept));
  return prefix;
}

void encode_chain(ByteWriter& writer, const EntryChain& chain) {
  writer.put(chain.block_tokens).put(chain.root).put_string(chain.tenant);
  writer.put(static_cast<std::uint32_t>(chain.tokens.size()));
  writer.put_bytes(std::as_bytes(std::span(chain.tokens)));
  writer.put(chain.prompt_tokens);
}

std::size_t encoded_chain_bytes(const EntryChain& chain) noexcept {
  return 4 + 8 + 2 + chain.tenant.size() + 4 + (chain.tokens.size() * sizeof(TokenId)) + 4;
}

Result<EntryChain> decode_chain(ByteReader& reader) {
  EntryChain chain;
  const auto block_tokens = reader.get<std::uint32_t>();
  const auto root = reader.get<std::uint64_t>();
  auto tenant = reader.get_string();
  const auto count = reader.get<std::uint32_t>();
  if (!block_tokens || !root || !tenant || !count) return fail(ErrorCode::kTruncated, "truncated entry chain");
  if (*block_tokens == 0) return fail(ErrorCode::kProtocol, "entry chain with a block size of 0 tokens");
  if (*count > kMaxChainTokens) {
    return fail(ErrorCode::kResourceExhausted,
                fmt::format("entry chain of {} token ids (at most {})", *count, kMaxChainTokens));
  }
  if (*count % *block_tokens != 0) {
    return fail(ErrorCode::kProtocol,
                fmt::format("entry chain of {} token ids is not whole blocks of {}", *count, *block_tokens));
  }
  const auto ids = reader.get_bytes(static_cast<std::size_t>(*count) * sizeof(TokenId));
  if (!ids) return fail(ErrorCode::kTruncated, "entry chain shorter than its token count");
  const auto prompt_tokens = reader.get<std::uint32_t>();
  if (!prompt_tokens) return fail(ErrorCode::kTruncated, "entry chain without its prompt boundary");
  if (*prompt_tokens > *count) {
    return fail(ErrorCode::kProtocol,
                fmt::format("entry chain's prompt ends at token {}, past its {} token ids", *prompt_tokens, *count));
  }
  chain.block_tokens = *block_tokens;
  chain.root = *root;
  chain.tenant = std::move(*tenant);
  chain.prompt_tokens = *prompt_tokens;
  chain.tokens.resize(*count);
  if (!ids->empty()) std::memcpy(chain.tokens.data(), ids->data(), ids->size());  // never from null
  return chain;
}

}  // namespace kvrelay::kv_store
