#pragma once

// The container's memory limit, and whether the shared memory a policy commits fits it. The
// arena, the store's memfds and the peer buffers are charged to the sidecar's cgroup (shmem pages
// count as the cgroup's memory), so a budget past `memory.max` ends with the OOM killer, not with
// evictions. The daemon checks at start and at every reload (docs/operations.md, "Memory limit").

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"

namespace kvrelay::proxy {

inline constexpr const char* kDefaultCgroupRoot = "/sys/fs/cgroup";
inline constexpr const char* kDefaultSelfCgroup = "/proc/self/cgroup";

// What the daemon's own heap, threads, HTTP buffers and codec scratch need besides the
// committed shared memory: a fixed allowance, not a measurement.
inline constexpr std::uint64_t kMemoryHeadroomBytes = 128ULL << 20;

struct MemoryLimit {
  std::uint64_t bytes = 0;
  std::string file;  // the memory.max (v2) or memory.limit_in_bytes (v1) that sets it
};

// The tightest memory limit on this process's cgroup and its ancestors, read from `self_cgroup`
// (/proc/self/cgroup's format) and the cgroup file system mounted at `cgroup_root`: cgroup v2
// ("0::/path") takes the minimum of memory.max over the path and each ancestor ("max" is none);
// v1 the same over memory.limit_in_bytes of the memory controller's path (values of 2^60 and more
// are the kernel's "unlimited"). nullopt when no limit is set, or none can be read (said at debug
// level): an unreadable file never stops the daemon.
[[nodiscard]] std::optional<MemoryLimit> container_memory_limit(const std::string& cgroup_root = kDefaultCgroupRoot,
                                                                const std::string& self_cgroup = kDefaultSelfCgroup);

// One policy key's share of the committed memory.
struct MemoryCharge {
  std::string pointer;      // "/limits/kv_store_bytes"
  std::uint64_t bytes = 0;  // the key's value
  unsigned times = 1;       // how many of it the daemon keeps (peer buffers: one pool per side)
  [[nodiscard]] std::uint64_t total() const noexcept { return bytes * times; }
};

// The most memory a policy lets the daemon hold: the arena (allocated whole at start, when the
// data-plane socket is on), the store budget (entries in the arena count against it too, so the
// sum bounds both) and the warm peer buffers (serving with listen.peer, fetching with peers),
// plus kMemoryHeadroomBytes.
struct MemoryBudget {
  std::vector<MemoryCharge> charges;  // keys that commit nothing (0, or their listener off) left out
  std::uint64_t total = 0;            // every charge plus the headroom

  // The charge that commits the most (the first of equals); nullptr when there is none.
  [[nodiscard]] const MemoryCharge* largest() const noexcept;
  // "kv_store_bytes 1 GiB + shm_arena_bytes 256 MiB + 2 x peer_buffer_bytes 192 MiB + headroom 128 MiB"
  [[nodiscard]] std::string breakdown() const;
};

[[nodiscard]] MemoryBudget memory_budget(const Policy& policy);

// Fails (kInvalidArgument) when the budget exceeds `limit`, as a policy error: the policy's file,
// the largest charge's JSON pointer, the total with its breakdown, and the limit with its file.
// Passes when there is no limit.
[[nodiscard]] Status check_memory_budget(const Policy& policy, const std::optional<MemoryLimit>& limit);

// A memory size as Kubernetes writes `resources.limits.memory`: bytes, or a number with a binary
// (Ki, Mi, Gi, Ti) or decimal (k, M, G, T) suffix: "4Gi", "512Mi", "2G", "1073741824".
[[nodiscard]] Result<std::uint64_t> parse_memory_quantity(std::string_view text);

// "1.5 GiB", "192 MiB", "512 bytes": a size for an operator (binary units, two decimals at most).
[[nodiscard]] std::string memory_size_text(std::uint64_t bytes);

}  // namespace kvrelay::proxy
