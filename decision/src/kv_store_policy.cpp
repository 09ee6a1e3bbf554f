#include "kvrelay/decision/kv_store_policy.h"

#include <zstd.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

namespace kvrelay::decision {

KvStorePolicy::KvStorePolicy(KvStoreConfig config, SpillPeer* peer) : config_(config), peer_(peer) {
  if (!(config_.recency_tau_s > 0.0)) {
    config_.recency_tau_s = 60.0;
  }
}

double KvStorePolicy::utility_of(const Entry& entry, double now_s) const noexcept {
  const double age = std::max(0.0, now_s - entry.last_access_s);
  return (1.0 + std::log2(1.0 + static_cast<double>(entry.hits))) * std::exp(-age / config_.recency_tau_s) *
         (1.0 + static_cast<double>(std::max(entry.priority, 0)));
}

EntryState KvStorePolicy::state(std::uint64_t key) const noexcept {
  const auto it = entries_.find(key);
  if (it == entries_.end()) {
    return EntryState::kAbsent;
  }
  return it->second.spilled ? EntryState::kSpilled : EntryState::kResident;
}

std::optional<double> KvStorePolicy::utility(std::uint64_t key, double now_s) const noexcept {
  const auto it = entries_.find(key);
  if (it == entries_.end()) {
    return std::nullopt;
  }
  return utility_of(it->second, now_s);
}

Status KvStorePolicy::make_room(std::uint64_t incoming, std::uint64_t keep, double now_s) {
  if (resident_bytes_ + incoming <= config_.budget_bytes) {
    return ok();
  }
  struct Candidate {
    double utility;
    std::uint64_t key;
  };
  std::vector<Candidate> order;
  order.reserve(entries_.size());
  for (const auto& [key, entry] : entries_) {
    if (!entry.spilled && key != keep) {
      order.push_back({utility_of(entry, now_s), key});
    }
  }
  // Lowest utility first; ties by key so the order does not depend on hash-map iteration.
  std::sort(order.begin(), order.end(), [](const Candidate& l, const Candidate& r) {
    return l.utility != r.utility ? l.utility < r.utility : l.key < r.key;
  });
  for (const Candidate& candidate : order) {
    if (resident_bytes_ + incoming <= config_.budget_bytes) {
      break;
    }
    auto it = entries_.find(candidate.key);
    Entry& entry = it->second;
    resident_bytes_ -= entry.size;
    if (peer_ != nullptr && candidate.utility >= config_.spill_min_utility) {
      std::vector<std::uint8_t> compressed(ZSTD_compressBound(entry.payload.size()));
      const std::size_t written = ZSTD_compress(compressed.data(), compressed.size(), entry.payload.data(),
                                                entry.payload.size(), config_.zstd_level);
      if (!ZSTD_isError(written)) {
        compressed.resize(written);
        const std::size_t compressed_size = compressed.size();
        if (peer_->store(candidate.key, std::move(compressed))) {
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
    entries_.erase(it);
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
    entries_.erase(key);  // a half-replaced entry must not linger as a stub without a copy
    return room.error();
  }
  Entry& entry = entries_[key];
  entry.payload = std::move(payload);
  entry.size = size;
  entry.hits += 1;
  entry.last_access_s = now_s;
  entry.priority = std::max(entry.priority, route_priority);
  entry.spilled = false;
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
      entries_.erase(key);
      return status.error();
    }
    it = entries_.find(key);  // make_room may have rehashed the map
  }
  Entry& entry = it->second;
  entry.hits += 1;
  entry.last_access_s = now_s;
  return std::span<const std::uint8_t>(entry.payload);
}

void KvStorePolicy::prefetch(std::span<const std::uint64_t> keys, int route_priority, double now_s) {
  for (const std::uint64_t key : keys) {
    auto it = entries_.find(key);
    if (it == entries_.end()) {
      continue;
    }
    it->second.priority = std::max(it->second.priority, route_priority);
    it->second.last_access_s = now_s;
    if (it->second.spilled && !bring_back(key, it->second, now_s)) {
      entries_.erase(key);
    }
  }
}

}  // namespace kvrelay::decision
