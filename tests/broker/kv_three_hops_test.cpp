// Precision refresh across three hops through two daemons (issue #27, S15 case 5): two real
// `kvrelay serve` processes peered over loopback, agents a1 and a3 on node A, a2 and a4 on node
// B, the test's shm clients playing each agent's worker on its node. Every route is forced to
// kv_int8, int8's factor is calibrated to 0.9 and the floor is 0.75. Each hop's worker looks up
// with its request id (its sidecar fetches the previous agent's KV from the other node) and
// publishes its longer prompt's KV, lossy as it was fed; the sidecar stamps the publish with the
// product it was served. Hop 1 (a1 -> a2) is int8 at 0.9, hop 2 (a2 -> a3) int8 at 0.81, and hop 3
// (0.81 x 0.9 = 0.729 < 0.75) is refreshed: B serves exact KV, bit for bit a1's publish, fetched
// losslessly from A. The single-daemon version is kv_precision_test.cpp.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <optional>
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

constexpr double kInt8Factor = 0.9;
constexpr double kFloor = 0.75;
const kvrelay::ModelFingerprint kHopModel{"llama", 5, 4, 8, kvrelay::DType::kFloat32, "stories260K"};

// a1 and a3 live on node-a, a2 and a4 on node-b: every hop crosses the link.
std::string node_of(int index) {
  return index % 2 == 1 ? "node-a" : "node-b";
}

// The same agents and routes on both nodes; `other_port`: the other node's peer listener.
json hops_policy(const Sidecar& sidecar, const std::string& other, std::uint16_t other_port) {
  json agents = json::array();
  json routes = json::array();
  for (int index = 1; index <= 4; ++index) {
    const std::string node = node_of(index);
    agents.push_back(agent_json(agent_name(index), node == sidecar.node_id() ? "" : node, 1, stories_model_json()));
    if (index == 1) continue;
    routes.push_back({{"id", route_into(index)},
                      {"from", agent_name(index - 1)},
                      {"to", agent_name(index)},
                      {"forced_medium", "kv_int8"},
                      {"quality_floor", kFloor}});
  }
  const json peers = json::array({{{"id", other}, {"address", "127.0.0.1:" + std::to_string(other_port)}}});
  json policy = sidecar_policy(sidecar, agents, routes, peers);
  policy["cost_model"] = {{"media", {{"kv_int8", {{"fidelity", kInt8Factor}}}}}};
  return policy;
}

// The record's fetch attempt that fetched, or an empty object.
json fetched_attempt(const json& record) {
  if (record.contains("fetch")) {
    const json& attempts = record["fetch"];
    for (const auto& attempt : attempts) {
      if (attempt.value("result", "") == "fetched") return attempt;
    }
  }
  return json::object();
}

// The agents' workers on one node: agent i's publish and lookup of its prompt, request id "r<i>".
class HopWorker {
 public:
  explicit HopWorker(const Sidecar& sidecar) {
    auto connected = kvrelay::shm::ShmClient::connect(sidecar.socket_path());
    REQUIRE(connected.has_value());
    client_.emplace(std::move(connected).value());
  }

  // Agent `agent`'s publish of its prompt's KV; returns the bytes published.
  std::vector<std::byte> publish(int agent, const kvrelay::Fidelity& fidelity) {
    const auto prompt = prompt_of(agent);
    const auto hashes = kvrelay::hash_blocks(kHopModel.id(), prompt, kHopBlockTokens);
    kvrelay::kv_store::EntryChain chain;
    chain.block_tokens = kHopBlockTokens;
    chain.tokens = prompt;
    const auto layout = kHopModel.layout(prompt.size());
    const auto kv = worker_kv(layout, agent);
    const json params{{"agent", agent_name(agent)}, {"request_id", "r" + std::to_string(agent)}};
    REQUIRE(client_
                ->publish_with_context({kHopModel.id(), hashes.back()}, layout, std::as_bytes(std::span(kv)),
                                       params.dump(), fidelity, &chain)
                .has_value());
    const auto bytes = std::as_bytes(std::span(kv));
    return {bytes.begin(), bytes.end()};
  }

  // Agent `agent`'s lookup of its whole prompt (its last token prefilled) on the route into it.
  kvrelay::shm::ResolvedPrefix look_up(int agent) {
    const auto prompt = prompt_of(agent);
    const auto hashes = kvrelay::hash_blocks(kHopModel.id(), prompt, kHopBlockTokens);
    kvrelay::shm::ResolveRequest request;
    request.model_id = kHopModel.id();
    request.block_tokens = kHopBlockTokens;
    request.prompt_tokens = prompt.size() + 1;
    request.block_hashes.assign(hashes.begin(), hashes.end());
    request.params_json =
        json{{"agent", agent_name(agent)}, {"route", route_into(agent)}, {"request_id", "r" + std::to_string(agent)}}
            .dump();
    auto resolved = client_->resolve(request);
    INFO((resolved ? std::string() : resolved.error().to_string()));
    REQUIRE(resolved.has_value());
    return std::move(resolved).value();
  }

 private:
  static std::vector<kvrelay::TokenId> prompt_of(int agent) {
    const auto ids = conversation_ids(4 * kPromptStep);
    const auto tokens = static_cast<std::ptrdiff_t>(static_cast<std::uint64_t>(agent) * kPromptStep);
    return {ids.begin(), ids.begin() + tokens};
  }

  std::optional<kvrelay::shm::ShmClient> client_;
};

// Until `sidecar` counts its link to `peer` up.
void wait_for_peer(const Sidecar& sidecar, const std::string& peer) {
  const bool up = wait_until([&] { return sidecar.metric_sum("kvrelay_peer_up", {"peer=\"" + peer + "\""}) == 1.0; },
                             std::chrono::seconds(10));
  INFO(sidecar.node_id() << " never saw " << peer << " up");
  REQUIRE(up);
}

// Until `sidecar`'s last summary from `peer` lists at least `keys` entries: the refresh rule
// reads the chains peers hold, with their products, from their summaries.
void wait_for_summary(const Sidecar& sidecar, const std::string& peer, std::size_t keys) {
  const bool listed = wait_until(
      [&] {
        const auto reply = http_request(sidecar.admin_port(), "GET", "/admin/state");
        if (reply.status != 200) return false;
        const auto state = json::parse(reply.body);
        for (const auto& view : state["peers"]["peers"]) {
          if (view.value("id", "") == peer && view.value("summary_keys", std::size_t{0}) >= keys) return true;
        }
        return false;
      },
      std::chrono::seconds(10));
  INFO(sidecar.node_id() << " never saw " << keys << " keys in " << peer << "'s summary");
  REQUIRE(listed);
}

}  // namespace

TEST_CASE("precision refresh across three hops through two daemons refreshes the third hop to a1's exact KV",
          "[proxy][kv_path][precision][process]") {
  Sidecar a("node-a");
  Sidecar b("node-b");
  a.start(hops_policy(a, "node-b", 1));  // placeholders until both listen
  b.start(hops_policy(b, "node-a", 1));
  a.reload(hops_policy(a, "node-b", b.peer_port()));
  b.reload(hops_policy(b, "node-a", a.peer_port()));
  wait_for_peer(a, "node-b");
  wait_for_peer(b, "node-a");
  HopWorker on_a(a);
  HopWorker on_b(b);

  const auto first_kv = on_a.publish(1, kvrelay::Fidelity::exact());  // a1 on A: exact

  // Hop 1: a2 on B fetches a1's exact blocks from A through int8: 1 x 0.9.
  const auto hop1 = on_b.look_up(2);
  CHECK(hop1.meta.medium == "kv_int8");
  CHECK(hop1.meta.blocks == kStepBlocks);
  CHECK(hop1.meta.fidelity.lossy_codec == "int8");
  const bool hop1_changed = entry_bytes(hop1.entry) != first_kv;
  CHECK(hop1_changed);  // int8 changed them
  const auto record1 = lookup_of(b, "r2");
  INFO("hop 1 on node-b: " << record1.dump(2));
  CHECK(record1.value("source", "") == "forced");
  CHECK(record1.value("outcome", "") == "hit_peer");
  CHECK(record1.value("chain_product", 0.0) == Approx(1.0));  // B holds nothing of it
  CHECK(record1.value("fidelity_product", 0.0) == Approx(0.9));
  CHECK_FALSE(record1.contains("precision_refresh"));
  const auto fetch1 = fetched_attempt(record1);
  CHECK(fetch1.value("peer", "") == "node-a");
  CHECK(fetch1.value("fidelity_product", 0.0) == Approx(0.9));  // A stamped its hop
  // a2's KV attended over int8 KV: lossy from token 0. B stamps it 0.9.
  (void)on_b.publish(2, kvrelay::Fidelity::lossy("int8"));
  wait_for_summary(a, "node-b", 1);  // A learns B holds a2's chain (at 0.9)

  // Hop 2: a3 on A fetches a2's blocks, already int8 at 0.9, from B: 0.9 x 0.9 = 0.81 >= 0.75.
  const auto hop2 = on_a.look_up(3);
  CHECK(hop2.meta.medium == "kv_int8");
  CHECK(hop2.meta.blocks == 2 * kStepBlocks);
  CHECK(hop2.meta.fidelity.lossy_codec == "int8");
  const auto record2 = lookup_of(a, "r3");
  INFO("hop 2 on node-a: " << record2.dump(2));
  CHECK(record2.value("source", "") == "forced");
  CHECK(record2.value("outcome", "") == "hit_peer");
  // The longest source is B's a2 entry (B's summary says 0.9): the chain a fetch extends.
  CHECK(record2.value("chain_product", 0.0) == Approx(0.9));
  CHECK(record2.value("fidelity_product", 0.0) == Approx(0.81));
  CHECK_FALSE(record2.contains("precision_refresh"));
  const auto fetch2 = fetched_attempt(record2);
  CHECK(fetch2.value("peer", "") == "node-b");
  CHECK(fetch2.value("fidelity_product", 0.0) == Approx(0.81));
  // a3's KV attended over a2's: A stamps it 0.81.
  (void)on_a.publish(3, kvrelay::Fidelity::lossy("int8"));
  wait_for_summary(b, "node-a", 2);  // B learns A holds a1's exact chain and a3's (at 0.81)

  // Hop 3: a3's blocks carry 0.81; int8 would make 0.729 < 0.75. Refreshed: B serves exact KV,
  // a1's blocks fetched losslessly from A, bit for bit.
  const auto hop3 = on_b.look_up(4);
  CHECK(hop3.meta.medium == "kv_raw");
  CHECK(hop3.meta.fidelity.is_exact());
  CHECK(hop3.meta.blocks == kStepBlocks);
  const bool hop3_is_a1s = entry_bytes(hop3.entry) == first_kv;
  CHECK(hop3_is_a1s);
  const auto record3 = lookup_of(b, "r4");
  INFO("hop 3 on node-b: " << record3.dump(2));
  CHECK(record3.value("medium", "") == "kv_raw");
  CHECK(record3.value("source", "") == "refresh");
  CHECK(record3.value("outcome", "") == "hit_peer");
  CHECK(record3.value("chain_product", 0.0) == Approx(0.81));
  CHECK_FALSE(record3.contains("fidelity_product"));  // exact KV
  CHECK(record3.contains("precision_refresh"));
  const json refresh = record3.value("precision_refresh", json::object());
  CHECK(refresh.value("chain_product", 0.0) == Approx(0.81));
  CHECK(refresh.value("factor", 0.0) == Approx(kInt8Factor));
  CHECK(refresh.value("floor", 0.0) == Approx(kFloor));
  CHECK(refresh.value("forced", "") == "lossless");
  CHECK(refresh.value("replaced", "") == "kv_int8");
  // B holds no exact prefix (it never filed a1's KV, and a2's is lossy from token 0): the exact
  // source is A's, asked for losslessly.
  CHECK(refresh.value("exact_source", true) == false);
  const auto fetch3 = fetched_attempt(record3);
  CHECK(fetch3.value("peer", "") == "node-a");
  CHECK(fetch3.value("fidelity_product", 0.0) == Approx(1.0));

  CHECK(b.metric_sum("kvrelay_kv_precision_refreshes_total", {"route=\"a3-a4\"", "forced=\"lossless\""}) == 1.0);
  CHECK(b.metric_sum("kvrelay_kv_precision_refreshes_total") == 1.0);
  CHECK(a.metric_sum("kvrelay_kv_precision_refreshes_total") == 0.0);
}
