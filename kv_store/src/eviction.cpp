#include "kvrelay/kv_store/eviction.h"

namespace kvrelay::kv_store {

void LruEviction::on_put(const EntryKey& key, std::uint64_t bytes) {
  if (const auto found = slots_.find(key); found != slots_.end()) {
    recency_.splice(recency_.begin(), recency_, found->second.at);
    found->second.bytes = bytes;
    return;
  }
  recency_.push_front(key);
  slots_.emplace(key, Slot{recency_.begin(), bytes});
}

void LruEviction::on_hit(const EntryKey& key) {
  if (const auto found = slots_.find(key); found != slots_.end())
    recency_.splice(recency_.begin(), recency_, found->second.at);
}

void LruEviction::on_erase(const EntryKey& key) {
  const auto found = slots_.find(key);
  if (found == slots_.end()) return;
  recency_.erase(found->second.at);
  slots_.erase(found);
}

void LruEviction::on_clear() {
  recency_.clear();
  slots_.clear();
}

std::vector<EntryKey> LruEviction::victims(std::uint64_t bytes, const Evictable& evictable) {
  std::vector<EntryKey> out;
  std::uint64_t freed = 0;
  for (auto it = recency_.rbegin(); it != recency_.rend() && freed < bytes; ++it) {
    if (evictable && !evictable(*it)) continue;
    out.push_back(*it);
    freed += slots_.at(*it).bytes;
  }
  return out;
}

std::vector<RankedKey> LruEviction::top(std::size_t limit) {
  std::vector<RankedKey> out;
  for (auto it = recency_.begin(); it != recency_.end() && out.size() < limit; ++it)
    out.push_back({*it, std::nullopt});
  return out;
}

}  // namespace kvrelay::kv_store
