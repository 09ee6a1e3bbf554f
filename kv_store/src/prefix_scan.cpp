#include "kvrelay/kv_store/prefix_scan.h"

#include <algorithm>

#include "kvrelay/kv_store/entry_chain.h"

namespace kvrelay::kv_store {

bool FidelityRule::accepts(const Fidelity& fidelity) const {
  switch (kind_) {
    case Kind::kExactOnly:
      return fidelity.is_exact();
    case Kind::kExactOrCodec:
      return fidelity.is_exact() || fidelity.lossy_codec == codec_;
    case Kind::kAny:
      return true;
  }
  return false;
}

HeldPrefix longest_held_prefix(EntryStore& store, const PrefixQuery& query) {
  const bool longer = query.allow_longer && query.block_tokens != 0;
  for (std::size_t blocks = std::min(query.chain.size(), query.max_blocks); blocks > 0; --blocks) {
    const EntryKey key{query.model_id, query.chain[blocks - 1]};
    auto entry = store.get(key);
    const bool usable = entry && entry->info.layout.layers != 0 &&
                        (query.block_tokens == 0 || entry->info.layout.tokens == blocks * query.block_tokens) &&
                        query.fidelity.accepts(entry->fidelity);
    if (usable) return {std::move(entry), blocks};
    if (!longer) continue;
    const std::uint64_t tokens = blocks * query.block_tokens;
    auto hit = store.find_prefix(key, [&](const StoredEntry& held, std::size_t held_blocks) {
      return held_blocks == blocks && held.chain && held.chain->block_tokens == query.block_tokens &&
             held.info.layout.tokens > tokens && query.fidelity.accepts(held.fidelity.prefix(tokens));
    });
    if (hit) return {std::move(hit->entry), blocks};
  }
  return {};
}

}  // namespace kvrelay::kv_store
