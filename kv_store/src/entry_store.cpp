#include "kvrelay/kv_store/entry_store.h"

#include <fmt/format.h>

#include <algorithm>

#include "kvrelay/kv_store/entry_chain.h"

namespace kvrelay::kv_store {

namespace {

// The keys of an entry's blocks but its last, in the scope its key was filed in (its token ids
// must hash to that key, so nothing unverified is indexed); none for entries without a chain.
std::vector<EntryKey> indexed_prefix_keys(const EntryKey& key, const StoredEntry& entry) {
  if (!entry.chain || entry.info.layout.layers == 0) return {};
  const EntryChain& chain = *entry.chain;
  const std::size_t count = chain.tokens.size();
  if (chain.block_tokens == 0 || count != entry.info.layout.tokens || count % chain.block_tokens != 0 ||
      count < 2 * std::size_t{chain.block_tokens}) {
    return {};
  }
  for (const auto scope : {ChainScope::kUnscoped, ChainScope::kTenant}) {
    if (scope == ChainScope::kUnscoped && !chain.tenant.empty()) continue;
    const auto hashes = chain_keys(key.model_id, chain, scope);
    if (hashes.back() != key.context_hash) continue;
    std::vector<EntryKey> keys;
    keys.reserve(hashes.size() - 1);
    for (std::size_t block = 0; block + 1 < hashes.size(); ++block)
      keys.push_back({key.model_id, hashes[block]});
    return keys;
  }
  return {};
}

}  // namespace

Status InMemoryEntryStore::put(const EntryKey& key, std::shared_ptr<const StoredEntry> entry) {
  if (!entry) return fail(ErrorCode::kInvalidArgument, "null entry");
  const std::uint64_t size = entry->info.bytes;
  auto prefix_keys = indexed_prefix_keys(key, *entry);  // hashed before the lock is taken
  std::lock_guard lock(mutex_);
  if (size > budget_) {
    return fail(ErrorCode::kResourceExhausted,
                fmt::format("entry of {} bytes exceeds the store budget {}", size, budget_));
  }
  if (auto found = entries_.find(key); found != entries_.end()) {
    if (!entry->fidelity.at_least_as_exact_as(found->second.entry->fidelity)) {
      ++refused_downgrades_;
      return fail(ErrorCode::kAlreadyExists,
                  fmt::format("more exact KV is already filed under this key; a {} copy does not replace it",
                              entry->fidelity.lossy_codec));
    }
    erase_locked(found);
  }
  while (bytes_ + size > budget_ && !recency_.empty()) {
    erase_locked(entries_.find(recency_.back()));
    ++evictions_;
  }
  for (std::size_t block = 0; block < prefix_keys.size(); ++block)
    prefix_index_[prefix_keys[block]].push_back({key, block + 1});
  recency_.push_front(key);
  entries_.emplace(key, Slot{std::move(entry), recency_.begin(), std::move(prefix_keys)});
  bytes_ += size;
  return ok();
}

std::shared_ptr<const StoredEntry> InMemoryEntryStore::get(const EntryKey& key) {
  std::lock_guard lock(mutex_);
  const auto found = entries_.find(key);
  if (found == entries_.end()) return nullptr;
  recency_.splice(recency_.begin(), recency_, found->second.recency);
  return found->second.entry;
}

bool InMemoryEntryStore::erase(const EntryKey& key) {
  std::lock_guard lock(mutex_);
  const auto found = entries_.find(key);
  if (found == entries_.end()) return false;
  erase_locked(found);
  return true;
}

EntryStoreStats InMemoryEntryStore::clear() {
  std::lock_guard lock(mutex_);
  const EntryStoreStats dropped{entries_.size(), bytes_, 0};
  entries_.clear();
  recency_.clear();
  prefix_index_.clear();
  bytes_ = 0;
  return dropped;
}

EntryStoreStats InMemoryEntryStore::stats() {
  std::lock_guard lock(mutex_);
  return {entries_.size(), bytes_, evictions_, refused_downgrades_};
}

std::vector<EntryKey> InMemoryEntryStore::recent_keys(std::size_t limit, const EntryFilter& shown) {
  std::lock_guard lock(mutex_);
  std::vector<EntryKey> keys;
  keys.reserve(std::min(limit, recency_.size()));
  for (const EntryKey& key : recency_) {
    if (keys.size() >= limit) break;
    if (shown && !shown(*entries_.at(key).entry)) continue;
    keys.push_back(key);
  }
  return keys;
}

bool InMemoryEntryStore::make_arena_room(const ShmArena& arena, std::uint64_t bytes) {
  // Only entries nobody else holds (no lease, no reader in this process) free their block when
  // dropped; if even all of them and the free space together are too few bytes, drop nothing.
  const auto evictable = [&](const Slot& slot) {
    const auto& block = slot.entry->block;
    return block && &block->arena() == &arena && slot.entry.use_count() == 1;
  };
  std::lock_guard lock(mutex_);
  const auto arena_stats = arena.stats();
  std::uint64_t could_free = arena_stats.capacity - arena_stats.in_use;
  for (const auto& [key, slot] : entries_) {
    if (evictable(slot)) could_free += slot.entry->block->reserved();
  }
  if (could_free < bytes) return false;
  bool dropped = false;
  auto candidate = recency_.end();
  while (!arena.fits(bytes) && candidate != recency_.begin()) {
    --candidate;  // from the least recently used end
    const auto found = entries_.find(*candidate);
    if (!evictable(found->second)) continue;
    candidate = std::next(candidate);  // erasing invalidates the element, not its neighbour
    erase_locked(found);
    ++evictions_;
    dropped = true;
  }
  return dropped;
}

std::optional<PrefixHit> InMemoryEntryStore::find_prefix(const EntryKey& key, const PrefixFilter& accepts) {
  std::lock_guard lock(mutex_);
  const auto rows = prefix_index_.find(key);
  if (rows == prefix_index_.end()) return std::nullopt;
  auto best = entries_.end();
  std::size_t best_blocks = 0;
  Fidelity best_fidelity;
  for (auto row = rows->second.rbegin(); row != rows->second.rend(); ++row) {  // most recently filed first
    const auto found = entries_.find(row->entry);
    if (found == entries_.end()) continue;  // never: erasing an entry drops its rows
    const StoredEntry& entry = *found->second.entry;
    if (accepts && !accepts(entry, row->blocks)) continue;
    auto fidelity = entry.fidelity.prefix(row->blocks * std::uint64_t{entry.chain->block_tokens});
    // An older row replaces a newer one only when its prefix is strictly more exact.
    if (best == entries_.end() ||
        (fidelity.at_least_as_exact_as(best_fidelity) && !best_fidelity.at_least_as_exact_as(fidelity))) {
      best = found;
      best_blocks = row->blocks;
      best_fidelity = std::move(fidelity);
    }
  }
  if (best == entries_.end()) return std::nullopt;
  recency_.splice(recency_.begin(), recency_, best->second.recency);
  return PrefixHit{best->second.entry, best_blocks};
}

void InMemoryEntryStore::erase_locked(std::unordered_map<EntryKey, Slot, EntryKeyHash>::iterator found) {
  for (const EntryKey& prefix_key : found->second.prefix_keys) {
    const auto rows = prefix_index_.find(prefix_key);
    if (rows == prefix_index_.end()) continue;
    std::erase_if(rows->second, [&](const PrefixRow& row) { return row.entry == found->first; });
    if (rows->second.empty()) prefix_index_.erase(rows);
  }
  bytes_ -= found->second.entry->info.bytes;
  recency_.erase(found->second.recency);
  entries_.erase(found);
}

}  // namespace kvrelay::kv_store
