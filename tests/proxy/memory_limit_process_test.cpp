// The real `kvrelay serve` and `check-config` against a fake cgroup tree (hidden --cgroup-root
// and --self-cgroup): a budget over the container's memory limit is refused at start and at reload.
#include <nlohmann/json.hpp>

#include <filesystem>

#include "support/daemon_fixture.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

// A cgroup v2 tree where the pod's cgroup carries `pod_limit` and the container's says "max".
struct FakeCgroupTree {
  TempDir dir;
  explicit FakeCgroupTree(const std::string& pod_limit) {
    std::filesystem::create_directories(dir / "cgroup/pod/kvrelay");
    write_file(dir / "cgroup/pod/memory.max", pod_limit + "\n");
    write_file(dir / "cgroup/pod/kvrelay/memory.max", "max\n");
    write_file(dir / "self_cgroup", "0::/pod/kvrelay\n");
  }
  [[nodiscard]] std::vector<std::string> args() const {
    return {"--cgroup-root", (dir / "cgroup").string(), "--self-cgroup", (dir / "self_cgroup").string()};
  }
  [[nodiscard]] std::string limit_file() const { return (dir / "cgroup/pod/memory.max").string(); }
};

}  // namespace

TEST_CASE("serve refuses a store budget over the container's memory limit and names its pointer",
          "[proxy][memory][process]") {
  const FakeCgroupTree cgroup("536870912");
  TempDir dir;
  write_file(dir / "policy.json", basic_daemon_policy().dump());  // kv_store_bytes: the default 1 GiB
  std::vector<std::string> argv{kvrelay_binary().string(),      "serve",        "--config",
                                (dir / "policy.json").string(), "--ready-file", (dir / "ready.json").string()};
  for (const auto& arg : cgroup.args())
    argv.push_back(arg);
  const auto result = run_command(argv, dir.path(), std::chrono::seconds(20));
  INFO(result.err);
  CHECK(result.exit_status == 2);
  CHECK_THAT(result.err, Catch::Contains((dir / "policy.json").string() +
                                         ": /limits/kv_store_bytes: expected the committed memory to fit the "
                                         "container's memory limit of 512 MiB (536870912 bytes, " +
                                         cgroup.limit_file() + ")"));
  CHECK_THAT(result.err, Catch::Contains("= kv_store_bytes 1 GiB + headroom 128 MiB"));
  CHECK_FALSE(std::filesystem::exists(dir / "ready.json"));
}

TEST_CASE("serve starts within the memory limit and refuses a reload that would not fit", "[proxy][memory][process]") {
  const FakeCgroupTree cgroup("2147483648");
  DaemonUnderTest daemon(basic_daemon_policy(), cgroup.args());
  CHECK_THAT(daemon.process().stderr_text(), Catch::Contains("of the container's memory limit 2 GiB (" +
                                                             cgroup.limit_file() + "): kv_store_bytes 1 GiB"));

  // kv_store_bytes takes effect at a restart only; the restart would be refused, so is the reload.
  auto bigger = basic_daemon_policy();
  bigger["limits"]["kv_store_bytes"] = 4ULL << 30;
  bigger["limits"]["read_timeout_ms"] = 700;
  daemon.write_policy(bigger);
  const auto rejected = admin_request(daemon.admin_port(), "POST", "/admin/reload");
  CHECK(rejected.status == 422);
  CHECK_THAT(rejected.body, Catch::Contains("/limits/kv_store_bytes: expected the committed memory to fit the "
                                            "container's memory limit of 2 GiB"));
  const auto metrics = http_request(daemon.admin_port(), "GET", "/metrics").body;
  CHECK_THAT(metrics, Catch::Contains("kvrelay_config_reloads_total{result=\"rejected\"} 1"));

  auto fits = basic_daemon_policy();
  fits["limits"]["kv_store_bytes"] = 1536ULL << 20;
  daemon.write_policy(fits);
  const auto applied = admin_request(daemon.admin_port(), "POST", "/admin/reload");
  REQUIRE(applied.status == 200);
  CHECK(json::parse(applied.body)["restart_required"] == json::array({"/limits/kv_store_bytes"}));
}

TEST_CASE("check-config --memory-limit holds each policy to a container's limit", "[proxy][memory][process][cli]") {
  TempDir dir;
  write_file(dir / "policy.json", basic_daemon_policy().dump());
  const auto policy_file = (dir / "policy.json").string();
  const auto check = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv{kvrelay_binary().string(), "check-config"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.push_back(policy_file);
    return run_command(argv, dir.path());
  };

  const auto too_small = check({"--memory-limit", "1Gi"});
  CHECK(too_small.exit_status == 1);
  CHECK_THAT(too_small.err, Catch::Contains(policy_file + ": /limits/kv_store_bytes: expected the committed memory "
                                                          "to fit the container's memory limit of 1 GiB"));
  CHECK_THAT(too_small.err, Catch::Contains("--memory-limit 1Gi"));

  const auto fits = check({"--memory-limit", "2Gi"});
  INFO(fits.err);
  CHECK(fits.exit_status == 0);
  CHECK_THAT(fits.out, Catch::Contains(policy_file + ": ok (node test-node"));
  CHECK_THAT(fits.out, Catch::Contains("of the memory limit 2 GiB"));

  // `auto` reads the cgroup as serve does.
  const FakeCgroupTree cgroup("805306368");
  auto automatic = std::vector<std::string>{"--memory-limit", "auto"};
  for (const auto& arg : cgroup.args())
    automatic.push_back(arg);
  const auto from_cgroup = check(automatic);
  CHECK(from_cgroup.exit_status == 1);
  CHECK_THAT(from_cgroup.err, Catch::Contains("memory limit of 768 MiB (805306368 bytes, " + cgroup.limit_file()));

  // Without --memory-limit nothing is held to a limit; a malformed one is an error.
  CHECK(check({}).exit_status == 0);
  const auto malformed = check({"--memory-limit", "4GB"});
  CHECK(malformed.exit_status == 1);
  CHECK_THAT(malformed.err, Catch::Contains("--memory-limit: unknown memory size suffix \"GB\""));
}
