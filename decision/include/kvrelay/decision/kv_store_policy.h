#pragma once

// The KV store's eviction order by utility: access frequency, recency and the priority of the
// routes that use an entry:
//   utility = (1 + log2(1 + hits)) * exp(-age / recency_tau) * (1 + route_priority)
// The ledger holds that order without payloads; the daemon's store (kv_store::InMemoryEntryStore)
// evicts by it through broker::UtilityEviction (broker/utility_eviction.h).

#include <boost/unordered/unordered_flat_map.hpp>

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <utility>
#include <vector>

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

}  // namespace kvrelay::decision
