#pragma once

// The sidecar's KV store under a byte budget. Each entry has a utility from access frequency,
// recency and the priority of the route that produced it:
//   utility = (1 + log2(1 + hits)) * exp(-age / recency_tau) * (1 + route_priority)
// When a put would exceed the budget, the lowest-utility entries leave first. An entry whose
// utility is still worth keeping (>= spill_min_utility) and a configured peer is spilled: its
// bytes are zstd-compressed and handed to the peer, and a stub stays behind that fetches them
// back on the next access. Prefetch hints (a route A->B is about to run) fetch stubs back early
// and raise the entries' priority so they are not the next to go.
//
// UtilityLedger is that utility order on its own, without payloads: the daemon's store evicts by
// it (broker/utility_eviction.h) and KvStorePolicy is built on it, so both run the same code.

#include <boost/unordered/unordered_flat_map.hpp>

#include <compare>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <utility>
#include <vector>

#include "kvrelay/core/result.h"

namespace kvrelay::decision {

// What the ledger files an entry under: two words, so the store's (model, context) keys fit as
// they are. Ties in utility are broken by this order, so victims never depend on hashing.
struct LedgerKey {
  std::uint64_t high = 0;
  std::uint64_t low = 0;
  friend auto operator<=>(const LedgerKey&, const LedgerKey&) = default;
};

struct LedgerKeyHash {
  std::size_t operator()(const LedgerKey& key) const noexcept {
    return static_cast<std::size_t>(key.high * 0x9E3779B97F4A7C15ULL ^ key.low);
  }
};

struct LedgerRecord {
  std::uint64_t bytes = 0;
  std::uint64_t hits = 0;
  double last_access_s = 0.0;
  int priority = 0;  // the highest route priority seen
};

struct LedgerEntry {
  LedgerKey key;
  double utility = 0.0;
  std::uint64_t bytes = 0;
};

// Utility of every tracked entry, kept in order. Since
//   log utility = log f(hits, priority) - (now - last_access) / tau,
// the order by log f + last_access / tau is the utility order at every `now`: a std::set keyed
// by it costs O(log n) per event and nothing per eviction but the walk from its low end.
// Not thread-safe: the store calls it under its lock.
class UtilityLedger {
 public:
  using Evictable = std::function<bool(const LedgerKey&)>;

  explicit UtilityLedger(double recency_tau_s = 60.0);

  // Files `key` (or refiles it with new bytes) as accessed now: one more hit, recency `now`,
  // priority raised to `route_priority`.
  void track(const LedgerKey& key, std::uint64_t bytes, int route_priority, double now_s);
  // An access: one more hit, recency `now`. False for a key not tracked.
  bool hit(const LedgerKey& key, double now_s);
  // A route of `route_priority` uses the entry (a publish it will carry, a lookup it served, a
  // prefetch hint): priority raised to it, recency `now`, no hit counted.
  bool raise(const LedgerKey& key, int route_priority, double now_s);
  void forget(const LedgerKey& key);
  void clear();

  // Lowest utility first, of the keys `evictable` accepts (all when it is empty), until their
  // bytes reach `bytes_needed`; all of them when even that is too few. Nothing for 0 bytes.
  [[nodiscard]] std::vector<LedgerEntry> victims(std::uint64_t bytes_needed, double now_s,
                                                 const Evictable& evictable = {}) const;
  // Highest utility first, up to `limit` (the admin listing).
  [[nodiscard]] std::vector<LedgerEntry> top(std::size_t limit, double now_s) const;

  [[nodiscard]] std::optional<double> utility(const LedgerKey& key, double now_s) const;
  [[nodiscard]] const LedgerRecord* find(const LedgerKey& key) const;
  [[nodiscard]] std::size_t size() const noexcept { return slots_.size(); }
  [[nodiscard]] double recency_tau() const noexcept { return tau_s_; }
  // A new tau reorders every entry once (O(n log n)); values <= 0 are ignored.
  void set_recency_tau(double tau_s);

 private:
  struct Slot {
    LedgerRecord record;
    double rank = 0.0;  // log f + last_access / tau: the set's order
  };
  [[nodiscard]] double rank_of(const LedgerRecord& record) const noexcept;
  [[nodiscard]] double utility_of(const LedgerRecord& record, double now_s) const noexcept;
  void rerank(const LedgerKey& key, Slot& slot);

  double tau_s_;
  boost::unordered_flat_map<LedgerKey, Slot, LedgerKeyHash> slots_;
  std::set<std::pair<double, LedgerKey>> order_;  // lowest utility first; ties by key
};

// Where spilled entries go: another sidecar's store, reached over the peer plane.
class SpillPeer {
 public:
  virtual ~SpillPeer() = default;
  [[nodiscard]] virtual Status store(std::uint64_t key, std::vector<std::uint8_t> compressed) = 0;
  // Hands the bytes back and forgets them.
  [[nodiscard]] virtual Result<std::vector<std::uint8_t>> fetch(std::uint64_t key) = 0;
};

struct KvStoreConfig {
  std::uint64_t budget_bytes = 1ULL << 30;
  double recency_tau_s = 60.0;
  double spill_min_utility = 1.5;
  int zstd_level = 1;
};

enum class EntryState : std::uint8_t { kAbsent, kResident, kSpilled };

struct KvStoreStats {
  std::uint64_t evictions = 0;  // dropped for good
  std::uint64_t spills = 0;
  std::uint64_t fetches = 0;  // stubs brought back
  std::uint64_t spilled_bytes_raw = 0;
  std::uint64_t spilled_bytes_compressed = 0;
};

class KvStorePolicy {
 public:
  // `peer` may be null: low-utility entries are then always dropped. Not owned.
  KvStorePolicy(KvStoreConfig config, SpillPeer* peer);

  // Stores (or replaces) an entry, evicting or spilling others to fit. An entry larger than the
  // whole budget is refused with kResourceExhausted and nothing is evicted for it.
  [[nodiscard]] Status put(std::uint64_t key, std::vector<std::uint8_t> payload, int route_priority, double now_s);
  // Counts an access; a stub is fetched back from the peer, decompressed and validated first.
  // The span stays valid until the next non-const call.
  [[nodiscard]] Result<std::span<const std::uint8_t>> get(std::uint64_t key, double now_s);
  // Hint that these entries will be needed soon (a known route is about to run).
  void prefetch(std::span<const std::uint64_t> keys, int route_priority, double now_s);

  [[nodiscard]] EntryState state(std::uint64_t key) const noexcept;
  [[nodiscard]] std::optional<double> utility(std::uint64_t key, double now_s) const noexcept;
  [[nodiscard]] std::uint64_t resident_bytes() const noexcept { return resident_bytes_; }
  [[nodiscard]] const KvStoreStats& stats() const noexcept { return stats_; }

 private:
  struct Entry {
    std::vector<std::uint8_t> payload;  // empty while spilled
    std::uint64_t size = 0;             // raw size, also for stubs
    bool spilled = false;
  };

  // Frees resident bytes until `incoming` more fit; never touches `keep`.
  [[nodiscard]] Status make_room(std::uint64_t incoming, std::uint64_t keep, double now_s);
  [[nodiscard]] Status bring_back(std::uint64_t key, Entry& entry, double now_s);
  void erase_entry(std::uint64_t key);

  KvStoreConfig config_;
  SpillPeer* peer_;
  boost::unordered_flat_map<std::uint64_t, Entry> entries_;
  UtilityLedger ledger_;  // hits, recency and priority of every entry, stubs too
  std::uint64_t resident_bytes_ = 0;
  KvStoreStats stats_;
};

}  // namespace kvrelay::decision
