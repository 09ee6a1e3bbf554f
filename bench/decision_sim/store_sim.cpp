#include "store_sim.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kvrelay/broker/utility_eviction.h"
#include "kvrelay/core/kv_layout.h"
#include "kvrelay/kv_store/entry.h"
#include "kvrelay/kv_store/entry_store.h"
#include "kvrelay/kv_store/eviction.h"

namespace kvrelay::sim {

namespace {

constexpr std::size_t kStoreContexts = 4000;
constexpr std::size_t kStoreLookups = 50'000;
constexpr double kZipfExponent = 0.9;
constexpr double kLookupsPerS = 10.0;       // one node's handoffs
constexpr double kRecencyTauS = 60.0;       // kv_store.recency_tau_s's default
constexpr std::size_t kDriftEvery = 2'500;  // lookups between popularity shifts
constexpr std::size_t kDriftSwaps = 200;    // rank swaps per shift: 10% of the contexts move
constexpr std::uint64_t kMinTokens = 8;     // entry sizes log-uniform in tokens
constexpr std::uint64_t kMaxTokens = 256;
constexpr std::uint64_t kStoreModel = 0x5eed;  // every entry's model id
// Eight routes: most at the default priority 0, two the policy ranks higher.
constexpr int kRoutePriorities[] = {0, 0, 0, 0, 0, 0, 3, 7};
constexpr double kBudgetFractions[] = {0.05, 0.10, 0.20, 0.40};

// A small KV layout (2 layers, 1 head of 32, fp16: 256 bytes a token) keeps the memfds small.
KvLayout store_layout(std::uint64_t tokens) {
  return KvLayout{2, 1, 32, DType::kFloat16, tokens};
}

struct StoredContext {
  std::uint64_t tokens = 0;
  std::uint64_t bytes = 0;
  int route_priority = 0;
};

struct StoreTrace {
  std::vector<StoredContext> contexts;
  std::vector<std::uint32_t> lookups;  // context index per lookup
  std::uint64_t unique_bytes = 0;
};

StoreTrace build_store_trace(std::uint64_t seed) {
  std::mt19937_64 rng(seed * 104729 + 3);
  StoreTrace trace;
  std::uniform_real_distribution<double> log_tokens(std::log(static_cast<double>(kMinTokens)),
                                                    std::log(static_cast<double>(kMaxTokens)));
  std::uniform_int_distribution<std::size_t> any_route(0, std::size(kRoutePriorities) - 1);
  for (std::size_t c = 0; c < kStoreContexts; ++c) {
    StoredContext context;
    context.tokens = static_cast<std::uint64_t>(std::exp(log_tokens(rng)));
    context.bytes = store_layout(context.tokens).total_bytes().value();
    context.route_priority = kRoutePriorities[any_route(rng)];
    trace.unique_bytes += context.bytes;
    trace.contexts.push_back(context);
  }
  // Rank r is drawn with weight 1 / (r + 1)^s; which context holds a rank drifts over time.
  std::vector<double> cdf(kStoreContexts);
  double sum = 0.0;
  for (std::size_t r = 0; r < kStoreContexts; ++r) {
    sum += std::pow(static_cast<double>(r + 1), -kZipfExponent);
    cdf[r] = sum;
  }
  std::vector<std::uint32_t> holder(kStoreContexts);
  for (std::size_t r = 0; r < kStoreContexts; ++r)
    holder[r] = static_cast<std::uint32_t>(r);
  std::shuffle(holder.begin(), holder.end(), rng);
  std::uniform_real_distribution<double> draw(0.0, sum);
  std::uniform_int_distribution<std::size_t> any_rank(0, kStoreContexts - 1);
  trace.lookups.reserve(kStoreLookups);
  for (std::size_t i = 0; i < kStoreLookups; ++i) {
    if (i > 0 && i % kDriftEvery == 0) {
      for (std::size_t s = 0; s < kDriftSwaps; ++s)
        std::swap(holder[any_rank(rng)], holder[any_rank(rng)]);
    }
    const auto rank = static_cast<std::size_t>(std::lower_bound(cdf.begin(), cdf.end(), draw(rng)) - cdf.begin());
    trace.lookups.push_back(holder[std::min(rank, kStoreContexts - 1)]);
  }
  return trace;
}

struct StoreCounts {
  std::uint64_t lookups = 0;
  std::uint64_t hits = 0;
  std::uint64_t lookup_bytes = 0;
  std::uint64_t hit_bytes = 0;
  std::uint64_t prioritised_lookups = 0;  // on routes of priority > 0
  std::uint64_t prioritised_hits = 0;
  double weighted_lookups = 0.0;  // each weighted by 1 + its route's priority
  double weighted_hits = 0.0;
  std::uint64_t evictions = 0;
  std::uint64_t failed_puts = 0;
};

// Each lookup asks the store; a miss files the context's KV (as the sidecar does once the worker
// has computed or fetched it). Both tell the store which route used the entry, as KvPath does.
StoreCounts replay(const StoreTrace& trace, kv_store::InMemoryEntryStore& store, double& clock_s) {
  StoreCounts counts;
  std::vector<std::byte> zeros(store_layout(kMaxTokens).total_bytes().value());
  for (std::size_t i = 0; i < trace.lookups.size(); ++i) {
    clock_s = static_cast<double>(i) / kLookupsPerS;
    const std::uint32_t index = trace.lookups[i];
    const StoredContext& context = trace.contexts[index];
    const kv_store::EntryKey key{kStoreModel, index};
    const bool hit = store.get(key) != nullptr;
    const double weight = 1.0 + context.route_priority;
    ++counts.lookups;
    counts.lookup_bytes += context.bytes;
    counts.weighted_lookups += weight;
    if (context.route_priority > 0) ++counts.prioritised_lookups;
    if (hit) {
      ++counts.hits;
      counts.hit_bytes += context.bytes;
      counts.weighted_hits += weight;
      if (context.route_priority > 0) ++counts.prioritised_hits;
    } else {
      auto entry = kv_store::make_stored_entry(store_layout(context.tokens),
                                               std::span<const std::byte>(zeros.data(), context.bytes));
      if (!entry || !store.put(key, std::move(entry).value())) {
        ++counts.failed_puts;
        continue;
      }
    }
    store.note_use(key, context.route_priority);
  }
  counts.evictions = store.stats().budget_evictions;
  return counts;
}

double ratio(double part, double whole) {
  return whole > 0 ? part / whole : 0.0;
}

nlohmann::json describe_counts(const StoreCounts& c) {
  return {
      {"hit_ratio", ratio(static_cast<double>(c.hits), static_cast<double>(c.lookups))},
      {"byte_hit_ratio", ratio(static_cast<double>(c.hit_bytes), static_cast<double>(c.lookup_bytes))},
      {"prioritised_route_hit_ratio",
       ratio(static_cast<double>(c.prioritised_hits), static_cast<double>(c.prioritised_lookups))},
      {"priority_weighted_hit_ratio", ratio(c.weighted_hits, c.weighted_lookups)},
      {"hits", c.hits},
      {"evictions", c.evictions},
      {"failed_puts", c.failed_puts},
  };
}

StoreCounts run_lru(const StoreTrace& trace, std::uint64_t budget) {
  kv_store::InMemoryEntryStore store(budget, std::make_unique<kv_store::LruEviction>());
  double clock_s = 0.0;
  return replay(trace, store, clock_s);
}

StoreCounts run_utility(const StoreTrace& trace, std::uint64_t budget) {
  double clock_s = 0.0;  // the policy reads the replay's virtual clock
  kv_store::InMemoryEntryStore store(
      budget, std::make_unique<broker::UtilityEviction>([] { return kRecencyTauS; }, [&clock_s] { return clock_s; }));
  return replay(trace, store, clock_s);
}

}  // namespace

nlohmann::json run_store_comparison(std::uint64_t seed) {
  const StoreTrace trace = build_store_trace(seed);
  // The most any budget can hit: every context's first lookup misses.
  std::vector<bool> seen(trace.contexts.size(), false);
  std::uint64_t first_lookups = 0;
  for (const std::uint32_t index : trace.lookups) {
    first_lookups += seen[index] ? 0U : 1U;
    seen[index] = true;
  }
  nlohmann::json budgets = nlohmann::json::array();
  bool utility_never_worse_weighted = true;
  for (const double fraction : kBudgetFractions) {
    const auto budget = static_cast<std::uint64_t>(fraction * static_cast<double>(trace.unique_bytes));
    const StoreCounts lru = run_lru(trace, budget);
    const StoreCounts utility = run_utility(trace, budget);
    utility_never_worse_weighted =
        utility_never_worse_weighted &&
        ratio(utility.weighted_hits, utility.weighted_lookups) >= ratio(lru.weighted_hits, lru.weighted_lookups);
    budgets.push_back({{"budget_fraction", fraction},
                       {"budget_bytes", budget},
                       {"lru", describe_counts(lru)},
                       {"utility", describe_counts(utility)}});
  }
  return {
      {"what",
       "kv_store::InMemoryEntryStore with kv_store::LruEviction and with broker::UtilityEviction (virtual "
       "clock), memfd entries from kv_store::make_stored_entry; a miss files the entry, every lookup calls "
       "note_use with its route's priority"},
      {"contexts", trace.contexts.size()},
      {"lookups", trace.lookups.size()},
      {"unique_bytes", trace.unique_bytes},
      {"zipf_exponent", kZipfExponent},
      {"popularity_drift",
       std::to_string(kDriftSwaps) + " rank swaps every " + std::to_string(kDriftEvery) + " lookups"},
      {"lookups_per_s", kLookupsPerS},
      {"recency_tau_s", kRecencyTauS},
      {"route_priorities", kRoutePriorities},
      {"physical_limit_hit_ratio",
       ratio(static_cast<double>(trace.lookups.size() - first_lookups), static_cast<double>(trace.lookups.size()))},
      {"budgets", budgets},
      {"goals", {{"utility_priority_weighted_hit_ratio_at_least_lru", utility_never_worse_weighted}}},
  };
}

}  // namespace kvrelay::sim
