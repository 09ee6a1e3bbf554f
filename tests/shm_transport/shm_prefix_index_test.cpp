// The store's prefix index on the store-only data plane (issue #27): a real sidecar process, real
// socket and memfds, driven through the C ABI as a connector drives it.
#include <catch2/catch.hpp>

#include "shm_fixture.h"
#include "support/prefix_branch_check.h"

using namespace kvrelay::test;

TEST_CASE("prefix index: a prompt sharing 2 of a published entry's 4 blocks resolves and claims exactly those 2",
          "[shm][c_api][prefix_index]") {
  ServerProcess server;
  check_branch_resolves_shared_blocks(server.socket_path(), 91);
}
