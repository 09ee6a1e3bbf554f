// TLS on the peer plane (issue #25), against real daemons: who is refused at the handshake or at
// an identity the policy does not know, before any kvrelay frame is read, and that the daemon
// serves the next good peer; and the policy rule that plaintext peers stay on loopback.
#include <catch2/catch.hpp>

#include "peer_security_fixture.h"
#include "support/peer_fixture.h"

namespace kvrelay::test {

namespace {

// Connects and exchanges hellos; returns why it failed ("" if it did not).
std::string refusal(const TlsPeerDaemon& daemon, const peer::PeerClientOptions& options) {
  auto client = peer::PeerClient::connect(daemon.peer_address(), options);
  if (client) return "";
  return client.error().to_string();
}

}  // namespace

TEST_CASE(
    "peers without a certificate, from another CA, expired, unknown to the policy or plaintext are refused "
    "before any frame, and the daemon serves the next good peer",
    "[peer][security]") {
  const DevCerts certs({"node-a", "node-b", "node-x"});
  const DevCerts other_ca({"node-b"});
  const DevCerts expired(certs, {"node-b"},
                         {"KVRELAY_CERT_STARTDATE=20200101000000Z", "KVRELAY_CERT_ENDDATE=20200102000000Z"});
  TlsPeerDaemon daemon(certs);

  CHECK_FALSE(refusal(daemon, peer_as("node-b", certs.client(""))).empty());                       // no certificate
  CHECK_FALSE(refusal(daemon, peer_as("node-b", other_ca.client("node-b", certs.ca()))).empty());  // wrong CA
  CHECK_FALSE(refusal(daemon, peer_as("node-b", expired.client("node-b", certs.ca()))).empty());   // expired
  peer::PeerClientOptions plaintext;
  plaintext.node_id = "node-b";
  CHECK_FALSE(refusal(daemon, plaintext).empty());
  CHECK_FALSE(refusal(daemon, peer_as("node-x", certs.client("node-x"))).empty());  // a CA-signed stranger
  // The four that failed the handshake and the stranger were closed before a frame was read.
  REQUIRE(wait_until([&] { return daemon.refused("handshake") == 4 && daemon.refused("identity") == 1; },
                     std::chrono::seconds(20)));
  const std::string log = daemon.process().stderr_text();
  CHECK_THAT(log, Catch::Contains("refused before any frame was read"));
  CHECK_THAT(log, Catch::Contains("no peer identity in the policy"));
  CHECK_THAT(log, !Catch::Contains("peer session:"));  // no session read a frame and failed

  // node-b, as the policy names it, connects, and a push and a fetch go through.
  auto good = peer::PeerClient::connect(daemon.peer_address(), peer_as("node-b", certs.client("node-b")));
  REQUIRE(good.has_value());
  CHECK(good.value().remote().node_id == "node-a");
  CHECK(peer::names_identity(good.value().remote_certificate(), "node-a"));
  CHECK(peer::seconds_until(good.value().remote_certificate().not_after) > 0);
  const auto frame = kv_frame(3U << 20, 41);
  const kv_store::EntryKey key = frame.key(daemon.model_of("writer"));
  REQUIRE(good.value().push_encoded(41, key, frame.chain, frame.bytes(), "reader-to-writer").has_value());
  auto fetched = good.value().fetch(peer::FetchRequest{1, key.model_id, "raw", {key.context_hash}}, 1ULL << 32);
  REQUIRE(fetched.has_value());
  REQUIRE(fetched.value().has_value());
  CHECK(same_bytes(decoded_kv(fetched.value()->frame()), frame.kv));

  // node-b's certificate cannot open a session as another node.
  CHECK_THAT(refusal(daemon, peer_as("node-c", certs.client("node-b"))),
             Catch::Contains("peer hello names node node-c, which its certificate does not"));
  CHECK(daemon.refused("identity") == 2);

  // A client refuses a server whose certificate does not name the identity it expects.
  auto options = peer_as("node-b", certs.client("node-b"));
  options.identity = dev_spiffe_id("node-c");
  CHECK_THAT(refusal(daemon, options), Catch::Contains("not identity 'spiffe://kvrelay.dev/node/node-c'"));

  // /admin/peers shows TLS and when this node's certificate expires.
  const auto peers = daemon.admin_get("/admin/peers");
  CHECK(peers["tls"] == true);
  CHECK(peers["certificate_expires_in_s"].get<double>() > 0);
}

TEST_CASE("a daemon refuses to start with plaintext peers off loopback, naming the JSON pointer", "[peer][security]") {
  TempDir dir;
  const auto refused_start = [&](const nlohmann::json& policy) {
    write_file(dir / "policy.json", policy.dump());
    const auto run =
        run_command({kvrelay_binary().string(), "serve", "--config", (dir / "policy.json").string()}, dir.path());
    CHECK(run.exit_status == 2);
    return run.err;
  };
  auto policy = basic_daemon_policy();
  policy["listen"]["peer"] = "0.0.0.0:0";
  CHECK_THAT(refused_start(policy), Catch::Contains("/listen/peer: plaintext peer listener on 0.0.0.0:0, off "
                                                    "loopback: needs /peer_tls (certificates) or "
                                                    "/peer_tls/trusted_network"));
  policy["listen"]["peer"] = "127.0.0.1:0";
  policy["peers"] = nlohmann::json::array({{{"id", "node-b"}, {"address", "10.1.2.3:7070"}}});
  CHECK_THAT(refused_start(policy), Catch::Contains("/peers/0/address: plaintext peer at 10.1.2.3:7070"));
  // Half a TLS configuration is no configuration.
  policy["peer_tls"] = {{"certificate", "a.pem"}};
  CHECK_THAT(refused_start(policy), Catch::Contains("/peer_tls: certificate, private_key and ca_bundle go together"));
  // A network the policy says is trusted may carry plaintext.
  policy["listen"]["peer"] = "0.0.0.0:0";
  policy["peer_tls"] = {{"trusted_network", true}};
  DaemonUnderTest trusted(policy);
  CHECK(trusted.process().running());
}

TEST_CASE("peer TLS files that change are reloaded for new connections, and a bad one keeps the old",
          "[peer][security]") {
  const DevCerts certs({"node-a", "node-b"});
  TlsPeerDaemon daemon(certs);
  const auto expiry = [&] {
    auto client = peer::PeerClient::connect(daemon.peer_address(), peer_as("node-b", certs.client("node-b")));
    REQUIRE(client.has_value());
    return client.value().remote_certificate().not_after;
  };
  const auto first = expiry();
  // A broken certificate file: the daemon logs it and keeps serving with the old context.
  write_file(certs.certificate("node-a"), "not a certificate\n");
  REQUIRE(wait_until([&] { return daemon.process().stderr_text().find("not loaded") != std::string::npos; },
                     std::chrono::seconds(20)));
  CHECK(expiry() == first);
  // A new certificate and key (valid for 30 days, not 365) are picked up without a restart.
  certs.add({"node-a"}, {"KVRELAY_CERT_DAYS=30"});
  REQUIRE(wait_until([&] { return expiry() < first; }, std::chrono::seconds(20)));
}

}  // namespace kvrelay::test
