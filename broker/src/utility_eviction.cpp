#include "kvrelay/broker/utility_eviction.h"

#include <chrono>

namespace kvrelay::broker {

namespace {

decision::LedgerKey to_ledger(const kv_store::EntryKey& key) {
  return {key.model_id, key.context_hash};
}
kv_store::EntryKey from_ledger(const decision::LedgerKey& key) {
  return {key.high, key.low};
}

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

UtilityEviction::UtilityEviction(Seconds recency_tau_s, Seconds now_s)
    : recency_tau_s_(std::move(recency_tau_s)),
      now_s_(std::move(now_s)),
      ledger_(recency_tau_s_ ? recency_tau_s_() : 60.0) {}

double UtilityEviction::now() const {
  return now_s_ ? now_s_() : steady_seconds();
}

// The order only matters when victims are chosen (or listed), so a new tau is taken then.
void UtilityEviction::retune() {
  if (recency_tau_s_) ledger_.set_recency_tau(recency_tau_s_());
}

void UtilityEviction::on_put(const kv_store::EntryKey& key, std::uint64_t bytes) {
  ledger_.track(to_ledger(key), bytes, 0, now());
}

void UtilityEviction::on_hit(const kv_store::EntryKey& key) {
  (void)ledger_.hit(to_ledger(key), now());
}

void UtilityEviction::on_use(const kv_store::EntryKey& key, int route_priority) {
  (void)ledger_.raise(to_ledger(key), route_priority, now());
}

void UtilityEviction::on_erase(const kv_store::EntryKey& key) {
  ledger_.forget(to_ledger(key));
}

void UtilityEviction::on_clear() {
  ledger_.clear();
}

std::vector<kv_store::EntryKey> UtilityEviction::victims(std::uint64_t bytes, const Evictable& evictable) {
  retune();
  const auto chosen = ledger_.victims(
      bytes, now(), [&](const decision::LedgerKey& key) { return !evictable || evictable(from_ledger(key)); });
  std::vector<kv_store::EntryKey> out;
  out.reserve(chosen.size());
  for (const auto& victim : chosen)
    out.push_back(from_ledger(victim.key));
  return out;
}

std::optional<double> UtilityEviction::utility(const kv_store::EntryKey& key) {
  return ledger_.utility(to_ledger(key), now());
}

std::vector<kv_store::RankedKey> UtilityEviction::top(std::size_t limit) {
  retune();
  std::vector<kv_store::RankedKey> out;
  for (const auto& entry : ledger_.top(limit, now()))
    out.push_back({from_ledger(entry.key), entry.utility});
  return out;
}

}  // namespace kvrelay::broker
