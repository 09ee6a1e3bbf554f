#pragma once

// The daemon's eviction policy: the store drops the entries of lowest utility (access frequency,
// recency, the priority of the routes that use them; decision::UtilityLedger), not the least
// recently used. Recency runs on the steady clock; tau is read from the live policy each time
// victims are chosen, so a reload changes it.

#include <functional>

#include "kvrelay/decision/kv_store_policy.h"
#include "kvrelay/kv_store/eviction.h"

namespace kvrelay::broker {

class UtilityEviction final : public kv_store::EvictionPolicy {
 public:
  using Seconds = std::function<double()>;
  // `recency_tau_s`: kv_store.recency_tau_s of the serving policy. `now_s`: seconds on a
  // monotonic clock (the steady clock when empty; tests pass their own).
  explicit UtilityEviction(Seconds recency_tau_s, Seconds now_s = {});

  void on_put(const kv_store::EntryKey& key, std::uint64_t bytes) override;
  void on_hit(const kv_store::EntryKey& key) override;
  void on_use(const kv_store::EntryKey& key, int route_priority) override;
  void on_erase(const kv_store::EntryKey& key) override;
  void on_clear() override;
  [[nodiscard]] std::vector<kv_store::EntryKey> victims(std::uint64_t bytes, const Evictable& evictable) override;
  [[nodiscard]] std::vector<kv_store::RankedKey> top(std::size_t limit) override;
  [[nodiscard]] std::optional<double> utility(const kv_store::EntryKey& key) override;
  [[nodiscard]] std::string_view name() const noexcept override { return "utility"; }

 private:
  [[nodiscard]] double now() const;
  void retune();

  Seconds recency_tau_s_;
  Seconds now_s_;
  decision::UtilityLedger ledger_;
};

}  // namespace kvrelay::broker
