#pragma once

// Where committed entries live. The transports only ever call this interface, so the daemon
// can put the real KV store (block index, utility-based eviction) behind it later.

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "kvrelay/core/result.h"
#include "kvrelay/kv_store/entry.h"

namespace kvrelay::kv_store {

struct EntryStoreStats {
  std::uint64_t entries = 0;
  std::uint64_t bytes = 0;
  std::uint64_t evictions = 0;
  std::uint64_t refused_downgrades = 0;  // lossy puts refused because more exact KV was there
};

// An entry filed under a later block's key that holds the blocks of a shorter chain first.
struct PrefixHit {
  std::shared_ptr<const StoredEntry> entry;
  std::size_t blocks = 0;  // the leading blocks of `entry` the key asked for names
};

class EntryStore {
 public:
  virtual ~EntryStore() = default;
  // Makes a committed entry visible. A later put under the same key replaces it, unless the
  // entry there is more exact (Fidelity): then the put fails with kAlreadyExists and the store
  // keeps what it had, so a lossy copy never displaces exact KV.
  [[nodiscard]] virtual Status put(const EntryKey& key, std::shared_ptr<const StoredEntry> entry) = 0;
  // nullptr when absent. Any fidelity: callers that serve exact KV use get_exact().
  [[nodiscard]] virtual std::shared_ptr<const StoredEntry> get(const EntryKey& key) = 0;
  // The entry under `key` only when all of its tokens are exact; nullptr otherwise.
  [[nodiscard]] std::shared_ptr<const StoredEntry> get_exact(const EntryKey& key) {
    auto entry = get(key);
    return entry && entry->fidelity.is_exact() ? entry : nullptr;
  }
  [[nodiscard]] virtual bool erase(const EntryKey& key) = 0;
  [[nodiscard]] virtual EntryStoreStats stats() = 0;
  // Drops every entry and returns what was dropped. Readers that already hold an entry keep
  // their mapping; its memory returns when the last of them lets go.
  virtual EntryStoreStats clear() = 0;
  // Up to `limit` keys, most recently used first, of the entries `shown` accepts (peer
  // summaries: what a peer may fetch). Stores that cannot list their keys return none; peers
  // then find their entries by asking directly. `shown` runs under the store's lock.
  using EntryFilter = std::function<bool(const StoredEntry&)>;
  [[nodiscard]] virtual std::vector<EntryKey> recent_keys(std::size_t /*limit*/, const EntryFilter& /*shown*/) {
    return {};
  }
  // Drops least recently used entries held in `arena` until a block of `bytes` fits there or
  // none of its entries is left; returns whether it dropped any. (Blocks a reader still holds
  // under a lease come free only when it lets go.) Stores that cannot evict return false.
  virtual bool make_arena_room(const ShmArena& /*arena*/, std::uint64_t /*bytes*/) { return false; }
  // The prefix index: an entry whose block `blocks - 1` (not its last) is filed under `key`, of
  // those `accepts` takes (it runs under the store's lock). Only entries whose token ids hash to
  // their key are indexed, in the scope they were filed in, so a hit never crosses a tenant. The
  // most exact of that prefix wins, then the most recently filed; a hit counts as a use of the
  // entry. Stores without an index return none.
  using PrefixFilter = std::function<bool(const StoredEntry& entry, std::size_t blocks)>;
  [[nodiscard]] virtual std::optional<PrefixHit> find_prefix(const EntryKey& /*key*/, const PrefixFilter& /*accepts*/) {
    return std::nullopt;
  }
};

// A byte-budgeted map; evicts least recently used entries when a put would exceed the budget.
// Indexes the leading blocks of entries that carry a chain (find_prefix); erasing or evicting
// an entry drops its index rows.
class InMemoryEntryStore final : public EntryStore {
 public:
  explicit InMemoryEntryStore(std::uint64_t byte_budget) : budget_(byte_budget) {}
  [[nodiscard]] Status put(const EntryKey& key, std::shared_ptr<const StoredEntry> entry) override;
  [[nodiscard]] std::shared_ptr<const StoredEntry> get(const EntryKey& key) override;
  [[nodiscard]] bool erase(const EntryKey& key) override;
  [[nodiscard]] EntryStoreStats stats() override;
  EntryStoreStats clear() override;
  [[nodiscard]] std::vector<EntryKey> recent_keys(std::size_t limit, const EntryFilter& shown) override;
  bool make_arena_room(const ShmArena& arena, std::uint64_t bytes) override;
  [[nodiscard]] std::optional<PrefixHit> find_prefix(const EntryKey& key, const PrefixFilter& accepts) override;

 private:
  struct Slot {
    std::shared_ptr<const StoredEntry> entry;
    std::list<EntryKey>::iterator recency;
    std::vector<EntryKey> prefix_keys;  // its index rows: block i's key is prefix_keys[i], all but the last block
  };
  struct PrefixRow {
    EntryKey entry;  // where the entry is filed
    std::size_t blocks = 0;
  };
  void erase_locked(std::unordered_map<EntryKey, Slot, EntryKeyHash>::iterator found);

  std::mutex mutex_;
  std::uint64_t budget_;
  std::uint64_t bytes_ = 0;
  std::uint64_t evictions_ = 0;
  std::uint64_t refused_downgrades_ = 0;
  std::list<EntryKey> recency_;  // front: most recently used
  std::unordered_map<EntryKey, Slot, EntryKeyHash> entries_;
  std::unordered_map<EntryKey, std::vector<PrefixRow>, EntryKeyHash> prefix_index_;  // rows oldest first
};

}  // namespace kvrelay::kv_store
