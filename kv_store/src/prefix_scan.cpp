#include "kvrelay/kv_store/prefix_scan.h"

#include <algorithm>

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
  for (std::size_t blocks = std::min(query.chain.size(), query.max_blocks); blocks > 0; --blocks) {
    auto entry = store.get({query.model_id, query.chain[blocks - 1]});
    if (!entry || entry->info.layout.layers == 0) continue;
    if (query.block_tokens != 0 && entry->info.layout.tokens != blocks * query.block_tokens) continue;
    if (!query.fidelity.accepts(entry->fidelity)) continue;
    return {std::move(entry), blocks};
  }
  return {};
}

}  // namespace kvrelay::kv_store
