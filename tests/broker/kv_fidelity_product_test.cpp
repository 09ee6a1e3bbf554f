// Issue #27, the fidelity product across peers (wire v4): two real `kvrelay serve` daemons. A's
// worker (played by this test over A's data plane) publishes; the route to B pushes it as int8.
// A stamps the push with its policy's int8 factor, B files it with that product and serves it on
// with its own factor, and a fetch asking for more than the KV is worth is not served. The test's
// PeerClient reads what each side serves, and A's /admin/peers shows B's summary node state.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <optional>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/model_fingerprint.h"
#include "kvrelay/peer/peer_client.h"
#include "kvrelay/shm_transport/client.h"

#include "support/kv_path_fixture.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr std::uint32_t kProductBlockTokens = 16;
constexpr double kFactorA = 0.9;   // A's cost_model.media.kv_int8.fidelity
constexpr double kFactorB = 0.95;  // B's

json product_policy(const Sidecar& sidecar, const std::string& here, const std::string& other,
                    std::uint16_t other_peer_port, double int8_factor) {
  const json model = tiny_synthetic_model_json();
  const bool writer_here = here == "na";
  json agents = json::array({agent_json("writer", writer_here ? "" : other, 1, model),
                             agent_json("reader", writer_here ? other : "", 1, model)});
  json routes = json::array({{{"id", "writer-to-reader"},
                              {"from", "writer"},
                              {"to", "reader"},
                              {"push", true},
                              {"forced_medium", "kv_int8"}}});
  json peers = json::array({{{"id", other}, {"address", "127.0.0.1:" + std::to_string(other_peer_port)}}});
  json policy = sidecar_policy(sidecar, std::move(agents), std::move(routes), std::move(peers));
  policy["cost_model"] = {{"media", {{"kv_int8", {{"fidelity", int8_factor}}}}}};
  return policy;
}

kvrelay::peer::PeerClient product_client(const Sidecar& sidecar) {
  kvrelay::peer::PeerClientOptions options;
  options.node_id = "product-test";  // no policy peer: plaintext on loopback, unrestricted
  auto client = kvrelay::peer::PeerClient::connect({"127.0.0.1", sidecar.peer_port()}, options);
  REQUIRE(client.has_value());
  return std::move(client).value();
}

std::optional<kvrelay::peer::PeerClient::FetchedFrame> fetch_from(const Sidecar& sidecar,
                                                                  const kvrelay::kv_store::EntryKey& key,
                                                                  const std::string& codec, double min_product) {
  auto client = product_client(sidecar);
  kvrelay::peer::FetchRequest request{key.context_hash, key.model_id, codec, {key.context_hash}};
  request.route = "writer-to-reader";
  request.deadline_ms = 5000;
  request.min_fidelity_product = min_product;
  auto fetched = client.fetch(request, 1ULL << 30);
  REQUIRE(fetched.has_value());
  return std::move(fetched).value();
}

}  // namespace

TEST_CASE("an int8 push is filed with the product its sender stamped, and a fetch above it is not served",
          "[proxy][kv_path][fidelity][process]") {
  Sidecar b("nb");
  b.start(product_policy(b, "nb", "na", 1, kFactorB));  // B never calls A: its address is a placeholder
  Sidecar a("na");
  a.start(product_policy(a, "na", "nb", b.peer_port(), kFactorA));

  const kvrelay::ModelFingerprint model{"llama", 2, 2, 16, kvrelay::DType::kFloat32, "synthetic-tiny"};
  kvrelay::kv_store::EntryChain chain;
  chain.block_tokens = kProductBlockTokens;
  for (kvrelay::TokenId token = 0; token < 2 * kProductBlockTokens; ++token)
    chain.tokens.push_back(7 + token);
  const auto hashes = kvrelay::hash_blocks(model.id(), chain.tokens, kProductBlockTokens);
  const kvrelay::kv_store::EntryKey key{model.id(), hashes.back()};
  const auto layout = model.layout(chain.tokens.size());
  std::vector<float> kv(layout.total_bytes().value() / sizeof(float));
  for (std::size_t index = 0; index < kv.size(); ++index)
    kv[index] = static_cast<float>(index % 97) / 97.0F;
  auto writer = kvrelay::shm::ShmClient::connect(a.socket_path());
  REQUIRE(writer.has_value());
  REQUIRE(writer.value()
              .publish_with_context(key, layout, std::as_bytes(std::span(kv)), json{{"agent", "writer"}}.dump(),
                                    kvrelay::Fidelity::exact(), &chain)
              .has_value());

  // The push lands at B (A's pusher runs on its own thread).
  REQUIRE(wait_until(
      [&] {
        auto keys = product_client(b).summary();
        return keys.has_value() && std::find(keys.value().begin(), keys.value().end(), key) != keys.value().end();
      },
      std::chrono::seconds(10)));
  CHECK(a.metric_sum("kvrelay_kv_pushes_total", {"result=\"pushed\""}) == 1.0);

  // A holds it exact: an int8 reply is worth A's int8 factor, and nothing above it is served.
  {
    const auto from_a = fetch_from(a, key, "int8", kFactorA);
    REQUIRE(from_a);
    CHECK(from_a->fidelity_product == Approx(kFactorA));
    CHECK_FALSE(fetch_from(a, key, "int8", kFactorA + 0.01));
    const auto exact = fetch_from(a, key, "raw", 1.0);
    REQUIRE(exact);
    CHECK(exact->fidelity_product == 1.0);
  }
  // B filed it lossy with A's stamp (0.9) and serves it on through its own int8 (0.95): 0.855.
  // Had B filed no product (1), it would serve min(1, 0.95) x 0.95 = 0.9025.
  {
    const auto from_b = fetch_from(b, key, "int8", 0.85);
    REQUIRE(from_b);
    CHECK(from_b->fidelity_product == Approx(kFactorA * kFactorB));
    CHECK_FALSE(fetch_from(b, key, "int8", 0.86));
    CHECK_FALSE(fetch_from(b, key, "raw", 0.0));  // lossy KV never answers a lossless ask
  }

  // Summary v2: B reports its store, and A's peer links keep what B said.
  {
    auto summary = product_client(b).summary_reply();
    REQUIRE(summary.has_value());
    const auto& node = summary.value().node;
    CHECK(node.store_used >= layout.total_bytes().value());
    CHECK(node.store_budget >= node.store_used);
    CHECK(node.arena_in_use <= node.arena_capacity);
    CHECK(node.spill_accept_left == 0);
  }
  json seen;
  std::string peers_view;
  const bool reported = wait_until(
      [&] {
        const auto reply = http_request(a.admin_port(), "GET", "/admin/peers");
        peers_view = reply.body;
        if (reply.status != 200) return false;
        const json view = json::parse(reply.body);  // kept alive through the loop
        for (const auto& peer : view["peers"]) {
          if (peer["id"] == "nb" && peer.contains("node_state") &&
              peer["node_state"]["store_used"].get<std::uint64_t>() > 0) {
            seen = peer["node_state"];
            return true;
          }
        }
        return false;
      },
      std::chrono::seconds(10));
  INFO(peers_view);
  REQUIRE(reported);
  CHECK(seen["store_budget"].get<std::uint64_t>() >= seen["store_used"].get<std::uint64_t>());
  CHECK(seen["spill_accept_left"] == 0);
}
