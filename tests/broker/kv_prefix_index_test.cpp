// The store's prefix index through the sidecar daemon (issue #27): the KV path's resolve, the
// one a vLLM connector's scheduler and workers call, serves the blocks a branch of a published
// prompt shares with it. A real `kvrelay serve`, driven through the C ABI.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "support/kv_path_fixture.h"
#include "support/prefix_branch_check.h"

using namespace kvrelay::test;
using nlohmann::json;

TEST_CASE("prefix index through the daemon: a branch of a published prompt resolves the blocks it shares",
          "[proxy][kv_path][prefix_index][process]") {
  Sidecar node{"node-1"};
  // A worker without a route: plain prefix reuse, the KV path's plan, materialize and record.
  node.start(
      sidecar_policy(node, json::array({agent_json("writer", "", 1, tiny_synthetic_model_json())}), json::array()));
  check_branch_resolves_shared_blocks(node.socket_path(), 4242);
  const auto decisions = node.decisions(8);
  std::size_t branch_hits = 0;
  for (const auto& decision : decisions) {
    if (decision.value("kind", "") == "lookup" && decision.value("outcome", "") == "hit_local" &&
        decision.value("served_tokens", std::uint64_t{0}) == 2 * kBranchBlockTokens) {
      CHECK(decision["kv_from"] == "local");
      ++branch_hits;
    }
  }
  CHECK(branch_hits == 2);  // the reserving resolve and the mapped one
}
