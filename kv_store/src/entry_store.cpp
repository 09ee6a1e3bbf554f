#include "kvrelay/kv_store/entry_store.h"

#include <fmt/format.h>

#include <algorithm>

namespace kvrelay::kv_store {

Status InMemoryEntryStore::put(const EntryKey& key, std::shared_ptr<const StoredEntry> entry) {
  if (!entry) return fail(ErrorCode::kInvalidArgument, "null entry");
  const std::uint64_t size = entry->info.bytes;
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
  recency_.push_front(key);
  entries_.emplace(key, Slot{std::move(entry), recency_.begin()});
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

void InMemoryEntryStore::erase_locked(std::unordered_map<EntryKey, Slot, EntryKeyHash>::iterator found) {
  bytes_ -= found->second.entry->info.bytes;
  recency_.erase(found->second.recency);
  entries_.erase(found);
}

}  // namespace kvrelay::kv_store
