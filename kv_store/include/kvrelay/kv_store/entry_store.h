#pragma once

// Where committed entries live. The transports only ever call this interface; the daemon's is
// an InMemoryEntryStore with a byte budget, a prefix index and an EvictionPolicy (eviction.h).

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvrelay/core/result.h"
#include "kvrelay/kv_store/entry.h"
#include "kvrelay/kv_store/eviction.h"

namespace kvrelay::kv_store {

struct EntryStoreStats {
  std::uint64_t entries = 0;
  std::uint64_t bytes = 0;
  std::uint64_t evictions = 0;           // all of them: budget_evictions + arena_evictions
  std::uint64_t refused_downgrades = 0;  // lossy puts refused because more exact KV was there
  std::uint64_t budget = 0;              // the byte budget (0: the store has none)
  std::uint64_t budget_evictions = 0;    // dropped so that a put fits the byte budget
  std::uint64_t arena_evictions = 0;     // dropped so that a block fits the shared-memory arena
  std::string_view eviction_policy;      // EvictionPolicy::name(); "" when the store has none
  // Spill (issue #27): budget victims handed to the SpillSink instead of dropped.
  std::uint64_t stubs = 0;             // spilled entries' stand-ins held now (in flight too)
  std::uint64_t spilling_bytes = 0;    // of victims whose push has not ended
  std::uint64_t spills = 0;            // pushes that ended with the peer holding the entry
  std::uint64_t spill_failures = 0;    // pushes that failed: the victim was dropped (an eviction)
  std::uint64_t spilled_in_bytes = 0;  // entries peers spilled here, held now
  std::uint64_t spilled_in_entries = 0;
};

// One entry as GET /admin/kv lists it.
struct EntryListing {
  EntryKey key;
  std::uint64_t bytes = 0;
  std::uint64_t tokens = 0;
  std::uint64_t hits = 0;         // lookups that found it since it was filed (prefix hits too)
  std::optional<double> utility;  // where the eviction policy has one
  Fidelity fidelity;
  EntryOrigin origin = EntryOrigin::kPublished;
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
  // Drops entries held in `arena`, the eviction policy's victims first, until a block of `bytes`
  // fits there or none of its entries is left; returns whether it dropped any. (Blocks a reader still holds
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
  // A route of `route_priority` publishes or reads the entry under `key`, or the entry whose
  // prefix `key` names: its eviction policy may value it more. Stores that do not rank ignore it.
  virtual void note_use(const EntryKey& /*key*/, int /*route_priority*/) {}
  // The entries the store values most, best first, up to `limit`. Stores that cannot list return none.
  [[nodiscard]] virtual std::vector<EntryListing> top(std::size_t /*limit*/) { return {}; }

  // Spill (issue #27). The sink ends a spill it took: `peer` holds the entry now (ok), or the
  // push failed and the victim is gone (an eviction). Stores that do not spill ignore it.
  virtual void spill_done(const EntryKey& /*key*/, const std::string& /*peer*/, bool /*ok*/,
                          const std::string& /*codec*/ = {}) {}
  // Drops the stub under `key` (its peer no longer holds the entry); false when there is none.
  virtual bool forget_stub(const EntryKey& /*key*/) { return false; }
  // The stub of the longest chain among `hashes` (block 0 first) of `model_id` whose spill has
  // ended, if an entry filed under one of them was spilled.
  [[nodiscard]] virtual std::optional<Stub> longest_stub(std::uint64_t /*model_id*/,
                                                         std::span<const std::uint64_t> /*hashes*/) {
    return std::nullopt;
  }
  // Up to `limit` stubs, most recent first.
  [[nodiscard]] virtual std::vector<Stub> stubs(std::size_t /*limit*/) { return {}; }
  // Bytes of the entries `peer` spilled here that the store holds now (its accept_spill_bytes quota).
  [[nodiscard]] virtual std::uint64_t spilled_in_bytes(std::string_view /*peer*/) { return 0; }
  // Files an entry a peer spilled here (origin kSpilledIn, spilled_from its id) only if that
  // peer's spills, this one included and any it replaces excluded, stay within `quota` bytes
  // (kResourceExhausted otherwise); checked and filed as one step, so concurrent spills cannot
  // overshoot. An entry of this node's own under the key is never replaced by a spill
  // (kAlreadyExists). Stores that cannot count peers' spills take none (kUnsupported).
  [[nodiscard]] virtual Status put_spilled(const EntryKey& key, std::shared_ptr<const StoredEntry> entry,
                                           std::uint64_t quota);
};

// A byte-budgeted map; when a put would exceed the budget, or a block does not fit the arena,
// it drops the victims its EvictionPolicy names (least recently used by default). Indexes the
// leading blocks of entries that carry a chain (find_prefix); erasing or evicting an entry drops
// its index rows.
class InMemoryEntryStore final : public EntryStore {
 public:
  explicit InMemoryEntryStore(std::uint64_t byte_budget)
      : InMemoryEntryStore(byte_budget, std::make_unique<LruEviction>()) {}
  // A null policy is LRU.
  InMemoryEntryStore(std::uint64_t byte_budget, std::unique_ptr<EvictionPolicy> eviction);
  [[nodiscard]] Status put(const EntryKey& key, std::shared_ptr<const StoredEntry> entry) override;
  [[nodiscard]] std::shared_ptr<const StoredEntry> get(const EntryKey& key) override;
  [[nodiscard]] bool erase(const EntryKey& key) override;
  [[nodiscard]] EntryStoreStats stats() override;
  EntryStoreStats clear() override;
  [[nodiscard]] std::vector<EntryKey> recent_keys(std::size_t limit, const EntryFilter& shown) override;
  bool make_arena_room(const ShmArena& arena, std::uint64_t bytes) override;
  [[nodiscard]] std::optional<PrefixHit> find_prefix(const EntryKey& key, const PrefixFilter& accepts) override;
  void note_use(const EntryKey& key, int route_priority) override;
  [[nodiscard]] std::vector<EntryListing> top(std::size_t limit) override;
  // Budget victims the sink wants are spilled through it (none while unset or expired).
  void set_spill_sink(std::weak_ptr<SpillSink> sink);
  void spill_done(const EntryKey& key, const std::string& peer, bool ok, const std::string& codec = {}) override;
  bool forget_stub(const EntryKey& key) override;
  [[nodiscard]] std::optional<Stub> longest_stub(std::uint64_t model_id,
                                                 std::span<const std::uint64_t> hashes) override;
  [[nodiscard]] std::vector<Stub> stubs(std::size_t limit) override;
  [[nodiscard]] std::uint64_t spilled_in_bytes(std::string_view peer) override;
  [[nodiscard]] Status put_spilled(const EntryKey& key, std::shared_ptr<const StoredEntry> entry,
                                   std::uint64_t quota) override;

 private:
  struct Slot {
    std::shared_ptr<const StoredEntry> entry;
    std::list<EntryKey>::iterator recency;
    std::vector<EntryKey> prefix_keys;  // its index rows: block i's key is prefix_keys[i], all but the last block
    std::uint64_t hits = 0;
  };
  struct PrefixRow {
    EntryKey entry;  // where the entry is filed
    std::size_t blocks = 0;
  };
  using Entries = std::unordered_map<EntryKey, Slot, EntryKeyHash>;
  // Drops the entry and its index rows; `forget` tells the policy (not when a put replaces it).
  void erase_locked(Entries::iterator found, bool forget = true);
  void hit_locked(Entries::iterator found);
  struct Spill {
    EntryKey key;
    std::shared_ptr<const StoredEntry> entry;
  };
  // put, with `admit` (unset: none) run under the lock first: its failure files nothing.
  [[nodiscard]] Status put_admitted(const EntryKey& key, std::shared_ptr<const StoredEntry> entry,
                                    const std::function<Status(const StoredEntry&)>& admit);
  // put's work under the lock; victims the sink wants land in `spills`, offered after it.
  [[nodiscard]] Status put_locked(const EntryKey& key, std::shared_ptr<const StoredEntry> entry,
                                  const std::vector<EntryKey>& prefix_keys, SpillSink* sink,
                                  std::vector<Spill>& spills);
  // Budget eviction of one victim: spilled when the sink wants it, else dropped.
  void evict_locked(Entries::iterator found, SpillSink* sink, std::vector<Spill>& spills);

  std::mutex mutex_;
  std::uint64_t budget_;
  std::unique_ptr<EvictionPolicy> eviction_;
  std::uint64_t bytes_ = 0;
  std::uint64_t budget_evictions_ = 0;
  std::uint64_t arena_evictions_ = 0;
  std::uint64_t refused_downgrades_ = 0;
  std::list<EntryKey> recency_;  // front: most recently used (recent_keys: peer summaries)
  Entries entries_;
  std::unordered_map<EntryKey, std::vector<PrefixRow>, EntryKeyHash> prefix_index_;  // rows oldest first
  std::weak_ptr<SpillSink> spill_sink_;
  std::unordered_map<EntryKey, Stub, EntryKeyHash> stubs_;
  std::list<EntryKey> stub_order_;  // front: newest
  std::uint64_t spills_ = 0;
  std::uint64_t spill_failures_ = 0;
  std::unordered_map<std::string, std::uint64_t> spilled_in_;  // bytes held, by the peer that spilled them
  std::uint64_t spilled_in_entries_ = 0;
};

}  // namespace kvrelay::kv_store
