// What the front proxy sends a worker in kv_transfer_params.kvrelay, observed at an upstream that
// records each request body: the sidecar's fields overwrite whatever the client sent, the chain
// root is the agent's tenant's (with the request's cache_salt), the fields are signed with the
// node key, and a client's treatment passes only where a route into the agent allows it.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvrelay/broker/request_signature.h"
#include "kvrelay/broker/tenant_chain.h"
#include "kvrelay/core/block_hash.h"

#include "support/kv_path_fixture.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

// An HTTP upstream that answers every request with a small completion and keeps its body.
class RecordingUpstream {
 public:
  RecordingUpstream() {
    listener_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t length = sizeof(address);
    if (listener_ < 0 || ::bind(listener_, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
        ::listen(listener_, 16) != 0 || ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
      throw std::runtime_error("recording upstream: cannot listen");
    }
    port_ = ntohs(address.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~RecordingUpstream() {
    stopping_ = true;
    thread_.join();
    ::close(listener_);
  }
  RecordingUpstream(const RecordingUpstream&) = delete;
  RecordingUpstream& operator=(const RecordingUpstream&) = delete;

  [[nodiscard]] std::uint16_t port() const { return port_; }
  [[nodiscard]] json last_body() {
    std::lock_guard lock(mutex_);
    REQUIRE_FALSE(bodies_.empty());
    return json::parse(bodies_.back());
  }

 private:
  void serve() {
    while (!stopping_) {
      pollfd ready{listener_, POLLIN, 0};
      if (::poll(&ready, 1, 50) <= 0) continue;
      const int connection = ::accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC);
      if (connection < 0) continue;
      answer(connection);
      ::close(connection);
    }
  }
  void answer(int connection) {
    std::string request;
    char buffer[4096];
    std::size_t body_start = std::string::npos;
    std::size_t content_length = 0;
    while (body_start == std::string::npos || request.size() < body_start + content_length) {
      const auto got = ::recv(connection, buffer, sizeof(buffer), 0);
      if (got <= 0) return;
      request.append(buffer, static_cast<std::size_t>(got));
      if (body_start == std::string::npos) {
        const auto end = request.find("\r\n\r\n");
        if (end == std::string::npos) continue;
        body_start = end + 4;
        std::string headers = request.substr(0, end);
        for (auto& c : headers)
          c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        if (const auto at = headers.find("content-length:"); at != std::string::npos) {
          content_length = std::stoul(headers.substr(at + 15));
        }
      }
    }
    {
      std::lock_guard lock(mutex_);
      bodies_.push_back(request.substr(body_start, content_length));
    }
    const std::string reply_body = R"({"choices":[{"text":"ok"}]})";
    const std::string reply =
        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
        "Content-Length: " +
        std::to_string(reply_body.size()) + "\r\n\r\n" + reply_body;
    [[maybe_unused]] const auto sent = ::send(connection, reply.data(), reply.size(), MSG_NOSIGNAL);
  }

  int listener_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stopping_{false};
  std::mutex mutex_;
  std::vector<std::string> bodies_;
  std::thread thread_;
};

constexpr const char* kSignedAcmeSalt = "acme-tenant-salt-0123456789abcdef";
constexpr const char* kSignedNodeKey = "node-key-of-node-1-0123456789";

}  // namespace

TEST_CASE("the front proxy overwrites a client's kvrelay fields, salts the chain root and signs them",
          "[proxy][tenant][security][process]") {
  RecordingUpstream upstream;
  TempDir secrets;
  write_file(secrets / "acme.salt", kSignedAcmeSalt);
  write_file(secrets / "node.key", kSignedNodeKey);
  Sidecar node("node-1");
  const auto agent = [&](const std::string& id) {
    json described = agent_json(id, "", upstream.port(), stories_model_json());
    described["tenant"] = "acme";
    return described;
  };
  json policy = sidecar_policy(
      node, json::array({agent("x"), agent("y")}),
      json::array(
          {{{"id", "into-x"}, {"from", "y"}, {"to", "x"}},
           {{"id", "into-y"}, {"from", "x"}, {"to", "y"}, {"audit", {{"fraction", 0}, {"client_treatments", true}}}}}));
  policy["tenants"] = json::array({{{"id", "acme"}, {"salt_file", (secrets / "acme.salt").string()}}});
  policy["signing"] = {{"node_key_file", (secrets / "node.key").string()}};
  node.start(policy);

  const json spoofed{{"agent", "evil"},
                     {"node", "evil-node"},
                     {"route", "into-y"},
                     {"routes", {"into-y"}},
                     {"request_id", "forged-request"},
                     {"tenant", "globex"},
                     {"chain_root", "0000000000000001"},
                     {"signature", std::string(64, 'f')},
                     {"treatment", {{"name", "T0"}, {"medium", "tokens"}, {"span", "none"}}}};
  json body{{"prompt", {1, 2, 3}}, {"max_tokens", 2}, {"cache_salt", "conversation-7"}};
  body["kv_transfer_params"] = {{"kvrelay", spoofed}, {"other", 1}};
  REQUIRE(http_request(node.http_port(), "POST", "/agents/x/v1/completions", body.dump()).status == 200);

  const auto sent = upstream.last_body();
  const auto& kvrelay = sent["kv_transfer_params"]["kvrelay"];
  INFO(kvrelay.dump());
  CHECK(sent["kv_transfer_params"]["other"] == 1);  // the client's own parameters stay
  CHECK(kvrelay["agent"] == "x");
  CHECK(kvrelay["node"] == "node-1");
  CHECK_FALSE(kvrelay.contains("route"));
  CHECK(kvrelay["routes"] == json::array({"into-x"}));
  CHECK(kvrelay["request_id"] != "forged-request");
  CHECK(kvrelay["tenant"] == "acme");
  CHECK(kvrelay["chain_root"] ==
        kvrelay::block_hash_hex(kvrelay::broker::derive_chain_root(kSignedAcmeSalt, "conversation-7")));
  CHECK_FALSE(kvrelay.contains("treatment"));  // no route into x allows client treatments
  CHECK(kvrelay::broker::request_signature_valid(kvrelay, kSignedNodeKey));
  const auto dump = sent.dump();
  CHECK(dump.find(kSignedAcmeSalt) == std::string::npos);  // the salt itself never leaves the sidecar
  CHECK(node.metric_sum("kvrelay_proxy_client_treatments_dropped_total", {"agent=\"x\""}) == 1);
  const auto logged = node.process().stderr_text();
  CHECK(logged.find("dropped the client's kv_transfer_params.kvrelay.treatment") != std::string::npos);

  // into-y's audit lets clients (the offline audit runner) choose: the treatment passes, signed.
  REQUIRE(http_request(node.http_port(), "POST", "/agents/y/v1/completions", body.dump()).status == 200);
  const auto to_y = upstream.last_body()["kv_transfer_params"]["kvrelay"];
  CHECK(to_y["agent"] == "y");
  CHECK(to_y["treatment"]["name"] == "T0");
  CHECK(kvrelay::broker::request_signature_valid(to_y, kSignedNodeKey));
  CHECK(node.metric_sum("kvrelay_proxy_client_treatments_dropped_total", {"agent=\"y\""}) == 0);
}

TEST_CASE("salt and key files are read again on reload, and a bad one keeps the running secrets",
          "[proxy][tenant][security][process]") {
  RecordingUpstream upstream;
  TempDir secrets;
  write_file(secrets / "acme.salt", kSignedAcmeSalt);
  write_file(secrets / "node.key", kSignedNodeKey);
  Sidecar node("node-1");
  json described = agent_json("x", "", upstream.port(), stories_model_json());
  described["tenant"] = "acme";
  json policy = sidecar_policy(node, json::array({described}), json::array());
  policy["tenants"] = json::array({{{"id", "acme"}, {"salt_file", (secrets / "acme.salt").string()}}});
  policy["signing"] = {{"node_key_file", (secrets / "node.key").string()}};
  node.start(policy);
  const auto forwarded = [&] {
    const json body{{"prompt", {1, 2, 3}}, {"max_tokens", 2}};
    REQUIRE(http_request(node.http_port(), "POST", "/agents/x/v1/completions", body.dump()).status == 200);
    return upstream.last_body()["kv_transfer_params"]["kvrelay"];
  };
  const auto root_of = [](const char* salt) {
    return kvrelay::block_hash_hex(kvrelay::broker::derive_chain_root(salt, ""));
  };
  CHECK(forwarded()["chain_root"] == root_of(kSignedAcmeSalt));

  // Rotated salt and key: the next request uses both.
  constexpr const char* kRotatedSalt = "acme-rotated-salt-0123456789abcdef";
  constexpr const char* kRotatedKey = "node-key-rotated-0123456789";
  write_file(secrets / "acme.salt", kRotatedSalt);
  write_file(secrets / "node.key", kRotatedKey);
  node.reload(policy);
  auto rotated = forwarded();
  CHECK(rotated["chain_root"] == root_of(kRotatedSalt));
  CHECK(kvrelay::broker::request_signature_valid(rotated, kRotatedKey));

  // A salt file cut short fails the reload, naming its pointer and not its contents; the
  // running secrets stay.
  write_file(secrets / "acme.salt", "too-short");
  const auto refused = admin_request(node.admin_port(), "POST", "/admin/reload");
  CHECK(refused.status != 200);
  CHECK(refused.body.find("/tenants/0/salt_file") != std::string::npos);
  CHECK(refused.body.find("too-short") == std::string::npos);
  rotated = forwarded();
  CHECK(rotated["chain_root"] == root_of(kRotatedSalt));
  CHECK(kvrelay::broker::request_signature_valid(rotated, kRotatedKey));
}
