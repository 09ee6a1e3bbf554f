#pragma once

// Utility against LRU eviction: the daemon's real store (kv_store::InMemoryEntryStore) with
// kv_store::LruEviction and with broker::UtilityEviction on a virtual clock, replaying one
// trace of lookups with a skewed (Zipf-like), slowly drifting popularity and route priorities.
// Reports hit ratios (by count, by bytes, on prioritised routes) at a few budgets.

#include <nlohmann/json.hpp>

#include <cstdint>

namespace kvrelay::sim {

[[nodiscard]] nlohmann::json run_store_comparison(std::uint64_t seed);

}  // namespace kvrelay::sim
