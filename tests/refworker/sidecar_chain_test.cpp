// The reference worker publishes the token ids of the full blocks it publishes, hashed from the
// request's chain root: the sidecar (a real data-plane server in this process, over its real
// socket) files the entry with that chain, which is what lets it leave the node.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kvrelay/kv_store/entry_store.h"
#include "kvrelay/refworker/sidecar_kv_connector.h"
#include "kvrelay/shm_transport/server.h"

#include "support/test_paths.h"

using namespace kvrelay;
using namespace kvrelay::test;

TEST_CASE("refworker publishes the chain of its full blocks, from the request's chain root",
          "[refworker][chain][shm]") {
  TempDir dir;
  auto store = std::make_shared<kv_store::InMemoryEntryStore>(64ULL << 20);
  shm::ShmServerOptions options;
  options.socket_path = (dir / "kvrelay.sock").string();
  auto server = shm::ShmServer::listen(options, store);
  REQUIRE(server.has_value());
  server.value()->start();

  constexpr std::uint64_t kFingerprint = 0x5151;
  refworker::SidecarKvConnector connector(options.socket_path, kFingerprint, 16);
  std::vector<std::int32_t> tokens(45);  // two full blocks and 13 tokens the entry leaves out
  for (std::size_t index = 0; index < tokens.size(); ++index)
    tokens[index] = static_cast<std::int32_t>(3 + index * 7);
  const KvLayout layout{1, 1, 2, DType::kFloat32, tokens.size()};
  const std::vector<float> kv(2 * tokens.size() * 2, 0.5F);
  const BlockHash salted = 0x0123456789abcdefULL;
  const nlohmann::json params{{"chain_root", block_hash_hex(salted)}};
  // The first 20 tokens were the request's prompt (issue #28): the boundary travels in the chain.
  REQUIRE(connector.publish(tokens, layout, kv, params, Fidelity::exact(), 20).has_value());

  const std::vector<TokenId> full(tokens.begin(), tokens.begin() + 32);
  const kv_store::EntryKey key{kFingerprint, hash_blocks(kFingerprint, full, 16, salted).back()};
  const auto entry = store->get_exact(key);
  REQUIRE(entry != nullptr);
  REQUIRE(entry->chain != nullptr);
  CHECK(entry->chain->tokens == full);
  CHECK(entry->chain->block_tokens == 16);
  CHECK(entry->chain->root == salted);
  CHECK(entry->chain->tenant.empty());
  CHECK(entry->chain->prompt_tokens == 20);
  CHECK(kv_store::verify_chain(key, 32, *entry->chain, kv_store::ChainScope::kUnscoped).has_value());
  server.value()->stop();
}
