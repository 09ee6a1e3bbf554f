#include "push_delta.h"

#include <fmt/format.h>

#include <algorithm>

#include "kvrelay/core/kv_tokens.h"

namespace kvrelay::peer {

Result<std::shared_ptr<const kv_store::StoredEntry>> delta_head(kv_store::EntryStore& store, std::uint64_t model_id,
                                                                const kv_store::EntryChain& chain,
                                                                kv_store::ChainScope scope, std::uint64_t skip_tokens,
                                                                const KvLayout& tail_layout, bool tail_exact) {
  const std::uint64_t block = chain.block_tokens;
  if (block == 0 || skip_tokens % block != 0 || skip_tokens >= chain.tokens.size()) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("a delta leaving out {} tokens of a {}-token chain of {}-token blocks is not whole "
                            "blocks of it",
                            skip_tokens, chain.tokens.size(), block));
  }
  const auto keys = kv_store::chain_keys(model_id, chain, scope);
  const kv_store::EntryKey head_key{model_id, keys[skip_tokens / block - 1]};
  auto head = store.get(head_key);
  const auto& layout = head ? head->info.layout : KvLayout{};
  const bool fits = head && layout.tokens == skip_tokens && layout.layers == tail_layout.layers &&
                    layout.kv_heads == tail_layout.kv_heads && layout.head_dim == tail_layout.head_dim &&
                    layout.dtype == tail_layout.dtype;
  const auto prefix_end = chain.tokens.begin() + static_cast<std::ptrdiff_t>(skip_tokens);
  const bool same_tokens = fits && head->chain != nullptr && head->chain->tenant == chain.tenant &&
                           head->chain->tokens.size() == skip_tokens &&
                           std::equal(chain.tokens.begin(), prefix_end, head->chain->tokens.begin());
  if (!same_tokens || (tail_exact && !head->fidelity.is_exact())) {
    return fail(ErrorCode::kNotFound,
                fmt::format("prefix_gone: this sidecar no longer holds the first {} tokens the delta leaves out; "
                            "push the whole entry",
                            skip_tokens));
  }
  return head;
}

Result<std::shared_ptr<kv_store::StoredEntry>> join_delta(const kv_store::StoredEntry& head,
                                                          const KvLayout& tail_layout, std::span<const std::byte> tail,
                                                          WarmBufferPool& buffers, kv_store::ShmArena* arena) {
  KVRELAY_TRY(const auto view, kv_store::view_entry(head));
  const KvLayout joined = head.info.layout.with_tokens(head.info.layout.tokens + tail_layout.tokens);
  KVRELAY_TRY(const std::uint64_t total, joined.total_bytes());
  auto bytes = buffers.take(static_cast<std::size_t>(total));
  KVRELAY_TRY(join_tokens(head.info.layout, view.bytes(), tail_layout, tail, bytes.bytes()));
  return kv_store::make_stored_entry(joined, bytes.bytes(), arena);
}

}  // namespace kvrelay::peer
