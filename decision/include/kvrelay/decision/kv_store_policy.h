#pragma once

// The sidecar's KV store under a byte budget. Each entry has a utility from access frequency,
// recency and the priority of the route that produced it:
//   utility = (1 + log2(1 + hits)) * exp(-age / recency_tau) * (1 + route_priority)
// When a put would exceed the budget, the lowest-utility entries leave first. An entry whose
// utility is still worth keeping (>= spill_min_utility) and a configured peer is spilled: its
// bytes are zstd-compressed and handed to the peer, and a stub stays behind that fetches them
// back on the next access. Prefetch hints (a route A->B is about to run) fetch stubs back early
// and raise the entries' priority so they are not the next to go.

#include <boost/unordered/unordered_flat_map.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kvrelay/core/result.h"

namespace kvrelay::decision {

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
    std::uint64_t hits = 0;
    double last_access_s = 0.0;
    int priority = 0;
    bool spilled = false;
  };

  [[nodiscard]] double utility_of(const Entry& entry, double now_s) const noexcept;
  // Frees resident bytes until `incoming` more fit; never touches `keep`.
  [[nodiscard]] Status make_room(std::uint64_t incoming, std::uint64_t keep, double now_s);
  [[nodiscard]] Status bring_back(std::uint64_t key, Entry& entry, double now_s);

  KvStoreConfig config_;
  SpillPeer* peer_;
  boost::unordered_flat_map<std::uint64_t, Entry> entries_;
  std::uint64_t resident_bytes_ = 0;
  KvStoreStats stats_;
};

}  // namespace kvrelay::decision
