// The container memory limit read from fake cgroup trees (v2 nested, v1, hybrid, unreadable),
// the committed-memory budget against it, and a reload held to the same check.
#include "kvrelay/proxy/memory_limit.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>

#include "kvrelay/core/metrics.h"
#include "kvrelay/proxy/runtime_policy.h"

#include "support/test_paths.h"

using namespace kvrelay;
using nlohmann::json;

namespace {

constexpr std::uint64_t kMiB = 1ULL << 20;
constexpr std::uint64_t kGiB = 1ULL << 30;

// A cgroup file system under a temp dir, and the /proc/self/cgroup that places us in it.
struct FakeCgroup {
  test::TempDir dir;
  void set(const std::string& relative, const std::string& contents) const {
    const auto path = root() / relative;
    std::filesystem::create_directories(path.parent_path());
    test::write_file(path, contents);
  }
  void membership(const std::string& lines) const { test::write_file(dir / "self_cgroup", lines); }
  [[nodiscard]] std::filesystem::path root() const { return dir / "sys_fs_cgroup"; }
  [[nodiscard]] std::optional<proxy::MemoryLimit> limit() const {
    return proxy::container_memory_limit(root().string(), (dir / "self_cgroup").string());
  }
};

Policy parsed_policy(const json& document) {
  auto parsed = parse_policy(document.dump(), "policy.json");
  REQUIRE(parsed);
  return std::move(parsed).value();
}

json policy_with_limits(const json& limits) {
  json document{{"schema_version", 1}, {"node", {{"id", "n"}}}, {"listen", {{"http", "127.0.0.1:0"}}}};
  document["limits"] = limits;
  return document;
}

}  // namespace

TEST_CASE("cgroup v2: the tightest memory.max over the path and its ancestors", "[proxy][memory]") {
  FakeCgroup cgroup;
  cgroup.membership("0::/kubepods/pod1/kvrelay\n");
  cgroup.set("kubepods/memory.max", "max\n");
  cgroup.set("kubepods/pod1/memory.max", "1073741824\n");
  cgroup.set("kubepods/pod1/kvrelay/memory.max", "4294967296\n");
  auto limit = cgroup.limit();
  REQUIRE(limit);
  CHECK(limit->bytes == kGiB);
  CHECK(limit->file == (cgroup.root() / "kubepods/pod1/memory.max").string());

  // The container's own limit, when it is the tighter one.
  cgroup.set("kubepods/pod1/kvrelay/memory.max", "536870912");
  limit = cgroup.limit();
  REQUIRE(limit);
  CHECK(limit->bytes == 512 * kMiB);
  CHECK(limit->file == (cgroup.root() / "kubepods/pod1/kvrelay/memory.max").string());
}

TEST_CASE("cgroup v2: max everywhere is no limit", "[proxy][memory]") {
  FakeCgroup cgroup;
  cgroup.membership("0::/kubepods/pod1/kvrelay\n");
  cgroup.set("kubepods/memory.max", "max\n");
  cgroup.set("kubepods/pod1/memory.max", "max\n");
  cgroup.set("kubepods/pod1/kvrelay/memory.max", "max\n");
  CHECK_FALSE(cgroup.limit());
}

TEST_CASE("cgroup v2 in a cgroup namespace: the limit at the mount root", "[proxy][memory]") {
  FakeCgroup cgroup;
  cgroup.membership("0::/\n");
  cgroup.set("cgroup.controllers", "cpu memory pids\n");
  cgroup.set("memory.max", "2147483648\n");
  const auto limit = cgroup.limit();
  REQUIRE(limit);
  CHECK(limit->bytes == 2 * kGiB);

  // A path outside the namespace's view ("..") reads the mount root alone.
  cgroup.membership("0::/../../other\n");
  REQUIRE(cgroup.limit());
  CHECK(cgroup.limit()->bytes == 2 * kGiB);
}

TEST_CASE("cgroup v1: memory.limit_in_bytes of the memory controller's path", "[proxy][memory]") {
  FakeCgroup cgroup;
  // A hybrid host, as Docker on cgroup v1 shows it: the memory controller is on v1.
  cgroup.membership("12:pids:/docker/abc\n4:cpu,memory:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n");
  cgroup.set("memory/memory.limit_in_bytes", "9223372036854771712\n");  // the kernel's unlimited
  cgroup.set("memory/docker/memory.limit_in_bytes", "9223372036854771712\n");
  cgroup.set("memory/docker/abc/memory.limit_in_bytes", "805306368\n");
  cgroup.set("memory.max", "104857600\n");  // a v2 file that must not be read: memory is on v1
  auto limit = cgroup.limit();
  REQUIRE(limit);
  CHECK(limit->bytes == 768 * kMiB);
  CHECK(limit->file == (cgroup.root() / "memory/docker/abc/memory.limit_in_bytes").string());

  cgroup.set("memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n");
  CHECK_FALSE(cgroup.limit());
}

TEST_CASE("cgroup v1 with the container's cgroup mounted as the root", "[proxy][memory]") {
  FakeCgroup cgroup;
  // /proc/self/cgroup names the host's path, but only the container's own cgroup is mounted.
  cgroup.membership("4:memory:/docker/abc\n");
  cgroup.set("memory/memory.limit_in_bytes", "268435456\n");
  const auto limit = cgroup.limit();
  REQUIRE(limit);
  CHECK(limit->bytes == 256 * kMiB);
}

TEST_CASE("missing or unreadable cgroup files are no limit, never a failure", "[proxy][memory]") {
  FakeCgroup cgroup;
  CHECK_FALSE(cgroup.limit());  // no /proc/self/cgroup
  cgroup.membership("0::/kubepods/pod1\n");
  CHECK_FALSE(cgroup.limit());  // no cgroup file system
  cgroup.set("kubepods/pod1/memory.max", "lots\n");
  CHECK_FALSE(cgroup.limit());  // not a byte count
  std::filesystem::remove(cgroup.root() / "kubepods/pod1/memory.max");
  std::filesystem::create_directories(cgroup.root() / "kubepods/pod1/memory.max");
  CHECK_FALSE(cgroup.limit());  // a directory where the file should be
  // An unreadable level does not hide a readable ancestor's limit.
  cgroup.set("kubepods/memory.max", "1073741824");
  REQUIRE(cgroup.limit());
  CHECK(cgroup.limit()->bytes == kGiB);
  cgroup.membership("garbage without colons\n");
  CHECK_FALSE(cgroup.limit());
}

TEST_CASE("the budget counts the store, the arena with its socket, and a peer pool per side", "[proxy][memory]") {
  auto document = policy_with_limits({{"kv_store_bytes", kGiB}, {"shm_arena_bytes", 256 * kMiB}});
  // Without the data-plane socket there is no arena, without peers no peer buffers.
  auto budget = proxy::memory_budget(parsed_policy(document));
  REQUIRE(budget.charges.size() == 1);
  CHECK(budget.charges[0].pointer == "/limits/kv_store_bytes");
  CHECK(budget.total == kGiB + proxy::kMemoryHeadroomBytes);

  document["listen"]["unix_socket"] = "/tmp/kvrelay-memory-test.sock";
  document["listen"]["peer"] = "127.0.0.1:0";
  document["peers"] = json::array({{{"id", "b"}, {"address", "127.0.0.1:7071"}}});
  budget = proxy::memory_budget(parsed_policy(document));
  REQUIRE(budget.charges.size() == 3);
  CHECK(budget.charges[1].pointer == "/limits/shm_arena_bytes");
  CHECK(budget.charges[2].pointer == "/limits/peer_buffer_bytes");
  CHECK(budget.charges[2].times == 2);
  CHECK(budget.total == kGiB + 256 * kMiB + 2 * 192 * kMiB + proxy::kMemoryHeadroomBytes);
  CHECK(budget.breakdown() ==
        "kv_store_bytes 1 GiB + shm_arena_bytes 256 MiB + 2 x peer_buffer_bytes 192 MiB + headroom 128 MiB");
  REQUIRE(budget.largest() != nullptr);
  CHECK(budget.largest()->pointer == "/limits/kv_store_bytes");

  // A key set to 0 commits nothing.
  document["limits"]["peer_buffer_bytes"] = 0;
  CHECK(proxy::memory_budget(parsed_policy(document)).charges.size() == 2);

  // A peer that takes spills: victims wait in memory for their push, up to spill_inflight_bytes.
  document["peers"][0]["accept_spill_bytes"] = kGiB;
  document["kv_store"] = {{"spill_inflight_bytes", 32 * kMiB}};
  budget = proxy::memory_budget(parsed_policy(document));
  REQUIRE(budget.charges.size() == 3);
  CHECK(budget.charges[2].pointer == "/kv_store/spill_inflight_bytes");
  CHECK(budget.total == kGiB + 256 * kMiB + 32 * kMiB + proxy::kMemoryHeadroomBytes);
}

TEST_CASE("a budget over the limit is refused naming the largest key, the sum and the limit", "[proxy][memory]") {
  const auto document = policy_with_limits({{"kv_store_bytes", kGiB}});
  const auto policy = parsed_policy(document);
  CHECK(proxy::check_memory_budget(policy, std::nullopt));
  CHECK(proxy::check_memory_budget(policy, proxy::MemoryLimit{kGiB + proxy::kMemoryHeadroomBytes, "memory.max"}));

  const auto refused =
      proxy::check_memory_budget(policy, proxy::MemoryLimit{kGiB + proxy::kMemoryHeadroomBytes - 1, "/x/memory.max"});
  REQUIRE_FALSE(refused);
  CHECK(refused.error().code == ErrorCode::kInvalidArgument);
  const auto& message = refused.error().message;
  CHECK_THAT(message, Catch::StartsWith("policy.json: /limits/kv_store_bytes: expected the committed memory to fit "
                                        "the container's memory limit of "));
  CHECK_THAT(message, Catch::Contains("(1207959551 bytes, /x/memory.max), got "));
  CHECK_THAT(message, Catch::Contains("(1207959552 bytes) = kv_store_bytes 1 GiB + headroom 128 MiB;"));
  CHECK_THAT(message, Catch::EndsWith("lower /limits/kv_store_bytes or raise the container's memory limit"));

  // The arena, when it is the larger charge, is the one named.
  auto with_arena = policy_with_limits({{"kv_store_bytes", 256 * kMiB}, {"shm_arena_bytes", 2 * kGiB}});
  with_arena["listen"]["unix_socket"] = "/tmp/kvrelay-memory-test.sock";
  const auto arena_refused =
      proxy::check_memory_budget(parsed_policy(with_arena), proxy::MemoryLimit{2 * kGiB, "memory.max"});
  REQUIRE_FALSE(arena_refused);
  CHECK_THAT(arena_refused.error().message, Catch::StartsWith("policy.json: /limits/shm_arena_bytes: "));
  CHECK_THAT(arena_refused.error().message,
             Catch::Contains("(2550136832 bytes) = kv_store_bytes 256 MiB + shm_arena_bytes 2 GiB"));
}

TEST_CASE("memory sizes parse as Kubernetes writes them and print in binary units", "[proxy][memory]") {
  CHECK(proxy::parse_memory_quantity("1073741824").value() == kGiB);
  CHECK(proxy::parse_memory_quantity("512Mi").value() == 512 * kMiB);
  CHECK(proxy::parse_memory_quantity("4Gi").value() == 4 * kGiB);
  CHECK(proxy::parse_memory_quantity("2G").value() == 2'000'000'000ULL);
  CHECK(proxy::parse_memory_quantity("1Ti").value() == 1ULL << 40);
  CHECK_FALSE(proxy::parse_memory_quantity(""));
  CHECK_FALSE(proxy::parse_memory_quantity("Gi"));
  CHECK_FALSE(proxy::parse_memory_quantity("4GB"));
  CHECK_FALSE(proxy::parse_memory_quantity("-1"));
  CHECK(proxy::parse_memory_quantity("20000000000Ti").error().code == ErrorCode::kOverflow);

  CHECK(proxy::memory_size_text(512) == "512 bytes");
  CHECK(proxy::memory_size_text(192 * kMiB) == "192 MiB");
  CHECK(proxy::memory_size_text(kGiB + kGiB / 2) == "1.5 GiB");
  CHECK(proxy::memory_size_text(1536) == "1.5 KiB");
}

TEST_CASE("a reload whose file would not fit the memory limit is rejected, the old policy serving", "[proxy][memory]") {
  test::TempDir dir;
  const auto path = dir / "policy.json";
  test::write_file(path, policy_with_limits({{"kv_store_bytes", 256 * kMiB}}).dump());
  auto initial = load_policy_file(path.string());
  REQUIRE(initial);
  metrics::Registry registry;
  proxy::RuntimePolicy runtime(path.string(), std::make_shared<const Policy>(std::move(initial).value()), registry);
  runtime.set_reload_check([](const Policy& next) {
    return proxy::check_memory_budget(next, proxy::MemoryLimit{kGiB, "memory.max"});
  });

  // kv_store_bytes is read at start only, so the daemon would have reported "restart needed";
  // a restart would refuse it, so the reload is refused now.
  test::write_file(path, policy_with_limits({{"kv_store_bytes", 2 * kGiB}, {"probe_interval_ms", 500}}).dump());
  const auto rejected = runtime.reload();
  REQUIRE_FALSE(rejected);
  CHECK_THAT(rejected.error().message, Catch::Contains(path.string() + ": /limits/kv_store_bytes: expected the "
                                                                       "committed memory to fit"));
  CHECK(runtime.current()->limits.kv_store_bytes == 256 * kMiB);
  CHECK(runtime.current()->limits.probe_interval == std::chrono::milliseconds(1'000));

  test::write_file(path, policy_with_limits({{"kv_store_bytes", 512 * kMiB}, {"probe_interval_ms", 500}}).dump());
  const auto applied = runtime.reload();
  REQUIRE(applied);
  CHECK(applied.value().restart_required == std::vector<std::string>{"/limits/kv_store_bytes"});
  CHECK(runtime.current()->limits.probe_interval == std::chrono::milliseconds(500));
}
