#pragma once

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <csignal>
#include <memory>
#include <string>
#include <vector>

#include "support/admin_token.h"
#include "support/child_process.h"
#include "support/http_client.h"
#include "support/test_paths.h"

namespace kvrelay::test {

// A kvrelay daemon in its own process, on kernel-chosen ports, found through its ready file.
// Its policy gets the test admin token unless it sets "admin" itself (support/admin_token.h).
class DaemonUnderTest {
 public:
  // `extra_args` go after serve's own (e.g. --cgroup-root for a fake cgroup tree).
  explicit DaemonUnderTest(const nlohmann::json& policy, const std::vector<std::string>& extra_args = {}) {
    write_file(dir_ / "policy.json", with_test_admin_token(policy, dir_.path()).dump(2));
    std::vector<std::string> argv{kvrelay_binary().string(),       "serve",        "--config",
                                  (dir_ / "policy.json").string(), "--ready-file", (dir_ / "ready.json").string()};
    argv.insert(argv.end(), extra_args.begin(), extra_args.end());
    process_ = std::make_unique<ChildProcess>(std::move(argv), dir_.path());
    const bool ready = wait_until([&] { return std::filesystem::exists(dir_ / "ready.json") || !process_->running(); },
                                  std::chrono::seconds(20));
    if (!ready || !std::filesystem::exists(dir_ / "ready.json")) {
      FAIL("daemon did not start: " << process_->stderr_text());
    }
    const auto ports = nlohmann::json::parse(read_file(dir_ / "ready.json"));
    http_port_ = ports["http"].get<std::uint16_t>();
    admin_port_ = ports.value("admin", std::uint16_t{0});  // absent without listen.admin
  }

  // The agent-facing listener (listen.http): agents, health, and /metrics with listen.metrics_on_http.
  [[nodiscard]] std::uint16_t http_port() const { return http_port_; }
  // The admin API's listener (listen.admin); a test that asks for it without one fails here.
  [[nodiscard]] std::uint16_t admin_port() const {
    if (admin_port_ == 0) FAIL("the daemon's policy has no listen.admin, so it has no admin API");
    return admin_port_;
  }
  [[nodiscard]] bool has_admin_listener() const { return admin_port_ != 0; }
  // Rewrites the policy file (for a reload), with the test admin token as at start.
  void write_policy(const nlohmann::json& policy) const {
    write_file(dir_ / "policy.json", with_test_admin_token(policy, dir_.path()).dump(2));
  }
  [[nodiscard]] ChildProcess& process() { return *process_; }
  [[nodiscard]] const TempDir& dir() const { return dir_; }

 private:
  TempDir dir_;
  std::unique_ptr<ChildProcess> process_;
  std::uint16_t http_port_ = 0;
  std::uint16_t admin_port_ = 0;
};

// The admin API is only on listen.admin, so every test daemon gets one; delete it to test without.
inline nlohmann::json basic_daemon_policy() {
  return nlohmann::json::parse(R"({
    "schema_version": 1,
    "node": {"id": "test-node"},
    "listen": {"http": "127.0.0.1:0", "admin": "127.0.0.1:0"},
    "limits": {"max_header_bytes": 2048, "max_body_bytes": 4096, "read_timeout_ms": 500}
  })");
}

}  // namespace kvrelay::test
