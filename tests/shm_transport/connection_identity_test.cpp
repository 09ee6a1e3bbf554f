// Who a data-plane connection is, from its SO_PEERCRED uid alone (identify_connection): a worker
// (the daemon's uid or listen.allowed_uids), a same-host peer (peers[].uid), both, or neither.
#include <catch2/catch.hpp>

#include <vector>

#include "kvrelay/shm_transport/server.h"

using namespace kvrelay::shm;

TEST_CASE("a connection's uid makes it a worker, a same-host peer, or refused", "[shm][security]") {
  constexpr std::uint32_t kOwn = 1000;
  const std::vector<std::uint32_t> allowed{2000};
  const std::vector<SameHostPeerUid> peers{{"node-b", 3000}, {"node-c", 2000}};

  const auto own = identify_connection(kOwn, kOwn, allowed, peers);
  REQUIRE(own);
  CHECK(own->worker);
  CHECK(own->peer_id.empty());

  const auto peer = identify_connection(3000, kOwn, allowed, peers);
  REQUIRE(peer);
  CHECK_FALSE(peer->worker);  // limited to lookups
  CHECK(peer->peer_id == "node-b");

  // A uid that is a worker's and a peer's cannot be told apart: a worker, with the peer named.
  const auto both = identify_connection(2000, kOwn, allowed, peers);
  REQUIRE(both);
  CHECK(both->worker);
  CHECK(both->peer_id == "node-c");

  CHECK_FALSE(identify_connection(4242, kOwn, allowed, peers));
  CHECK_FALSE(identify_connection(3000, kOwn, allowed, {}));
}
