#include "kvrelay/proxy/memory_limit.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <filesystem>
#include <iterator>
#include <string_view>

namespace kvrelay::proxy {

namespace fs = std::filesystem;

namespace {

// v1 writes "unlimited" as the largest page count times the page size (9223372036854771712 with
// 4 KiB pages); anything from 1 EiB up is that, whatever the page size.
constexpr std::uint64_t kCgroupV1Unlimited = 1ULL << 60;

// POSIX reads, not streams: libstdc++'s stream buffers throw on some read errors (a directory
// gives EISDIR), and a limit we cannot read must never stop the daemon. Bounded: these files hold
// one line, /proc/self/cgroup a dozen.
std::optional<std::string> read_cgroup_text(const fs::path& path) {
  constexpr std::size_t kMaxCgroupFileBytes = 64 * 1024;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string text;
  char buffer[4096];
  bool failed = false;
  while (text.size() < kMaxCgroupFileBytes) {
    const auto got = ::read(fd, buffer, sizeof buffer);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) failed = true;
    if (got <= 0) break;
    text.append(buffer, static_cast<std::size_t>(got));
  }
  ::close(fd);
  if (failed) return std::nullopt;
  return text;
}

std::string_view trim_cgroup_text(std::string_view text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return {};
  const auto last = text.find_last_not_of(" \t\r\n");
  return text.substr(first, last - first + 1);
}

// The cgroup path's components. A path with ".." lies outside this cgroup namespace's view (the
// kernel shows it relative to our root), so only the mount root itself can be read.
std::vector<std::string> cgroup_path_components(std::string_view path) {
  std::vector<std::string> components;
  while (!path.empty()) {
    const auto slash = path.find('/');
    const std::string_view part = path.substr(0, slash);
    if (part == "..") {
      spdlog::debug("memory limit: cgroup path {} is outside this namespace's view; reading its mount root only", path);
      return {};
    }
    if (!part.empty() && part != ".") components.emplace_back(part);
    if (slash == std::string_view::npos) break;
    path.remove_prefix(slash + 1);
  }
  return components;
}

// The smallest limit in `file_name` over the cgroup at `components` under `mount` and each of its
// ancestors up to the mount root: a parent's limit binds its children too.
std::optional<MemoryLimit> tightest_cgroup_limit(const fs::path& mount, const std::vector<std::string>& components,
                                                 const char* file_name, bool v1) {
  std::optional<MemoryLimit> tightest;
  for (std::size_t depth = components.size() + 1; depth-- > 0;) {
    fs::path dir = mount;
    for (std::size_t index = 0; index < depth; ++index)
      dir /= components[index];
    const fs::path file = dir / file_name;
    const auto text = read_cgroup_text(file);
    if (!text) {
      spdlog::debug("memory limit: cannot read {}; no limit taken from there", file.string());
      continue;
    }
    const std::string_view value = trim_cgroup_text(*text);
    if (value == "max") continue;
    std::uint64_t bytes = 0;
    const auto parsed = std::from_chars(value.data(), value.data() + value.size(), bytes);
    if (parsed.ec != std::errc() || parsed.ptr != value.data() + value.size()) {
      spdlog::debug("memory limit: {} holds \"{}\", not a byte count; no limit taken from there", file.string(), value);
      continue;
    }
    if (v1 && bytes >= kCgroupV1Unlimited) continue;
    if (!tightest || bytes < tightest->bytes) tightest = MemoryLimit{bytes, file.string()};
  }
  return tightest;
}

bool cgroup_file_exists(const fs::path& path) {
  std::error_code error;
  return fs::exists(path, error);
}

}  // namespace

std::optional<MemoryLimit> container_memory_limit(const std::string& cgroup_root, const std::string& self_cgroup) {
  const auto membership = read_cgroup_text(self_cgroup);
  if (!membership) {
    spdlog::debug("memory limit: cannot read {}; no container memory limit known", self_cgroup);
    return std::nullopt;
  }
  // Lines are "hierarchy-id:controllers:path"; v2's is "0::path". In a hybrid layout both appear,
  // and the memory controller is wherever a v1 line names it.
  std::optional<std::string> v1_path;
  std::optional<std::string> v2_path;
  std::string_view rest = *membership;
  while (!rest.empty()) {
    const auto newline = rest.find('\n');
    const std::string_view line = rest.substr(0, newline);
    rest.remove_prefix(newline == std::string_view::npos ? rest.size() : newline + 1);
    const auto first = line.find(':');
    const auto second = first == std::string_view::npos ? first : line.find(':', first + 1);
    if (second == std::string_view::npos) continue;
    const std::string_view id = line.substr(0, first);
    std::string_view controllers = line.substr(first + 1, second - first - 1);
    const std::string_view path = line.substr(second + 1);
    if (id == "0" && controllers.empty()) {
      v2_path = std::string(path);
      continue;
    }
    while (!controllers.empty()) {
      const auto comma = controllers.find(',');
      if (controllers.substr(0, comma) == "memory") v1_path = std::string(path);
      if (comma == std::string_view::npos) break;
      controllers.remove_prefix(comma + 1);
    }
  }
  const fs::path root(cgroup_root);
  if (v1_path) {
    return tightest_cgroup_limit(root / "memory", cgroup_path_components(*v1_path), "memory.limit_in_bytes", true);
  }
  if (v2_path) {
    // A hybrid host without a v1 memory controller mounts the unified tree at root/unified.
    const bool unified_below =
        !cgroup_file_exists(root / "cgroup.controllers") && cgroup_file_exists(root / "unified" / "cgroup.controllers");
    return tightest_cgroup_limit(unified_below ? root / "unified" : root, cgroup_path_components(*v2_path),
                                 "memory.max", false);
  }
  spdlog::debug("memory limit: {} names neither a cgroup v2 path nor a v1 memory controller", self_cgroup);
  return std::nullopt;
}

const MemoryCharge* MemoryBudget::largest() const noexcept {
  const MemoryCharge* largest_charge = nullptr;
  for (const auto& charge : charges) {
    if (largest_charge == nullptr || charge.total() > largest_charge->total()) largest_charge = &charge;
  }
  return largest_charge;
}

std::string MemoryBudget::breakdown() const {
  std::string text;
  for (const auto& charge : charges) {
    const std::string_view key = std::string_view(charge.pointer).substr(charge.pointer.rfind('/') + 1);
    if (charge.times > 1) text += fmt::format("{} x ", charge.times);
    text += fmt::format("{} {} + ", key, memory_size_text(charge.bytes));
  }
  return text + fmt::format("headroom {}", memory_size_text(kMemoryHeadroomBytes));
}

MemoryBudget memory_budget(const Policy& policy) {
  MemoryBudget budget;
  const auto charge = [&](const char* pointer, std::uint64_t bytes, unsigned times) {
    if (bytes > 0 && times > 0) budget.charges.push_back({pointer, bytes, times});
  };
  charge("/limits/kv_store_bytes", policy.limits.kv_store_bytes, 1);
  // The arena exists with the data-plane socket only (the shm server makes it).
  charge("/limits/shm_arena_bytes", policy.limits.shm_arena_bytes, policy.listen.unix_socket.empty() ? 0 : 1);
  // One pool serves fetches (with listen.peer), one receives them (with peers to fetch from).
  const unsigned peer_pools = (policy.listen.peer ? 1U : 0U) + (policy.peers.empty() ? 0U : 1U);
  charge("/limits/peer_buffer_bytes", policy.limits.peer_buffer_bytes, peer_pools);
  // Victims waiting for their spill push are out of the budget but still in memory.
  charge("/kv_store/spill_inflight_bytes", policy.kv_store.spill_inflight_bytes,
         policy.any_peer_accepts_spills() ? 1 : 0);
  // The parser bounds each key (2^50 at most), so the sum cannot overflow.
  budget.total = kMemoryHeadroomBytes;
  for (const auto& each : budget.charges)
    budget.total += each.total();
  return budget;
}

Status check_memory_budget(const Policy& policy, const std::optional<MemoryLimit>& limit) {
  const MemoryBudget budget = memory_budget(policy);
  if (!limit || budget.total <= limit->bytes) return ok();
  const MemoryCharge* largest = budget.largest();
  const std::string pointer = largest != nullptr ? largest->pointer : "/limits";
  return fail(ErrorCode::kInvalidArgument,
              fmt::format("{}{}: expected the committed memory to fit the container's memory limit of {} ({} bytes, "
                          "{}), got {} ({} bytes) = {}; lower {} or raise the container's memory limit",
                          policy.source.empty() ? "" : policy.source + ": ", pointer, memory_size_text(limit->bytes),
                          limit->bytes, limit->file, memory_size_text(budget.total), budget.total, budget.breakdown(),
                          pointer));
}

Result<std::uint64_t> parse_memory_quantity(std::string_view text) {
  struct Suffix {
    std::string_view name;
    std::uint64_t factor;
  };
  static constexpr Suffix kSuffixes[] = {
      {"Ki", 1ULL << 10}, {"Mi", 1ULL << 20},  {"Gi", 1ULL << 30},      {"Ti", 1ULL << 40},
      {"k", 1'000ULL},    {"M", 1'000'000ULL}, {"G", 1'000'000'000ULL}, {"T", 1'000'000'000'000ULL}};
  std::uint64_t number = 0;
  const auto parsed = std::from_chars(text.data(), text.data() + text.size(), number);
  const std::string_view suffix = text.substr(static_cast<std::size_t>(parsed.ptr - text.data()));
  if (parsed.ec != std::errc() || parsed.ptr == text.data()) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("expected a memory size (bytes, or e.g. 512Mi, 4Gi, 2G), got \"{}\"", text));
  }
  std::uint64_t factor = 1;
  if (!suffix.empty()) {
    const auto* found = std::find_if(std::begin(kSuffixes), std::end(kSuffixes),
                                     [&](const Suffix& candidate) { return candidate.name == suffix; });
    if (found == std::end(kSuffixes)) {
      return fail(
          ErrorCode::kInvalidArgument,
          fmt::format("unknown memory size suffix \"{}\" in \"{}\" (Ki, Mi, Gi, Ti, k, M, G, T)", suffix, text));
    }
    factor = found->factor;
  }
  if (number > UINT64_MAX / factor) {
    return fail(ErrorCode::kOverflow, fmt::format("memory size \"{}\" does not fit 64 bits", text));
  }
  return number * factor;
}

std::string memory_size_text(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return fmt::format("{} bytes", bytes);
  std::size_t unit = 0;
  double value = static_cast<double>(bytes) / 1024.0;
  while (value >= 1024.0 && unit + 1 < std::size(kUnits)) {
    value /= 1024.0;
    ++unit;
  }
  std::string number = fmt::format("{:.2f}", value);
  while (number.back() == '0')
    number.pop_back();
  if (number.back() == '.') number.pop_back();
  return fmt::format("{} {}", number, kUnits[unit]);
}

}  // namespace kvrelay::proxy
