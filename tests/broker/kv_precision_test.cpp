// Precision refresh through the daemon (issue #27): a real `kvrelay serve`, the test's shm
// clients playing four agents' workers on its node. Each hop's worker looks up with its request
// id and publishes its longer prompt's KV, lossy as it was fed; the sidecar stamps each publish
// with the fidelity product its lookup was served. With kv_int8 forced on every route, int8's
// factor calibrated to 0.9 and a floor of 0.75, hops 1 and 2 are int8 (0.9, then 0.81) and hop 3
// (0.81 x 0.9 = 0.729) is refreshed: exact KV, bit for bit the first agent's publish.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/model_fingerprint.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/shm_transport/client.h"

#include "support/hop_chain.h"
#include "support/kv_path_fixture.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

json chain_policy(const Sidecar& sidecar) {
  json agents = json::array();
  json routes = json::array();
  for (int index = 1; index <= 4; ++index) {
    agents.push_back(agent_json(agent_name(index), "", 1, stories_model_json()));
    if (index == 1) continue;
    routes.push_back({{"id", route_into(index)},
                      {"from", agent_name(index - 1)},
                      {"to", agent_name(index)},
                      {"forced_medium", "kv_int8"},
                      {"quality_floor", 0.75}});
  }
  json policy = sidecar_policy(sidecar, agents, routes);
  policy["cost_model"] = {{"media", {{"kv_int8", {{"fidelity", 0.9}}}}}};
  return policy;
}

}  // namespace

TEST_CASE("precision refresh: a chain of forced int8 hops is refreshed exactly when its product crosses the floor",
          "[proxy][kv_path][precision][process]") {
  Sidecar sidecar("n0");
  sidecar.start(chain_policy(sidecar));
  const kvrelay::ModelFingerprint model{"llama", 5, 4, 8, kvrelay::DType::kFloat32, "stories260K"};
  const auto ids = conversation_ids(4 * kPromptStep);
  auto client = kvrelay::shm::ShmClient::connect(sidecar.socket_path());
  REQUIRE(client.has_value());
  auto& worker = client.value();

  // Agent `agent`'s publish of its prompt's KV, with its request id.
  const auto publish = [&](int agent, const kvrelay::Fidelity& fidelity) {
    const std::uint64_t tokens = static_cast<std::uint64_t>(agent) * kPromptStep;
    const std::vector<kvrelay::TokenId> prompt(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(tokens));
    const auto hashes = kvrelay::hash_blocks(model.id(), prompt, kHopBlockTokens);
    kvrelay::kv_store::EntryChain chain;
    chain.block_tokens = kHopBlockTokens;
    chain.tokens = prompt;
    const auto layout = model.layout(tokens);
    const auto kv = worker_kv(layout, agent);
    const json params{{"agent", agent_name(agent)}, {"request_id", "r" + std::to_string(agent)}};
    REQUIRE(worker
                .publish_with_context({model.id(), hashes.back()}, layout, std::as_bytes(std::span(kv)), params.dump(),
                                      fidelity, &chain)
                .has_value());
    return std::vector<std::byte>(std::as_bytes(std::span(kv)).begin(), std::as_bytes(std::span(kv)).end());
  };
  // Agent `agent`'s lookup of its whole prompt (its last token prefilled), with its request id.
  const auto look_up = [&](int agent) {
    const std::uint64_t tokens = static_cast<std::uint64_t>(agent) * kPromptStep;
    const std::vector<kvrelay::TokenId> prompt(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(tokens));
    const auto hashes = kvrelay::hash_blocks(model.id(), prompt, kHopBlockTokens);
    kvrelay::shm::ResolveRequest request;
    request.model_id = model.id();
    request.block_tokens = kHopBlockTokens;
    request.prompt_tokens = tokens + 1;
    request.block_hashes.assign(hashes.begin(), hashes.end());
    request.params_json =
        json{{"agent", agent_name(agent)}, {"route", route_into(agent)}, {"request_id", "r" + std::to_string(agent)}}
            .dump();
    auto resolved = worker.resolve(request);
    INFO((resolved ? std::string() : resolved.error().to_string()));
    REQUIRE(resolved.has_value());
    return std::move(resolved).value();
  };

  const auto first_kv = publish(1, kvrelay::Fidelity::exact());  // exact

  // Hop 1: a1's exact blocks through int8: product 1 x 0.9.
  const auto hop1 = look_up(2);
  CHECK(hop1.meta.medium == "kv_int8");
  CHECK(hop1.meta.blocks == kStepBlocks);
  CHECK(hop1.meta.fidelity == kvrelay::Fidelity::lossy("int8"));
  CHECK(entry_bytes(hop1.entry) != first_kv);  // int8 changed them
  const auto record1 = lookup_of(sidecar, "r2");
  CHECK(record1["source"] == "forced");
  CHECK(record1["chain_product"] == 1.0);
  CHECK(record1["fidelity_product"].get<double>() == Approx(0.9));
  CHECK_FALSE(record1.contains("precision_refresh"));
  // a2's KV attended over int8 KV: lossy from token 0. The sidecar stamps it 0.9.
  (void)publish(2, kvrelay::Fidelity::lossy("int8"));

  // Hop 2: a2's blocks, already int8, are the best source: 0.9 x 0.9 = 0.81 >= 0.75.
  const auto hop2 = look_up(3);
  CHECK(hop2.meta.medium == "kv_int8");
  CHECK(hop2.meta.blocks == 2 * kStepBlocks);
  const auto record2 = lookup_of(sidecar, "r3");
  CHECK(record2["source"] == "forced");
  CHECK(record2["chain_product"].get<double>() == Approx(0.9));
  CHECK(record2["fidelity_product"].get<double>() == Approx(0.81));
  CHECK_FALSE(record2.contains("precision_refresh"));
  (void)publish(3, kvrelay::Fidelity::lossy("int8"));

  // Hop 3: a3's blocks carry 0.81; int8 would make 0.729 < 0.75. Refreshed: kv_raw from the
  // exact source, a1's blocks, bit for bit.
  const auto hop3 = look_up(4);
  CHECK(hop3.meta.medium == "kv_raw");
  CHECK(hop3.meta.fidelity.is_exact());
  CHECK(hop3.meta.blocks == kStepBlocks);
  CHECK(entry_bytes(hop3.entry) == first_kv);
  const auto record3 = lookup_of(sidecar, "r4");
  CHECK(record3["medium"] == "kv_raw");
  CHECK(record3["source"] == "refresh");
  CHECK(record3["outcome"] == "hit_local");
  REQUIRE(record3.contains("precision_refresh"));
  const auto& refresh = record3["precision_refresh"];
  CHECK(refresh["chain_product"].get<double>() == Approx(0.81));
  CHECK(refresh["factor"].get<double>() == Approx(0.9));
  CHECK(refresh["floor"].get<double>() == Approx(0.75));
  CHECK(refresh["forced"] == "lossless");
  CHECK(refresh["exact_source"] == true);
  CHECK(refresh["replaced"] == "kv_int8");

  CHECK(sidecar.metric_sum("kvrelay_kv_precision_refreshes_total") == 1.0);
  CHECK(sidecar.metric_sum("kvrelay_kv_precision_refreshes_total", {"route=\"a3-a4\"", "forced=\"lossless\""}) == 1.0);
}

TEST_CASE("precision refresh: a publish without a known served product keeps 1, read as its codec's factor",
          "[proxy][kv_path][precision][process]") {
  Sidecar sidecar("n0");
  sidecar.start(chain_policy(sidecar));
  const kvrelay::ModelFingerprint model{"llama", 5, 4, 8, kvrelay::DType::kFloat32, "stories260K"};
  const auto ids = conversation_ids(3 * kPromptStep);
  auto client = kvrelay::shm::ShmClient::connect(sidecar.socket_path());
  REQUIRE(client.has_value());
  // a2 publishes lossy KV for a request no lookup served: unstamped (1), so worth int8's 0.9.
  const std::vector<kvrelay::TokenId> prompt(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(2 * kPromptStep));
  const auto hashes = kvrelay::hash_blocks(model.id(), prompt, kHopBlockTokens);
  const auto layout = model.layout(prompt.size());
  const auto kv = worker_kv(layout, 2);
  REQUIRE(client.value()
              .publish_with_context({model.id(), hashes.back()}, layout, std::as_bytes(std::span(kv)),
                                    json{{"agent", "a2"}, {"request_id", "unknown"}}.dump(),
                                    kvrelay::Fidelity::lossy("int8"))
              .has_value());
  const auto all = kvrelay::hash_blocks(model.id(), ids, kHopBlockTokens);
  kvrelay::shm::ResolveRequest request;
  request.model_id = model.id();
  request.block_tokens = kHopBlockTokens;
  request.prompt_tokens = ids.size() + 1;
  request.block_hashes.assign(all.begin(), all.end());
  request.params_json = json{{"agent", "a3"}, {"route", "a2-a3"}, {"request_id", "r3"}}.dump();
  const auto resolved = client.value().resolve(request);
  REQUIRE(resolved.has_value());
  CHECK(resolved.value().meta.medium == "kv_int8");  // 0.9 x 0.9 = 0.81: no refresh
  const auto record = lookup_of(sidecar, "r3");
  CHECK(record["chain_product"].get<double>() == Approx(0.9));
  CHECK(record["fidelity_product"].get<double>() == Approx(0.81));
  CHECK(sidecar.metric_sum("kvrelay_kv_precision_refreshes_total") == 0.0);
}
