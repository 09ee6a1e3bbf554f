#include "kvrelay/decision/kv_store_policy.h"

#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

namespace kvrelay::decision {

namespace {

constexpr double kDefaultRecencyTau = 60.0;

LedgerKey ledger_key(std::uint64_t key) {
  return {0, key};
}

}  // namespace

// UtilityLedger

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

// KvStorePolicy

KvStorePolicy::KvStorePolicy(KvStoreConfig config, SpillPeer* peer)
    : config_(config), peer_(peer), ledger_(config.recency_tau_s) {
  config_.recency_tau_s = ledger_.recency_tau();
}

EntryState KvStorePolicy::state(std::uint64_t key) const noexcept {
  const auto it = entries_.find(key);
  if (it == entries_.end()) {
    return EntryState::kAbsent;
  }
  return it->second.spilled ? EntryState::kSpilled : EntryState::kResident;
}

std::optional<double> KvStorePolicy::utility(std::uint64_t key, double now_s) const noexcept {
  if (!entries_.contains(key)) return std::nullopt;
  return ledger_.utility(ledger_key(key), now_s);
}

void KvStorePolicy::erase_entry(std::uint64_t key) {
  entries_.erase(key);
  ledger_.forget(ledger_key(key));
}

Status KvStorePolicy::make_room(std::uint64_t incoming, std::uint64_t keep, double now_s) {
  if (resident_bytes_ + incoming <= config_.budget_bytes) {
    return ok();
  }
  // Stubs hold no resident bytes, so only resident entries other than `keep` can make room.
  const auto victims =
      ledger_.victims(resident_bytes_ + incoming - config_.budget_bytes, now_s, [&](const LedgerKey& key) {
        const auto it = entries_.find(key.low);
        return key.low != keep && it != entries_.end() && !it->second.spilled;
      });
  for (const LedgerEntry& victim : victims) {
    const std::uint64_t key = victim.key.low;
    Entry& entry = entries_.find(key)->second;
    resident_bytes_ -= entry.size;
    if (peer_ != nullptr && victim.utility >= config_.spill_min_utility) {
      std::vector<std::uint8_t> compressed(ZSTD_compressBound(entry.payload.size()));
      const std::size_t written = ZSTD_compress(compressed.data(), compressed.size(), entry.payload.data(),
                                                entry.payload.size(), config_.zstd_level);
      if (!ZSTD_isError(written)) {
        compressed.resize(written);
        const std::size_t compressed_size = compressed.size();
        if (peer_->store(key, std::move(compressed))) {
          ++stats_.spills;
          stats_.spilled_bytes_raw += entry.size;
          stats_.spilled_bytes_compressed += compressed_size;
          entry.payload.clear();
          entry.payload.shrink_to_fit();
          entry.spilled = true;
          continue;
        }
      }
      // A peer that refuses (full, unreachable) turns the spill into a plain eviction.
    }
    ++stats_.evictions;
    erase_entry(key);
  }
  if (resident_bytes_ + incoming > config_.budget_bytes) {
    return fail(ErrorCode::kResourceExhausted, "KV store budget cannot fit the entry");
  }
  return ok();
}

Status KvStorePolicy::put(std::uint64_t key, std::vector<std::uint8_t> payload, int route_priority, double now_s) {
  const std::uint64_t size = payload.size();
  if (size > config_.budget_bytes) {
    return fail(ErrorCode::kResourceExhausted,
                "entry of " + std::to_string(size) + " bytes exceeds the KV store budget");
  }
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    if (it->second.spilled && peer_ != nullptr) {
      (void)peer_->fetch(key);  // the new bytes supersede the spilled copy; drop it at the peer
    }
    if (!it->second.spilled) {
      resident_bytes_ -= it->second.size;
    }
    it->second.payload.clear();
    it->second.spilled = true;  // not resident while room is made
  }
  if (const Status room = make_room(size, key, now_s); !room) {
    erase_entry(key);  // a half-replaced entry must not linger as a stub without a copy
    return room.error();
  }
  Entry& entry = entries_[key];
  entry.payload = std::move(payload);
  entry.size = size;
  entry.spilled = false;
  ledger_.track(ledger_key(key), size, route_priority, now_s);
  resident_bytes_ += size;
  return ok();
}

Status KvStorePolicy::bring_back(std::uint64_t key, Entry& entry, double now_s) {
  if (peer_ == nullptr) {
    return fail(ErrorCode::kInternal, "spilled entry without a peer");
  }
  KVRELAY_TRY(auto compressed, peer_->fetch(key));
  const unsigned long long content = ZSTD_getFrameContentSize(compressed.data(), compressed.size());
  if (content == ZSTD_CONTENTSIZE_ERROR || content == ZSTD_CONTENTSIZE_UNKNOWN || content != entry.size) {
    return fail(ErrorCode::kCorrupt, "spilled entry came back with a bad frame header");
  }
  std::vector<std::uint8_t> payload(entry.size);
  const std::size_t written = ZSTD_decompress(payload.data(), payload.size(), compressed.data(), compressed.size());
  if (ZSTD_isError(written) || written != entry.size) {
    return fail(ErrorCode::kCorrupt, "spilled entry failed to decompress");
  }
  ++stats_.fetches;
  // Room is made before the entry counts as resident so it cannot evict itself.
  KVRELAY_TRY(make_room(entry.size, key, now_s));
  entry.payload = std::move(payload);
  entry.spilled = false;
  resident_bytes_ += entry.size;
  return ok();
}

Result<std::span<const std::uint8_t>> KvStorePolicy::get(std::uint64_t key, double now_s) {
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    return fail(ErrorCode::kNotFound, "no KV entry " + std::to_string(key));
  }
  if (it->second.spilled) {
    const Status status = bring_back(key, it->second, now_s);
    if (!status) {
      // The peer's copy is gone or broken: forget the stub so the caller recomputes.
      erase_entry(key);
      return status.error();
    }
    it = entries_.find(key);  // make_room may have rehashed the map
  }
  ledger_.hit(ledger_key(key), now_s);
  return std::span<const std::uint8_t>(it->second.payload);
}

void KvStorePolicy::prefetch(std::span<const std::uint64_t> keys, int route_priority, double now_s) {
  for (const std::uint64_t key : keys) {
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      continue;
    }
    ledger_.raise(ledger_key(key), route_priority, now_s);
    if (it->second.spilled && !bring_back(key, it->second, now_s)) {
      erase_entry(key);
    }
  }
}

}  // namespace kvrelay::decision
