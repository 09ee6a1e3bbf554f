// The daemon's store evicts by utility (issue #27): a real `kvrelay serve` with room for two
// entries, driven through the C ABI. An entry looked up often outlives a newer one never looked
// up, and GET /admin/kv and /metrics count the eviction.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "support/kv_path_fixture.h"
#include "support/prefix_branch_check.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr std::uint64_t kEvictionModel = 5151;
constexpr std::size_t kEntryTokens = 4 * kBranchBlockTokens;
constexpr std::uint64_t kEntryBytes = kEntryTokens * 2 * kBranchRowBytes;  // K and V

// Resolves `ids` plus one token more (the prompt's last token is always computed); the tokens
// served, 0 on a miss.
std::uint64_t resolve_tokens(kvrelay_client* client, std::vector<std::uint32_t> ids) {
  ids.push_back(5);
  const auto request = branch_resolve_request(kEvictionModel, ids, 0);
  kvrelay_resolved resolved{};
  resolved.struct_size = sizeof(resolved);
  kvrelay_entry* entry = nullptr;
  const int answered = kvrelay_resolve(client, &request, &resolved, &entry);
  if (answered == KVRELAY_E_NOT_FOUND) return 0;
  INFO(kvrelay_last_error(client));
  REQUIRE(answered == KVRELAY_OK);
  kvrelay_entry_release(entry);
  return resolved.tokens;
}

}  // namespace

TEST_CASE("the daemon's store evicts by utility: an often-read entry outlives a newer unread one",
          "[proxy][kv_path][eviction][process]") {
  Sidecar node{"node-1"};
  auto policy =
      sidecar_policy(node, json::array({agent_json("writer", "", 1, tiny_synthetic_model_json())}), json::array());
  policy["limits"]["kv_store_bytes"] = 2 * kEntryBytes;  // room for two entries
  policy["kv_store"] = {{"eviction", "utility"}, {"recency_tau_s", 3600}};
  node.start(policy);
  kvrelay_client* client = branch_connect(node.socket_path());

  const auto e1 = branch_ids(kEntryTokens, 0, 1);
  const auto e2 = branch_ids(kEntryTokens, 0, 2);
  const auto e3 = branch_ids(kEntryTokens, 0, 3);
  branch_publish(client, kEvictionModel, e1);
  for (int lookup = 0; lookup < 4; ++lookup)
    REQUIRE(resolve_tokens(client, e1) == kEntryTokens);
  branch_publish(client, kEvictionModel, e2);
  const auto before = json::parse(http_request(node.admin_port(), "GET", "/admin/kv").body);
  CHECK(before["evictions"]["total"] == 0);
  CHECK(before["entries"] == 2);
  branch_publish(client, kEvictionModel, e3);  // needs the room of one

  // LRU would have dropped e1 (published first, last read before e2 was published).
  CHECK(resolve_tokens(client, e1) == kEntryTokens);
  CHECK(resolve_tokens(client, e2) == 0);
  CHECK(resolve_tokens(client, e3) == kEntryTokens);
  kvrelay_client_close(client);

  const auto reply = http_request(node.admin_port(), "GET", "/admin/kv?limit=5");
  REQUIRE(reply.status == 200);
  const auto kv = json::parse(reply.body);
  INFO(kv.dump(2));
  CHECK(kv["eviction"] == "utility");
  CHECK(kv["budget_bytes"] == 2 * kEntryBytes);
  CHECK(kv["used_bytes"] == 2 * kEntryBytes);
  CHECK(kv["entries"] == 2);
  CHECK(kv["evictions"]["total"] == 1);
  CHECK(kv["evictions"]["budget"] == 1);
  CHECK(kv["evictions"]["arena"] == 0);
  REQUIRE(kv["top"].size() == 2);
  // e1 first: read five times; e3 read once.
  const auto& first = kv["top"][0];
  CHECK(first["hits"].get<std::uint64_t>() >= 5);
  CHECK(first["tokens"] == kEntryTokens);
  CHECK(first["bytes"] == kEntryBytes);
  CHECK(first["fidelity"] == "exact");
  CHECK(first["utility"].get<double>() > kv["top"][1]["utility"].get<double>());
  CHECK(kv["top"][1]["hits"].get<std::uint64_t>() < first["hits"].get<std::uint64_t>());
  CHECK(node.metric_sum("kvrelay_kv_evictions_total", {"reason=\"budget\""}) == 1.0);
  CHECK(node.metric_sum("kvrelay_kv_evictions_total", {"reason=\"arena\""}) == 0.0);

  CHECK(http_request(node.admin_port(), "GET", "/admin/kv?limit=0").status == 400);
  CHECK(http_request(node.admin_port(), "GET", "/admin/kv?limit=1001").status == 400);
  CHECK(json::parse(http_request(node.admin_port(), "GET", "/admin/kv?limit=1").body)["top"].size() == 1);
}
