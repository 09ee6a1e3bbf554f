#include "kvrelay/kv_store/entry_store.h"

#include <fmt/format.h>

#include <algorithm>

#include "kvrelay/kv_store/entry_chain.h"

namespace kvrelay::kv_store {

namespace {

constexpr std::size_t kMaxStubs = 1 << 16;  // stubs kept; past it the oldest is forgotten

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

Status EntryStore::put_spilled(const EntryKey& /*key*/, std::shared_ptr<const StoredEntry> /*entry*/,
                               std::uint64_t /*quota*/) {
  return fail(ErrorCode::kUnsupported, "this store keeps no peers' spills");
}

InMemoryEntryStore::InMemoryEntryStore(std::uint64_t byte_budget, std::unique_ptr<EvictionPolicy> eviction)
    : budget_(byte_budget), eviction_(eviction ? std::move(eviction) : std::make_unique<LruEviction>()) {}

Status InMemoryEntryStore::put(const EntryKey& key, std::shared_ptr<const StoredEntry> entry) {
  return put_admitted(key, std::move(entry), {});
}

Status InMemoryEntryStore::put_admitted(const EntryKey& key, std::shared_ptr<const StoredEntry> entry,
                                        const std::function<Status(const StoredEntry&)>& admit) {
  if (!entry) return fail(ErrorCode::kInvalidArgument, "null entry");
  const auto prefix_keys = indexed_prefix_keys(key, *entry);  // hashed before the lock is taken
  const auto sink = spill_sink_.lock();                       // held past the lock: offered below
  std::vector<Spill> spills;
  Status filed = ok();
  {
    std::lock_guard lock(mutex_);
    filed = admit ? admit(*entry) : ok();
    if (filed) filed = put_locked(key, std::move(entry), prefix_keys, sink.get(), spills);
  }
  for (auto& spill : spills)
    sink->offer(spill.key, std::move(spill.entry));
  return filed;
}

Status InMemoryEntryStore::put_locked(const EntryKey& key, std::shared_ptr<const StoredEntry> entry,
                                      const std::vector<EntryKey>& prefix_keys, SpillSink* sink,
                                      std::vector<Spill>& spills) {
  const std::uint64_t size = entry->info.bytes;
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
    erase_locked(found, false);  // the policy keeps the key's history: on_put below refiles it
  }
  const auto filed = [this](const EntryKey& candidate) { return entries_.contains(candidate); };
  while (bytes_ + size > budget_) {
    const auto victims = eviction_->victims(bytes_ + size - budget_, filed);
    if (victims.empty()) break;
    for (const EntryKey& victim : victims) {
      const auto found = entries_.find(victim);
      if (found != entries_.end()) evict_locked(found, sink, spills);
    }
  }
  if (bytes_ + size > budget_) {  // only a policy that lost track of entries gets here
    eviction_->on_erase(key);
    return fail(ErrorCode::kResourceExhausted, "the store's eviction policy found nothing to drop");
  }
  // The entry is back: a stub of it stands for nothing now.
  if (const auto stub = stubs_.find(key); stub != stubs_.end()) {
    stub_order_.remove(key);
    stubs_.erase(stub);
  }
  for (std::size_t block = 0; block < prefix_keys.size(); ++block)
    prefix_index_[prefix_keys[block]].push_back({key, block + 1});
  recency_.push_front(key);
  if (entry->origin == EntryOrigin::kSpilledIn) {
    spilled_in_[entry->spilled_from] += size;
    ++spilled_in_entries_;
  }
  entries_.emplace(key, Slot{std::move(entry), recency_.begin(), prefix_keys, 0});
  bytes_ += size;
  eviction_->on_put(key, size);
  return ok();
}

void InMemoryEntryStore::evict_locked(Entries::iterator found, SpillSink* sink, std::vector<Spill>& spills) {
  const EntryKey key = found->first;
  const auto& entry = found->second.entry;
  // Spilled-in entries are a peer's, held on its behalf: they are never spilled on.
  const bool spill = sink != nullptr && entry->origin != EntryOrigin::kSpilledIn && !stubs_.contains(key) &&
                     sink->wants(key, *entry, eviction_->utility(key));
  if (spill) {
    if (stubs_.size() >= kMaxStubs) {  // the oldest stub goes: its entry is the likeliest gone at the peer too
      stubs_.erase(stub_order_.back());
      stub_order_.pop_back();
    }
    stubs_.emplace(key, Stub{key, {}, entry->fidelity, {}, entry->info.bytes, entry->info.layout.tokens, true});
    stub_order_.push_front(key);
    spills.push_back({key, entry});
  }
  erase_locked(found);
  ++budget_evictions_;  // out of the budget either way; a spill that fails stays counted here
}

void InMemoryEntryStore::hit_locked(Entries::iterator found) {
  recency_.splice(recency_.begin(), recency_, found->second.recency);
  ++found->second.hits;
  eviction_->on_hit(found->first);
}

std::shared_ptr<const StoredEntry> InMemoryEntryStore::get(const EntryKey& key) {
  std::lock_guard lock(mutex_);
  const auto found = entries_.find(key);
  if (found == entries_.end()) return nullptr;
  hit_locked(found);
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
  EntryStoreStats dropped;
  dropped.entries = entries_.size();
  dropped.bytes = bytes_;
  entries_.clear();
  recency_.clear();
  prefix_index_.clear();
  spilled_in_.clear();
  spilled_in_entries_ = 0;
  // Stubs whose push still runs end with spill_done, which then finds nothing.
  stubs_.clear();
  stub_order_.clear();
  eviction_->on_clear();
  bytes_ = 0;
  return dropped;
}

EntryStoreStats InMemoryEntryStore::stats() {
  std::lock_guard lock(mutex_);
  EntryStoreStats stats;
  stats.entries = entries_.size();
  stats.bytes = bytes_;
  stats.evictions = budget_evictions_ + arena_evictions_;
  stats.refused_downgrades = refused_downgrades_;
  stats.budget = budget_;
  stats.budget_evictions = budget_evictions_;
  stats.arena_evictions = arena_evictions_;
  stats.eviction_policy = eviction_->name();
  stats.stubs = stubs_.size();
  for (const auto& [key, stub] : stubs_)
    if (stub.in_flight) stats.spilling_bytes += stub.bytes;
  stats.spills = spills_;
  stats.spill_failures = spill_failures_;
  for (const auto& [peer, bytes] : spilled_in_)
    stats.spilled_in_bytes += bytes;
  stats.spilled_in_entries = spilled_in_entries_;
  return stats;
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
  const auto evictable_slot = [&](const Slot& slot) {
    const auto& block = slot.entry->block;
    return block && &block->arena() == &arena && slot.entry.use_count() == 1;
  };
  const auto evictable = [&](const EntryKey& key) {
    const auto found = entries_.find(key);
    return found != entries_.end() && evictable_slot(found->second);
  };
  std::lock_guard lock(mutex_);
  const auto arena_stats = arena.stats();
  std::uint64_t could_free = arena_stats.capacity - arena_stats.in_use;
  for (const auto& [key, slot] : entries_) {
    if (evictable_slot(slot)) could_free += slot.entry->block->reserved();
  }
  if (could_free < bytes) return false;
  bool dropped = false;
  // Free space is fragmented, so the bytes asked for are a first guess: ask again while it does not fit.
  while (!arena.fits(bytes)) {
    const auto free_now = arena.stats().capacity - arena.stats().in_use;
    const auto victims = eviction_->victims(bytes > free_now ? bytes - free_now : 1, evictable);
    if (victims.empty()) break;
    for (const EntryKey& victim : victims) {
      if (arena.fits(bytes)) break;
      erase_locked(entries_.find(victim));
      ++arena_evictions_;
      dropped = true;
    }
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
  hit_locked(best);  // a prefix hit is a hit on the long entry
  return PrefixHit{best->second.entry, best_blocks};
}

void InMemoryEntryStore::note_use(const EntryKey& key, int route_priority) {
  std::lock_guard lock(mutex_);
  if (entries_.contains(key)) {
    eviction_->on_use(key, route_priority);
    return;
  }
  // A prefix of longer entries: the route reads them.
  if (const auto rows = prefix_index_.find(key); rows != prefix_index_.end()) {
    for (const PrefixRow& row : rows->second)
      eviction_->on_use(row.entry, route_priority);
  }
}

std::vector<EntryListing> InMemoryEntryStore::top(std::size_t limit) {
  std::lock_guard lock(mutex_);
  std::vector<EntryListing> out;
  for (const RankedKey& ranked : eviction_->top(limit)) {
    const auto found = entries_.find(ranked.key);
    if (found == entries_.end()) continue;
    const StoredEntry& entry = *found->second.entry;
    EntryListing listing;
    listing.key = ranked.key;
    listing.bytes = entry.info.bytes;
    listing.tokens = entry.info.layout.tokens;
    listing.hits = found->second.hits;
    listing.utility = ranked.utility;
    listing.fidelity = entry.fidelity;
    listing.origin = entry.origin;
    out.push_back(std::move(listing));
  }
  return out;
}

void InMemoryEntryStore::set_spill_sink(std::weak_ptr<SpillSink> sink) {
  std::lock_guard lock(mutex_);
  spill_sink_ = std::move(sink);
}

bool InMemoryEntryStore::forget_stub(const EntryKey& key) {
  std::lock_guard lock(mutex_);
  const auto found = stubs_.find(key);
  if (found == stubs_.end()) return false;
  stub_order_.remove(key);
  stubs_.erase(found);
  return true;
}

void InMemoryEntryStore::spill_done(const EntryKey& key, const std::string& peer, bool ok, const std::string& codec) {
  std::lock_guard lock(mutex_);
  const auto found = stubs_.find(key);
  if (found == stubs_.end() || !found->second.in_flight) return;  // cleared, or the entry came back
  if (ok) {
    found->second.peer = peer;
    found->second.codec = codec;
    found->second.in_flight = false;
    ++spills_;
    return;
  }
  ++spill_failures_;
  stub_order_.remove(key);
  stubs_.erase(found);
}

Status InMemoryEntryStore::put_spilled(const EntryKey& key, std::shared_ptr<const StoredEntry> entry,
                                       std::uint64_t quota) {
  return put_admitted(key, std::move(entry), [&](const StoredEntry& spilled) -> Status {
    std::uint64_t replaced = 0;
    if (const auto found = entries_.find(key); found != entries_.end()) {
      const StoredEntry& held = *found->second.entry;
      if (held.origin != EntryOrigin::kSpilledIn || held.spilled_from != spilled.spilled_from) {
        return fail(ErrorCode::kAlreadyExists,
                    "this node holds its own entry under that key: a spill does not "
                    "replace it");
      }
      replaced = held.info.bytes;
    }
    const auto counted = spilled_in_.find(spilled.spilled_from);
    const std::uint64_t held = (counted != spilled_in_.end() ? counted->second : 0) - replaced;
    if (held > quota || spilled.info.bytes > quota - held) {
      return fail(ErrorCode::kResourceExhausted,
                  fmt::format("spills from {} here hold {} of its {} bytes; {} more do not fit", spilled.spilled_from,
                              held, quota, spilled.info.bytes));
    }
    return ok();
  });
}

std::optional<Stub> InMemoryEntryStore::longest_stub(std::uint64_t model_id, std::span<const std::uint64_t> hashes) {
  std::lock_guard lock(mutex_);
  if (stubs_.empty()) return std::nullopt;
  for (auto hash = hashes.rbegin(); hash != hashes.rend(); ++hash) {
    const auto found = stubs_.find({model_id, *hash});
    if (found != stubs_.end() && !found->second.in_flight) return found->second;
  }
  return std::nullopt;
}

std::vector<Stub> InMemoryEntryStore::stubs(std::size_t limit) {
  std::lock_guard lock(mutex_);
  std::vector<Stub> out;
  for (const EntryKey& key : stub_order_) {
    if (out.size() >= limit) break;
    out.push_back(stubs_.at(key));
  }
  return out;
}

std::uint64_t InMemoryEntryStore::spilled_in_bytes(std::string_view peer) {
  std::lock_guard lock(mutex_);
  const auto found = spilled_in_.find(std::string(peer));
  return found != spilled_in_.end() ? found->second : 0;
}

void InMemoryEntryStore::erase_locked(Entries::iterator found, bool forget) {
  for (const EntryKey& prefix_key : found->second.prefix_keys) {
    const auto rows = prefix_index_.find(prefix_key);
    if (rows == prefix_index_.end()) continue;
    std::erase_if(rows->second, [&](const PrefixRow& row) { return row.entry == found->first; });
    if (rows->second.empty()) prefix_index_.erase(rows);
  }
  bytes_ -= found->second.entry->info.bytes;
  if (const auto& entry = *found->second.entry; entry.origin == EntryOrigin::kSpilledIn) {
    --spilled_in_entries_;
    if (const auto held = spilled_in_.find(entry.spilled_from); held != spilled_in_.end()) {
      held->second -= std::min(held->second, entry.info.bytes);
      if (held->second == 0) spilled_in_.erase(held);
    }
  }
  recency_.erase(found->second.recency);
  if (forget) eviction_->on_erase(found->first);
  entries_.erase(found);
}

}  // namespace kvrelay::kv_store
