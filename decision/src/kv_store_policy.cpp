#include "kvrelay/decision/kv_store_policy.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace kvrelay::decision {

namespace {

constexpr double kDefaultRecencyTau = 60.0;

}  // namespace

UtilityLedger::UtilityLedger(double recency_tau_s) : tau_s_(recency_tau_s > 0.0 ? recency_tau_s : kDefaultRecencyTau) {}

double UtilityLedger::rank_of(const LedgerRecord& record) const noexcept {
  const double frequency = (1.0 + std::log2(1.0 + static_cast<double>(record.hits))) *
                           (1.0 + static_cast<double>(std::max(record.priority, 0)));
  return std::log(frequency) + record.last_access_s / tau_s_;
}

double UtilityLedger::utility_of(const LedgerRecord& record, double now_s) const noexcept {
  const double age = std::max(0.0, now_s - record.last_access_s);
  return (1.0 + std::log2(1.0 + static_cast<double>(record.hits))) * std::exp(-age / tau_s_) *
         (1.0 + static_cast<double>(std::max(record.priority, 0)));
}

void UtilityLedger::rerank(const LedgerKey& key, Slot& slot) {
  order_.erase({slot.rank, key});
  slot.rank = rank_of(slot.record);
  order_.emplace(slot.rank, key);
}

void UtilityLedger::track(const LedgerKey& key, std::uint64_t bytes, int route_priority, double now_s) {
  auto [found, inserted] = slots_.try_emplace(key);
  Slot& slot = found->second;
  if (!inserted) order_.erase({slot.rank, key});
  slot.record.bytes = bytes;
  slot.record.hits += 1;
  slot.record.last_access_s = now_s;
  slot.record.priority = std::max(slot.record.priority, route_priority);
  slot.rank = rank_of(slot.record);
  order_.emplace(slot.rank, key);
}

bool UtilityLedger::hit(const LedgerKey& key, double now_s) {
  const auto found = slots_.find(key);
  if (found == slots_.end()) return false;
  found->second.record.hits += 1;
  found->second.record.last_access_s = now_s;
  rerank(key, found->second);
  return true;
}

bool UtilityLedger::raise(const LedgerKey& key, int route_priority, double now_s) {
  const auto found = slots_.find(key);
  if (found == slots_.end()) return false;
  found->second.record.priority = std::max(found->second.record.priority, route_priority);
  found->second.record.last_access_s = now_s;
  rerank(key, found->second);
  return true;
}

void UtilityLedger::forget(const LedgerKey& key) {
  const auto found = slots_.find(key);
  if (found == slots_.end()) return;
  order_.erase({found->second.rank, key});
  slots_.erase(found);
}

void UtilityLedger::clear() {
  slots_.clear();
  order_.clear();
}

std::vector<LedgerEntry> UtilityLedger::victims(std::uint64_t bytes_needed, double now_s,
                                                const Evictable& evictable) const {
  std::vector<LedgerEntry> out;
  std::uint64_t freed = 0;
  for (auto it = order_.begin(); it != order_.end() && freed < bytes_needed; ++it) {
    const LedgerKey& key = it->second;
    if (evictable && !evictable(key)) continue;
    const LedgerRecord& record = slots_.find(key)->second.record;
    out.push_back({key, utility_of(record, now_s), record.bytes});
    freed += record.bytes;
  }
  return out;
}

std::vector<LedgerEntry> UtilityLedger::top(std::size_t limit, double now_s) const {
  std::vector<LedgerEntry> out;
  out.reserve(std::min(limit, order_.size()));
  for (auto it = order_.rbegin(); it != order_.rend() && out.size() < limit; ++it) {
    const LedgerRecord& record = slots_.find(it->second)->second.record;
    out.push_back({it->second, utility_of(record, now_s), record.bytes});
  }
  return out;
}

std::optional<double> UtilityLedger::utility(const LedgerKey& key, double now_s) const {
  const auto found = slots_.find(key);
  if (found == slots_.end()) return std::nullopt;
  return utility_of(found->second.record, now_s);
}

const LedgerRecord* UtilityLedger::find(const LedgerKey& key) const {
  const auto found = slots_.find(key);
  return found == slots_.end() ? nullptr : &found->second.record;
}

void UtilityLedger::set_recency_tau(double tau_s) {
  if (!(tau_s > 0.0) || tau_s == tau_s_) return;
  tau_s_ = tau_s;
  order_.clear();
  for (auto& [key, slot] : slots_) {
    slot.rank = rank_of(slot.record);
    order_.emplace(slot.rank, key);
  }
}

}  // namespace kvrelay::decision
