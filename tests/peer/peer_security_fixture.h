#pragma once

// A TLS peer daemon for the security tests (issue #25): node-a, whose policy knows one peer,
// node-b (by its SPIFFE ID), and agents on both: writer and other here, reader on node-b. writer
// and reader share a model (kv_frame's default shape); other's has half the head size.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <sstream>
#include <string>

#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/peer/peer_client.h"
#include "kvrelay/shm_transport/client.h"

#include "support/daemon_fixture.h"
#include "support/dev_certs.h"
#include "support/http_client.h"

namespace kvrelay::test {

inline constexpr std::uint32_t kOtherHeadDim = 32;
// KV of other's model (kv_frame's default is writer's and reader's).
inline KvLayout other_model_shape() {
  return KvLayout{2, 2, kOtherHeadDim, DType::kFloat16, 1};
}

inline nlohmann::json security_agent(const std::string& id, const std::string& node, std::uint32_t head_dim) {
  const nlohmann::json model{{"architecture", "llama"}, {"layers", 2},     {"kv_heads", 2},
                             {"head_dim", head_dim},    {"dtype", "fp16"}, {"weights", "security-test"}};
  nlohmann::json agent{{"id", id}, {"upstream", "http://127.0.0.1:1"}, {"model", model}};
  if (!node.empty()) agent["node"] = node;
  return agent;
}

class TlsPeerDaemon {
 public:
  explicit TlsPeerDaemon(const DevCerts& certs) {
    policy_ = basic_daemon_policy();
    policy_["node"]["id"] = "node-a";
    policy_["listen"]["peer"] = "127.0.0.1:0";
    policy_["listen"]["unix_socket"] = socket_path_;
    policy_["limits"]["kv_store_bytes"] = 1ULL << 28;
    policy_["limits"]["peer_summary_interval_ms"] = 0;
    policy_["peer_tls"] = certs.peer_tls("node-a");
    policy_["peers"] =
        nlohmann::json::array({{{"id", "node-b"}, {"address", "127.0.0.1:1"}, {"identity", dev_spiffe_id("node-b")}}});
    policy_["agents"] =
        nlohmann::json::array({security_agent("writer", "", 64), security_agent("other", "", kOtherHeadDim),
                               security_agent("reader", "node-b", 64)});
    policy_["routes"] = nlohmann::json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}},
                                               {{"id", "reader-to-writer"}, {"from", "reader"}, {"to", "writer"}},
                                               {{"id", "reader-to-other"}, {"from", "reader"}, {"to", "other"}}});
    daemon_ = std::make_unique<DaemonUnderTest>(policy_);
    peer_port_ = nlohmann::json::parse(read_file(daemon_->dir() / "ready.json"))["peer"].get<std::uint16_t>();
  }

  [[nodiscard]] HostPort peer_address() const { return {"127.0.0.1", peer_port_}; }
  [[nodiscard]] ChildProcess& process() { return daemon_->process(); }
  // The fingerprint id of an agent's model: what its KV is filed under.
  [[nodiscard]] std::uint64_t model_of(const std::string& agent) const {
    auto parsed = parse_policy(policy_.dump(), "policy.json");
    REQUIRE(parsed.has_value());
    return parsed.value().find_agent(agent)->model.id();
  }
  [[nodiscard]] bool holds(const kv_store::EntryKey& key) const {
    auto client = shm::ShmClient::connect(socket_path_);
    if (!client) FAIL("unix socket connect: " << client.error().to_string());
    return client.value().lookup(key).has_value();
  }
  // kvrelay_peer_refused_total{reason="..."} at /metrics.
  [[nodiscard]] double refused(const std::string& reason) const {
    const auto reply = http_request(daemon_->admin_port(), "GET", "/metrics");
    REQUIRE(reply.status == 200);
    const std::string sample = "kvrelay_peer_refused_total{reason=\"" + reason + "\"} ";
    std::istringstream lines(reply.body);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind(sample, 0) == 0) return std::stod(line.substr(sample.size()));
    }
    return 0.0;
  }
  [[nodiscard]] nlohmann::json admin_get(const std::string& path) const {
    const auto reply = http_request(daemon_->admin_port(), "GET", path);
    REQUIRE(reply.status == 200);
    return nlohmann::json::parse(reply.body);
  }

 private:
  TempDir socket_dir_;
  std::string socket_path_ = (socket_dir_ / "kvrelay.sock").string();
  nlohmann::json policy_;
  std::unique_ptr<DaemonUnderTest> daemon_;
  std::uint16_t peer_port_ = 0;
};

// A client that connects as node `id` with `tls` and expects node-a's certificate.
inline peer::PeerClientOptions peer_as(const std::string& id, std::shared_ptr<peer::PeerTls> tls) {
  peer::PeerClientOptions options;
  options.node_id = id;
  options.tls = std::move(tls);
  options.identity = "node-a";
  return options;
}

}  // namespace kvrelay::test
