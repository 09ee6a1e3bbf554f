#pragma once

// Which entries the store drops when it needs room. The store tells its policy of every put,
// hit, use by a route and erase, and asks it for victims; all of it under the store's lock, so
// a policy needs no lock of its own and must not call back into the store. The daemon evicts by
// utility (broker/utility_eviction.h, over decision::UtilityLedger); LRU is the default.

#include <cstdint>
#include <functional>
#include <list>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kvrelay/kv_store/entry.h"

namespace kvrelay::kv_store {

// An entry as its policy ranks it: utility where the policy has one.
struct RankedKey {
  EntryKey key;
  std::optional<double> utility;
};

class EvictionPolicy {
 public:
  using Evictable = std::function<bool(const EntryKey&)>;
  virtual ~EvictionPolicy() = default;
  // An entry was filed (a replacement under the same key too).
  virtual void on_put(const EntryKey& key, std::uint64_t bytes) = 0;
  // A lookup found it (directly, or a prefix of it through the index).
  virtual void on_hit(const EntryKey& key) = 0;
  // A route of this priority publishes or reads it.
  virtual void on_use(const EntryKey& key, int route_priority) = 0;
  virtual void on_erase(const EntryKey& key) = 0;
  virtual void on_clear() = 0;
  // Whom to drop first, among the keys `evictable` accepts, until their bytes reach `bytes`
  // (all of them when even that is too few).
  [[nodiscard]] virtual std::vector<EntryKey> victims(std::uint64_t bytes, const Evictable& evictable) = 0;
  // The entries it values most, best first, up to `limit`.
  [[nodiscard]] virtual std::vector<RankedKey> top(std::size_t limit) = 0;
  // The entry's utility now, where the policy has one (a victim's, to judge a spill).
  [[nodiscard]] virtual std::optional<double> utility(const EntryKey& /*key*/) { return std::nullopt; }
  [[nodiscard]] virtual std::string_view name() const noexcept = 0;
};

// Least recently put or hit goes first; a route's use changes nothing.
class LruEviction final : public EvictionPolicy {
 public:
  void on_put(const EntryKey& key, std::uint64_t bytes) override;
  void on_hit(const EntryKey& key) override;
  void on_use(const EntryKey& /*key*/, int /*route_priority*/) override {}
  void on_erase(const EntryKey& key) override;
  void on_clear() override;
  [[nodiscard]] std::vector<EntryKey> victims(std::uint64_t bytes, const Evictable& evictable) override;
  [[nodiscard]] std::vector<RankedKey> top(std::size_t limit) override;
  [[nodiscard]] std::string_view name() const noexcept override { return "lru"; }

 private:
  struct Slot {
    std::list<EntryKey>::iterator at;
    std::uint64_t bytes = 0;
  };
  std::list<EntryKey> recency_;  // front: most recently used
  std::unordered_map<EntryKey, Slot, EntryKeyHash> slots_;
};

// Where a budget victim worth keeping goes instead of away (issue #27: the daemon pushes it to a
// peer that accepts spills). The store leaves a stub under the victim's key, and the sink ends
// each spill it took with EntryStore::spill_done.
class SpillSink {
 public:
  virtual ~SpillSink() = default;
  // Under the store's lock, so cheap and without I/O: whether to spill this victim rather than
  // drop it. `utility`: its policy's, where it has one.
  [[nodiscard]] virtual bool wants(const EntryKey& key, const StoredEntry& entry, std::optional<double> utility) = 0;
  // Outside the lock: a victim it wanted, whose bytes it holds until its push ends.
  virtual void offer(const EntryKey& key, std::shared_ptr<const StoredEntry> entry) = 0;
};

// A spilled entry's stand-in: what it was, and which peer holds it ("" while its push runs).
struct Stub {
  EntryKey key;
  std::string peer;
  Fidelity fidelity;  // of the entry spilled; its spill medium's codec may add loss on the way
  std::string codec;  // the codec it went with ("" while in flight)
  std::uint64_t bytes = 0;
  std::uint64_t tokens = 0;
  bool in_flight = true;
};

}  // namespace kvrelay::kv_store
