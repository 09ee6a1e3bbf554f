// Authorization on the peer plane (issue #25), against a real TLS daemon: a peer pushes only on
// routes from its own agents to this node's, and fetches only KV of models its agents use.
#include "kvrelay/peer/peer_authorization.h"

#include <catch2/catch.hpp>

#include "peer_security_fixture.h"
#include "support/peer_fixture.h"

namespace kvrelay::test {

TEST_CASE("an agent with tensor_parallel_size owns its ranks' shards of KV heads, and only those", "[peer][security]") {
  AgentPolicy agent;
  agent.model = ModelFingerprint{"llama", 32, 8, 128, DType::kBFloat16, "w"};
  const auto shaped = [](std::uint32_t heads) { return KvLayout{32, heads, 128, DType::kBFloat16, 16}; };
  CHECK(peer::agent_model_shape(agent, shaped(8)));
  CHECK_FALSE(peer::agent_model_shape(agent, shaped(4)));  // TP 1: a shard is another model's KV
  agent.tensor_parallel_size = 2;
  CHECK(peer::agent_model_shape(agent, shaped(8)));
  CHECK(peer::agent_model_shape(agent, shaped(4)));
  CHECK_FALSE(peer::agent_model_shape(agent, shaped(2)));
  agent.tensor_parallel_size = 16;  // more ranks than heads: each holds one replicated head
  CHECK(peer::agent_model_shape(agent, shaped(1)));
  CHECK_FALSE(peer::agent_model_shape(agent, KvLayout{32, 1, 64, DType::kBFloat16, 16}));
}

TEST_CASE("a peer pushing on a route it does not own is refused with an error, and nothing is stored",
          "[peer][security]") {
  const DevCerts certs({"node-a", "node-b"});
  TlsPeerDaemon daemon(certs);
  const auto frame = kv_frame(64U << 10, 7);
  const std::uint64_t writer_model = daemon.model_of("writer");
  struct Refused {
    const char* route;
    kv_store::EntryKey key;
    const char* says;
  };
  const Refused cases[] = {
      // writer lives on node-a: node-b does not own writer-to-reader.
      {"writer-to-reader", {writer_model, 1}, "route writer-to-reader's from agent writer does not live on that peer"},
      {"", {writer_model, 2}, "route '' is not in node node-a's policy"},
      {"no-such-route", {writer_model, 3}, "route 'no-such-route' is not in node node-a's policy"},
  };
  for (const auto& refused : cases) {
    INFO("route '" << refused.route << "'");
    auto client = peer::PeerClient::connect(daemon.peer_address(), peer_as("node-b", certs.client("node-b")));
    REQUIRE(client.has_value());
    const auto pushed = client.value().push_encoded(9, refused.key, frame.chain, frame.bytes(), refused.route);
    REQUIRE_FALSE(pushed.has_value());
    CHECK(pushed.error().code == ErrorCode::kPermissionDenied);
    CHECK_THAT(pushed.error().message, Catch::Contains(refused.says));
    CHECK_FALSE(daemon.holds(refused.key));
  }
  // The right route, but KV of another model than its destination agent's: refused once decoded.
  {
    auto client = peer::PeerClient::connect(daemon.peer_address(), peer_as("node-b", certs.client("node-b")));
    REQUIRE(client.has_value());
    const auto other_kv = kv_frame(64U << 10, 8, "raw", other_model_shape());
    const kv_store::EntryKey key = other_kv.key(writer_model);
    const auto pushed = client.value().push_encoded(11, key, other_kv.chain, other_kv.bytes(), "reader-to-writer");
    REQUIRE_FALSE(pushed.has_value());
    CHECK(pushed.error().code == ErrorCode::kPermissionDenied);
    CHECK_THAT(pushed.error().message,
               Catch::Contains("its entry is not of route reader-to-writer's to agent's model"));
    CHECK_FALSE(daemon.holds(key));
  }
  CHECK(daemon.refused("push") == 4);
  // The route node-b owns is accepted.
  auto client = peer::PeerClient::connect(daemon.peer_address(), peer_as("node-b", certs.client("node-b")));
  REQUIRE(client.has_value());
  const kv_store::EntryKey key = frame.key(writer_model);
  REQUIRE(client.value().push_encoded(10, key, frame.chain, frame.bytes(), "reader-to-writer").has_value());
  CHECK(daemon.holds(key));
}

TEST_CASE("a pushed entry whose token ids do not hash to its key is refused, and nothing is stored",
          "[peer][security]") {
  const DevCerts certs({"node-a", "node-b"});
  TlsPeerDaemon daemon(certs);
  const auto frame = kv_frame(64U << 10, 31);
  const std::uint64_t writer_model = daemon.model_of("writer");
  const kv_store::EntryKey key = frame.key(writer_model);
  struct Lie {
    const char* what;
    kv_store::EntryChain chain;
    const char* says;
  };
  auto one_token_changed = frame.chain;
  one_token_changed.tokens[3] ^= 1U;
  auto other_root = frame.chain_at(0x1234);
  auto one_block_less = kv_store::chain_prefix(frame.chain, 0);
  const Lie lies[] = {
      {"a token id changed", one_token_changed, "token ids hash to"},
      {"another chain root", other_root, "token ids hash to"},
      {"no token ids", one_block_less, "carries 0 token ids"},
  };
  std::uint64_t id = 50;
  for (const auto& lie : lies) {
    INFO(lie.what);
    auto client = peer::PeerClient::connect(daemon.peer_address(), peer_as("node-b", certs.client("node-b")));
    REQUIRE(client.has_value());
    const auto pushed = client.value().push_encoded(id++, key, lie.chain, frame.bytes(), "reader-to-writer");
    REQUIRE_FALSE(pushed.has_value());
    CHECK(pushed.error().code == ErrorCode::kChainMismatch);
    CHECK_THAT(pushed.error().message, Catch::Contains(lie.says));
    CHECK_FALSE(daemon.holds(key));
  }
  CHECK(daemon.refused("chain") == 3);
  {  // KV of a tenant the route's from agent is not of (this policy has no tenants at all).
    auto a_tenant = frame.chain;
    a_tenant.tenant = "acme";
    auto client = peer::PeerClient::connect(daemon.peer_address(), peer_as("node-b", certs.client("node-b")));
    REQUIRE(client.has_value());
    const auto pushed = client.value().push_encoded(id++, key, a_tenant, frame.bytes(), "reader-to-writer");
    REQUIRE_FALSE(pushed.has_value());
    CHECK(pushed.error().code == ErrorCode::kPermissionDenied);
    CHECK_THAT(pushed.error().message, Catch::Contains("its entry is of tenant 'acme'"));
    CHECK_FALSE(daemon.holds(key));
    CHECK(daemon.refused("push") == 1);
  }
  // The same KV with its own token ids is filed, and a fetch returns them with it.
  auto client = peer::PeerClient::connect(daemon.peer_address(), peer_as("node-b", certs.client("node-b")));
  REQUIRE(client.has_value());
  CHECK(client.value().stats().value().committed_transfers == 0);
  REQUIRE(client.value().push_encoded(id, key, frame.chain, frame.bytes(), "reader-to-writer").has_value());
  CHECK(daemon.holds(key));
  auto fetched = client.value().fetch(peer::FetchRequest{1, key.model_id, "raw", {key.context_hash}}, 1ULL << 32);
  REQUIRE(fetched.has_value());
  REQUIRE(fetched.value().has_value());
  CHECK(fetched.value()->chain == frame.chain);
}

TEST_CASE("a fetch of a model none of the peer's agents uses is answered not found, and counted", "[peer][security]") {
  const DevCerts certs({"node-a", "node-b"});
  TlsPeerDaemon daemon(certs);
  auto client = peer::PeerClient::connect(daemon.peer_address(), peer_as("node-b", certs.client("node-b")));
  REQUIRE(client.has_value());
  // node-b may push to both agents here (its reader has routes to writer and to other), but its
  // own agents use only writer's model.
  const auto frame = kv_frame(64U << 10, 21);
  const auto other_kv = kv_frame(64U << 10, 22, "raw", other_model_shape());
  const kv_store::EntryKey used = frame.key(daemon.model_of("writer"));
  const kv_store::EntryKey unused = other_kv.key(daemon.model_of("other"));
  REQUIRE(client.value().push_encoded(21, used, frame.chain, frame.bytes(), "reader-to-writer").has_value());
  REQUIRE(client.value().push_encoded(22, unused, other_kv.chain, other_kv.bytes(), "reader-to-other").has_value());
  REQUIRE(daemon.holds(unused));
  const auto fetch = [&](const kv_store::EntryKey& key) {
    auto fetched =
        client.value().fetch(peer::FetchRequest{key.context_hash, key.model_id, "raw", {key.context_hash}}, 1ULL << 32);
    REQUIRE(fetched.has_value());
    return fetched.value().has_value();
  };
  CHECK_FALSE(fetch(unused));
  CHECK(daemon.refused("fetch") == 1);
  CHECK(fetch(used));
  CHECK(daemon.refused("fetch") == 1);
}

}  // namespace kvrelay::test
