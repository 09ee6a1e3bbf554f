#pragma once

// Reference workers behind real kvrelay sidecars, for end-to-end tests of the KV path: agent A
// answers through its sidecar's front proxy, then agent B gets A's prompt + A's output + a
// follow-up through B's sidecar, whose lookup imports A's KV with the medium the route chose.

#include <unistd.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "support/admin_token.h"
#include "support/child_process.h"
#include "support/http_client.h"
#include "support/refworker_process.h"
#include "support/test_paths.h"

namespace kvrelay::test {

// stories260K as the policy describes it (its fingerprint decides what KV may cross).
inline nlohmann::json stories_model_json() {
  return {{"architecture", "llama"}, {"layers", 5},     {"kv_heads", 4},
          {"head_dim", 8},           {"dtype", "fp32"}, {"weights", "stories260K"}};
}

inline constexpr const char* kTinySyntheticShape = "layers=2,dim=64,heads=4,kv_heads=2,ffn=128,vocab=512,seq_len=512";
inline nlohmann::json tiny_synthetic_model_json() {
  return {{"architecture", "llama"}, {"layers", 2},     {"kv_heads", 2},
          {"head_dim", 16},          {"dtype", "fp32"}, {"weights", "synthetic-tiny"}};
}

// A kvrelay sidecar with a Unix-socket data plane and a peer listener, restartable policy file.
class Sidecar {
 public:
  explicit Sidecar(const std::string& node_id) : node_id_(node_id) {}

  [[nodiscard]] std::string socket_path() const { return (dir_ / "kvrelay.sock").string(); }
  [[nodiscard]] const std::string& node_id() const { return node_id_; }

  // run_as: the uid (and gid) the sidecar runs as, through setpriv; needs root. Its directory
  // becomes that uid's, so that it can write its ready file and socket there.
  void start(const nlohmann::json& policy, std::optional<std::uint32_t> run_as = std::nullopt) {
    write_policy(policy);
    const auto config = (dir_ / "policy.json").string();
    const auto ready_file = (dir_ / "ready.json").string();
    std::vector<std::string> argv{kvrelay_binary().string(), "serve", "--config", config, "--ready-file", ready_file};
    if (run_as) {
      REQUIRE(::chown(dir_.path().c_str(), *run_as, *run_as) == 0);
      const auto id = std::to_string(*run_as);
      argv.insert(argv.begin(), {"/usr/bin/setpriv", "--reuid=" + id, "--regid=" + id, "--clear-groups"});
    }
    process_ = std::make_unique<ChildProcess>(std::move(argv), dir_.path());
    const bool ready = wait_until([&] { return std::filesystem::exists(dir_ / "ready.json") || !process_->running(); },
                                  std::chrono::seconds(20));
    if (!ready || !std::filesystem::exists(dir_ / "ready.json"))
      FAIL("sidecar did not start: " << process_->stderr_text());
    const auto ports = nlohmann::json::parse(read_file(dir_ / "ready.json"));
    http_port_ = ports["http"].get<std::uint16_t>();
    admin_port_ = ports.value("admin", std::uint16_t{0});  // absent without listen.admin
    peer_port_ = ports.value("peer", std::uint16_t{0});
  }
  // With the test admin token unless the policy sets "admin" itself (support/admin_token.h).
  void write_policy(const nlohmann::json& policy) {
    write_file(dir_ / "policy.json", with_test_admin_token(policy, dir_.path()).dump(2));
  }
  // Rewrites the policy and applies it live (POST /admin/reload).
  void reload(const nlohmann::json& policy) {
    write_policy(policy);
    const auto reply = admin_request(admin_port(), "POST", "/admin/reload");
    REQUIRE(reply.status == 200);
  }

  // The agent-facing listener: /agents/{agent}/v1/... and health only.
  [[nodiscard]] std::uint16_t http_port() const { return http_port_; }
  // The admin API (/admin/..., /metrics); reload, force_medium, decisions and metric_sum use it.
  [[nodiscard]] std::uint16_t admin_port() const {
    if (admin_port_ == 0) FAIL("sidecar " << node_id_ << " has no listen.admin, so it has no admin API");
    return admin_port_;
  }
  [[nodiscard]] std::uint16_t peer_port() const { return peer_port_; }
  [[nodiscard]] ChildProcess& process() { return *process_; }

  [[nodiscard]] nlohmann::json complete(const std::string& agent, const nlohmann::json& body) const {
    const auto reply = http_request(http_port_, "POST", "/agents/" + agent + "/v1/completions", body.dump(), {},
                                    std::chrono::seconds(60));
    INFO(reply.error << reply.body);
    REQUIRE(reply.status == 200);
    return nlohmann::json::parse(reply.body);
  }
  void force_medium(const std::string& route, const nlohmann::json& medium) const {
    const auto reply =
        admin_request(admin_port(), "PUT", "/admin/routes/" + route, nlohmann::json{{"forced_medium", medium}}.dump());
    INFO(reply.body);
    REQUIRE(reply.status == 200);
  }
  [[nodiscard]] nlohmann::json decisions(int limit = 1) const {
    const auto reply = http_request(admin_port(), "GET", "/admin/decisions?limit=" + std::to_string(limit));
    REQUIRE(reply.status == 200);
    return nlohmann::json::parse(reply.body)["decisions"];
  }
  // Sum of every sample of `metric` whose label set contains all of `labels` ("name=\"value\"").
  [[nodiscard]] double metric_sum(const std::string& metric, const std::vector<std::string>& labels = {}) const {
    const auto reply = http_request(admin_port(), "GET", "/metrics");
    REQUIRE(reply.status == 200);
    double sum = 0.0;
    std::istringstream lines(reply.body);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind(metric, 0) != 0 ||
          (line.size() > metric.size() && line[metric.size()] != '{' && line[metric.size()] != ' ')) {
        continue;
      }
      bool matches = true;
      for (const auto& label : labels)
        matches = matches && line.find(label) != std::string::npos;
      if (matches) sum += std::stod(line.substr(line.rfind(' ') + 1));
    }
    return sum;
  }

 private:
  std::string node_id_;
  TempDir dir_;
  std::unique_ptr<ChildProcess> process_;
  std::uint16_t http_port_ = 0;
  std::uint16_t admin_port_ = 0;
  std::uint16_t peer_port_ = 0;
};

inline nlohmann::json agent_json(const std::string& id, const std::string& node, std::uint16_t upstream_port,
                                 const nlohmann::json& model) {
  nlohmann::json agent{{"id", id},
                       {"upstream", "http://127.0.0.1:" + std::to_string(upstream_port)},
                       {"model", model},
                       {"kv_connector", true}};
  if (!node.empty()) agent["node"] = node;
  return agent;
}

inline nlohmann::json sidecar_policy(const Sidecar& sidecar, nlohmann::json agents, nlohmann::json routes,
                                     nlohmann::json peers = nlohmann::json::array()) {
  return {{"schema_version", 1},
          {"node", {{"id", sidecar.node_id()}}},
          {"listen",
           {{"http", "127.0.0.1:0"},
            {"admin", "127.0.0.1:0"},
            {"peer", "127.0.0.1:0"},
            {"unix_socket", sidecar.socket_path()}}},
          {"peers", std::move(peers)},
          {"agents", std::move(agents)},
          {"routes", std::move(routes)},
          {"limits", {{"kv_lookup_timeout_ms", 5000}, {"peer_summary_interval_ms", 200}}},
          // These tests exercise B's fetch: publishes are not sent ahead unless a test asks
          // (kv_spill_prefetch_test.cpp turns prefetch on; the product's default is on).
          {"kv_store", {{"prefetch", false}}},
          {"logging", {{"level", "warn"}}}};
}

// A's prompt for one scenario: BOS and `length - 1` ids that differ per seed.
inline nlohmann::json context_prompt(int seed, int length = 200) {
  nlohmann::json prompt = nlohmann::json::array({1});
  for (int index = 1; index < length; ++index)
    prompt.push_back(3 + (index * 37 + seed * 101) % 500);
  return prompt;
}

inline nlohmann::json handoff_prompt(const nlohmann::json& a_prompt, const nlohmann::json& a_reply) {
  nlohmann::json prompt = a_prompt;
  for (const auto& id : a_reply["choices"][0]["token_ids"])
    prompt.push_back(id);
  for (const int id : {300, 301, 302, 303, 304})
    prompt.push_back(id);  // B's follow-up
  return prompt;
}

inline nlohmann::json greedy(const nlohmann::json& prompt, int max_tokens, bool ignore_eos = false) {
  return {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", ignore_eos}};
}

// The front proxy files an audited request's outcome when its relay finishes, which can be just
// after the client has read the last byte: the trials file once it holds `outcomes` outcome
// records (or whatever it holds after 10 s).
inline std::string trials_with_outcomes(const std::filesystem::path& path, std::size_t outcomes) {
  std::string text;
  const auto count_outcomes = [&] {
    text = std::filesystem::exists(path) ? read_file(path) : std::string();
    std::size_t found = 0;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (record.is_object() && record.value("event", "") == "outcome") ++found;
    }
    return found >= outcomes;
  };
  (void)wait_until(count_outcomes, std::chrono::seconds(10));
  return text;
}

// Fraction of positions where two greedy outputs agree (top-1 agreement).
inline double top1_agreement(const nlohmann::json& left, const nlohmann::json& right) {
  const auto& a = left["choices"][0]["token_ids"];
  const auto& b = right["choices"][0]["token_ids"];
  const std::size_t length = std::max(a.size(), b.size());
  if (length == 0) return 1.0;
  std::size_t same = 0;
  for (std::size_t index = 0; index < std::min(a.size(), b.size()); ++index)
    if (a[index] == b[index]) ++same;
  return static_cast<double>(same) / static_cast<double>(length);
}

}  // namespace kvrelay::test
