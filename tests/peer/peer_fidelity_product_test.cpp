// Issue #27 on the peer plane (wire v4): the fidelity product a fetch reply and a push carry and
// the receiver files, the least product a fetch asks for, summaries' NodeState, and pushes this
// sidecar does not take yet (deltas, spills). A real PeerServer and PeerClient over loopback TCP
// in this process, with a real store, so what the server filed can be read back.
#include <boost/asio/io_context.hpp>
#include <catch2/catch.hpp>

#include <memory>
#include <string_view>
#include <thread>
#include <vector>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/metrics.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/kv_tokens.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/kv_store/entry_store.h"
#include "kvrelay/peer/fidelity_product.h"
#include "kvrelay/peer/peer_client.h"
#include "kvrelay/peer/peer_server.h"

using namespace kvrelay;

namespace {

constexpr std::uint64_t kModel = 0x7769726576340000ULL;
constexpr std::uint64_t kStoreBudget = 64ULL << 20;

// Factors as a policy would set them: int8 0.9, int4 0.5, everything else (lossless) 1.
double test_factor(std::string_view codec) {
  if (codec.starts_with("int8")) return 0.9;
  if (codec.starts_with("int4")) return 0.5;
  return 1.0;
}

KvLayout product_layout() {
  return KvLayout{2, 2, 8, DType::kFloat16, 16};
}

// Tokens first..first+15 of a one-block chain.
kv_store::EntryChain product_chain(TokenId first) {
  kv_store::EntryChain chain;
  chain.block_tokens = 16;
  for (TokenId token = first; token < first + 16; ++token)
    chain.tokens.push_back(token);
  return chain;
}

kv_store::EntryKey key_of(const kv_store::EntryChain& chain) {
  return {kModel, kv_store::chain_keys(kModel, chain, kv_store::ChainScope::kUnscoped).back()};
}

std::vector<std::uint8_t> product_kv() {
  auto kv = codec::synthetic_kv(product_layout(), 3);
  REQUIRE(kv.has_value());
  return std::move(kv).value();
}

std::shared_ptr<const kv_store::StoredEntry> entry_of(const kv_store::EntryChain& chain, Fidelity fidelity) {
  const auto kv = product_kv();
  auto entry = kv_store::make_stored_entry(product_layout(), std::as_bytes(std::span(kv)));
  REQUIRE(entry.has_value());
  entry.value()->chain = std::make_shared<const kv_store::EntryChain>(chain);
  entry.value()->fidelity = std::move(fidelity);
  return std::move(entry).value();
}

std::vector<std::uint8_t> frame_of(const codec::CodecRegistry& codecs, std::string_view codec) {
  const codec::Codec* found = codecs.find(codec);
  REQUIRE(found != nullptr);
  auto frame = codec::encode_frame(*found, product_layout(), product_kv());
  REQUIRE(frame.has_value());
  return std::move(frame).value();
}

// This server's policy for the spill cases: product-client is a peer whose agent uses the
// entries' model, and whose spills may take `quota` bytes here.
std::shared_ptr<const Policy> spill_policy(std::uint64_t quota) {
  auto policy = std::make_shared<Policy>();
  policy->node_id = "product-server";
  PeerPolicy client;
  client.id = "product-client";
  client.address = {"127.0.0.1", 1};
  client.accept_spill_bytes = quota;
  policy->peers.push_back(client);
  AgentPolicy agent;
  agent.id = "remote-agent";
  agent.node = "product-client";
  agent.model.layers = 2;
  agent.model.kv_heads = 2;
  agent.model.head_dim = 8;
  agent.model.dtype = DType::kFloat16;
  policy->agents.push_back(agent);
  return policy;
}

class InProcessPeer {
 public:
  explicit InProcessPeer(bool with_factor = true, std::shared_ptr<const Policy> policy = nullptr) {
    peer::PeerServerOptions options;
    if (policy) options.policy = [policy] { return policy; };
    options.node_id = "product-server";
    options.codecs = codecs;
    options.max_entry_bytes = kStoreBudget;
    options.warm_buffer_bytes = 1 << 20;
    options.store_budget_bytes = kStoreBudget;
    if (with_factor) options.codec_factor = test_factor;
    options.node_state = [](std::string_view peer_id, peer::NodeState& state) {
      if (peer_id == "product-client") state.spill_accept_left = 7;
    };
    server_ = std::make_unique<peer::PeerServer>(io_, std::move(options), store);
    REQUIRE(server_->listen({"127.0.0.1", 0}).has_value());
    thread_ = std::thread([this] { io_.run(); });
  }
  ~InProcessPeer() {
    server_->stop();  // the accept loop and every session end, and with them io_.run()
    thread_.join();
  }
  InProcessPeer(const InProcessPeer&) = delete;
  InProcessPeer& operator=(const InProcessPeer&) = delete;

  [[nodiscard]] peer::PeerClient client(bool with_factor = true) {
    peer::PeerClientOptions options;
    options.node_id = "product-client";
    if (with_factor) options.codec_factor = test_factor;
    auto connected = peer::PeerClient::connect({"127.0.0.1", server_->local_endpoint().port()}, std::move(options));
    REQUIRE(connected.has_value());
    return std::move(connected).value();
  }

  std::shared_ptr<const codec::CodecRegistry> codecs =
      std::make_shared<const codec::CodecRegistry>(codec::CodecRegistry::with_builtins());
  std::shared_ptr<kv_store::InMemoryEntryStore> store = std::make_shared<kv_store::InMemoryEntryStore>(kStoreBudget);

 private:
  boost::asio::io_context io_;
  std::unique_ptr<peer::PeerServer> server_;
  std::thread thread_;
};

peer::FetchRequest fetch_of(const kv_store::EntryKey& key, std::string codec, double min_product = 0.0) {
  peer::FetchRequest request{key.context_hash, key.model_id, std::move(codec), {key.context_hash}};
  request.route = "a-to-b";
  request.deadline_ms = 2000;
  request.min_fidelity_product = min_product;
  return request;
}

}  // namespace

TEST_CASE("fidelity products: effective and stamped", "[peer][fidelity][unit]") {
  const peer::CodecFactor factor = test_factor;
  CHECK(peer::effective_product(Fidelity::exact(), factor) == 1.0);
  // The smaller of the product and the lossy codec's factor: an unknown product (1) is not optimistic.
  CHECK(peer::effective_product(Fidelity::lossy("int8"), factor) == 0.9);
  CHECK(peer::effective_product(Fidelity::lossy("int8", 0, 0.6), factor) == 0.6);
  CHECK(peer::stamped_product(Fidelity::exact(), "int4", false, factor) == 0.5);
  CHECK(peer::stamped_product(Fidelity::lossy("int8", 0, 0.8), "int8", false, factor) == Approx(0.72));
  CHECK(peer::stamped_product(Fidelity::exact(), "int4", true, factor) == 1.0);  // lossless whatever it says
  // Unset: every factor is 1, and a lossy entry keeps its own product.
  CHECK(peer::stamped_product(Fidelity::lossy("int8", 0, 0.8), "int8", false, {}) == 0.8);
  CHECK(peer::stamped_product(Fidelity::exact(), "int8", false, {}) == 1.0);
  // A factor outside (0, 1] is clamped: never above 1, never 0 or NaN on the wire.
  const peer::CodecFactor wild = [](std::string_view codec) { return codec == "nan" ? 0.0 / 0.0 : 7.0; };
  CHECK(peer::codec_factor_of(wild, "int8") == 1.0);
  CHECK(peer::codec_factor_of(wild, "nan") == peer::kMinFidelityProduct);
  CHECK(peer::clamp_product(-1.0) == peer::kMinFidelityProduct);
}

TEST_CASE("a fetch reply carries effective(entry) x factor(codec), and a least product above it misses",
          "[peer][fidelity][unit]") {
  InProcessPeer server;
  const auto exact_chain = product_chain(100);
  const auto lossy_chain = product_chain(200);
  REQUIRE(server.store->put(key_of(exact_chain), entry_of(exact_chain, Fidelity::exact())).has_value());
  REQUIRE(server.store->put(key_of(lossy_chain), entry_of(lossy_chain, Fidelity::lossy("int8", 0, 0.8))).has_value());
  auto client = server.client();
  const auto fetch = [&](const kv_store::EntryChain& chain, std::string codec, double min_product) {
    auto fetched = client.fetch(fetch_of(key_of(chain), std::move(codec), min_product), 1ULL << 30);
    REQUIRE(fetched.has_value());
    return std::move(fetched).value();
  };
  {
    const auto raw = fetch(exact_chain, "raw", 1.0);
    REQUIRE(raw);
    CHECK(raw->fidelity_product == 1.0);
  }
  {
    const auto int8 = fetch(exact_chain, "int8", 0.9);
    REQUIRE(int8);
    CHECK(int8->fidelity_product == 0.9);
  }
  CHECK_FALSE(fetch(exact_chain, "int8", 0.91));  // the reply would be worth less than asked
  CHECK_FALSE(fetch(exact_chain, "int4", 0.6));
  {
    const auto lossy = fetch(lossy_chain, "int8", 0.7);
    REQUIRE(lossy);
    CHECK(lossy->fidelity_product == Approx(0.72));  // 0.8 (its product) x 0.9 (int8)
  }
  CHECK_FALSE(fetch(lossy_chain, "int8", 0.75));
  CHECK_FALSE(fetch(lossy_chain, "raw", 0.0));  // lossy KV never answers a lossless ask
  // Nothing was wrong with the misses: the connection serves on.
  CHECK(fetch(exact_chain, "int8", 0.0));
  // A least product out of range is refused before anything is sent.
  auto bad = fetch_of(key_of(exact_chain), "int8", 1.5);
  CHECK(client.fetch(bad, 1ULL << 30).error().code == ErrorCode::kInvalidArgument);
}

TEST_CASE("a pushed lossy entry is filed with the product its sender stamped", "[peer][fidelity][unit]") {
  InProcessPeer server;
  auto client = server.client();
  const auto frame = frame_of(*server.codecs, "int8");
  SECTION("exact KV pushed as int8 is worth int8's factor") {
    const auto chain = product_chain(300);
    peer::PushOptions push;
    push.source = Fidelity::exact();
    push.codec = "int8";
    REQUIRE(client.push_encoded(1, key_of(chain), chain, frame, push).has_value());
    const auto filed = server.store->get(key_of(chain));
    REQUIRE(filed);
    CHECK(filed->fidelity.lossy_codec == "int8");
    CHECK(filed->fidelity.product == 0.9);
  }
  SECTION("a second lossy hop multiplies") {
    const auto chain = product_chain(310);
    peer::PushOptions push;
    push.source = Fidelity::lossy("int8", 0, 0.8);
    push.codec = "int8";
    REQUIRE(client.push_encoded(2, key_of(chain), chain, frame, push).has_value());
    const auto filed = server.store->get(key_of(chain));
    REQUIRE(filed);
    CHECK(filed->fidelity.product == Approx(0.72));
  }
  SECTION("the old push signature stamps 1: unknown, which readers cap by the codec's factor") {
    const auto chain = product_chain(320);
    REQUIRE(client.push_encoded(3, key_of(chain), chain, frame).has_value());
    const auto filed = server.store->get(key_of(chain));
    REQUIRE(filed);
    CHECK(filed->fidelity.product == 1.0);
    CHECK(peer::effective_product(filed->fidelity, test_factor) == 0.9);
  }
  SECTION("a lossless frame of lossy KV is refused, nothing filed") {
    const auto chain = product_chain(330);
    peer::PushOptions push;
    push.source = Fidelity::lossy("int8", 0, 0.8);
    push.codec = "raw";
    const auto refused = client.push_encoded(4, key_of(chain), chain, frame_of(*server.codecs, "raw"), push);
    REQUIRE_FALSE(refused.has_value());
    CHECK(refused.error().code == ErrorCode::kInvalidArgument);
    CHECK_THAT(refused.error().message, Catch::Contains("lossless frame"));
    CHECK_FALSE(server.store->get(key_of(chain)));
  }
}

TEST_CASE("spill deltas, and spills without a quota, are refused by name before a chunk is read",
          "[peer][fidelity][unit]") {
  InProcessPeer server;
  const auto frame = frame_of(*server.codecs, "raw");
  const auto chain = product_chain(400);
  peer::PushOptions push;
  push.codec = "raw";
  SECTION("a spill's delta") {
    push.skip_tokens = 16;
    push.purpose = peer::PushPurpose::kSpill;
    auto client = server.client();
    const auto refused = client.push_encoded(5, key_of(chain), chain, frame, push);
    REQUIRE_FALSE(refused.has_value());
    CHECK(refused.error().code == ErrorCode::kUnsupported);
    CHECK_THAT(refused.error().message, Catch::Contains("carries the whole entry"));
  }
  SECTION("a spill, which needs a policy's quota") {
    push.purpose = peer::PushPurpose::kSpill;
    auto client = server.client();
    const auto refused = client.push_encoded(6, key_of(chain), chain, frame, push);
    REQUIRE_FALSE(refused.has_value());
    CHECK(refused.error().code == ErrorCode::kPermissionDenied);
    CHECK_THAT(refused.error().message, Catch::Contains("no policy"));
  }
  CHECK_FALSE(server.store->get(key_of(chain)));
  CHECK(server.client().ping().has_value());  // the server serves on
  // A prefetch is taken like a push.
  push.purpose = peer::PushPurpose::kPrefetch;
  push.skip_tokens = 0;
  auto client = server.client();
  REQUIRE(client.push_encoded(7, key_of(chain), chain, frame, push).has_value());
  const auto filed = server.store->get(key_of(chain));
  REQUIRE(filed);
  CHECK(filed->origin == kv_store::EntryOrigin::kPrefetched);
}

namespace {

// Two blocks: product_chain(first)'s tokens, then 16 more.
kv_store::EntryChain two_block_chain(TokenId first) {
  auto chain = product_chain(first);
  for (TokenId token = first + 100; token < first + 116; ++token)
    chain.tokens.push_back(token);
  return chain;
}

}  // namespace

TEST_CASE("a delta push joins the prefix the receiver holds, byte for byte", "[peer][fidelity][unit]") {
  InProcessPeer server;
  const auto head_chain = product_chain(700);
  const auto chain = two_block_chain(700);
  const auto key =
      kv_store::EntryKey{kModel, kv_store::chain_keys(kModel, chain, kv_store::ChainScope::kUnscoped).back()};
  peer::PushOptions push;
  push.codec = "raw";
  push.skip_tokens = 16;
  SECTION("the held prefix and the pushed tail make the entry") {
    REQUIRE(server.store->put(key_of(head_chain), entry_of(head_chain, Fidelity::exact())).has_value());
    auto client = server.client();
    REQUIRE(client.push_encoded(20, key, chain, frame_of(*server.codecs, "raw"), push).has_value());
    const auto filed = server.store->get(key);
    REQUIRE(filed);
    CHECK(filed->info.layout.tokens == 32);
    CHECK(filed->fidelity.is_exact());
    CHECK(filed->chain->tokens == chain.tokens);
    const auto kv = product_kv();
    const auto half = std::as_bytes(std::span(kv));
    std::vector<std::byte> expected(filed->info.bytes);
    REQUIRE(join_tokens(product_layout(), half, product_layout(), half, expected).has_value());
    std::vector<std::byte> got(filed->info.bytes);
    REQUIRE(kv_store::read_entry(*filed, 0, got).has_value());
    CHECK(got == expected);
  }
  SECTION("a lossy tail on an exact prefix is lossy after the prefix") {
    REQUIRE(server.store->put(key_of(head_chain), entry_of(head_chain, Fidelity::exact())).has_value());
    push.codec = "int8";
    push.source = Fidelity::lossy("int8", 0, 0.8);
    auto client = server.client();
    REQUIRE(client.push_encoded(21, key, chain, frame_of(*server.codecs, "int8"), push).has_value());
    const auto filed = server.store->get(key);
    REQUIRE(filed);
    CHECK(filed->fidelity.lossy_codec == "int8");
    CHECK(filed->fidelity.exact_tokens >= 16);
    CHECK(filed->fidelity.product == Approx(0.72));
  }
  SECTION("a prefix no longer held is prefix_gone, and nothing is filed") {
    auto client = server.client();
    const auto refused = client.push_encoded(22, key, chain, frame_of(*server.codecs, "raw"), push);
    REQUIRE_FALSE(refused.has_value());
    CHECK(refused.error().code == ErrorCode::kNotFound);
    CHECK_THAT(refused.error().message, Catch::Contains("prefix_gone"));
    CHECK_FALSE(server.store->get(key));
  }
}

TEST_CASE("a spill is filed for its sender within accept_spill_bytes", "[peer][fidelity][unit]") {
  const std::uint64_t entry_bytes = entry_of(product_chain(600), Fidelity::exact())->info.bytes;
  SECTION("within the quota: filed as spilled in, counted against the sender") {
    InProcessPeer server(true, spill_policy(2 * entry_bytes));
    peer::PushOptions push;
    push.codec = "raw";
    push.purpose = peer::PushPurpose::kSpill;
    auto client = server.client();
    const auto first = product_chain(600);
    REQUIRE(client.push_encoded(8, key_of(first), first, frame_of(*server.codecs, "raw"), push).has_value());
    const auto filed = server.store->get(key_of(first));
    REQUIRE(filed);
    CHECK(filed->origin == kv_store::EntryOrigin::kSpilledIn);
    CHECK(filed->spilled_from == "product-client");
    CHECK(filed->fidelity.is_exact());
    CHECK(server.store->spilled_in_bytes("product-client") == entry_bytes);
    CHECK(server.store->stats().spilled_in_entries == 1);
    const auto second = product_chain(620);
    REQUIRE(client.push_encoded(9, key_of(second), second, frame_of(*server.codecs, "raw"), push).has_value());
    // A third is one entry over: refused after decoding, nothing filed, the first two kept.
    auto again = server.client();
    const auto third = product_chain(640);
    const auto refused = again.push_encoded(10, key_of(third), third, frame_of(*server.codecs, "raw"), push);
    REQUIRE_FALSE(refused.has_value());
    CHECK(refused.error().code == ErrorCode::kResourceExhausted);
    CHECK_THAT(refused.error().message, Catch::Contains("accept_spill_bytes"));
    CHECK_FALSE(server.store->get(key_of(third)));
    CHECK(server.store->spilled_in_bytes("product-client") == 2 * entry_bytes);
    // Dropping one gives its bytes back to the quota.
    CHECK(server.store->erase(key_of(first)));
    CHECK(server.store->spilled_in_bytes("product-client") == entry_bytes);
    REQUIRE(server.client().push_encoded(11, key_of(third), third, frame_of(*server.codecs, "raw"), push).has_value());
  }
  SECTION("a peer the policy gives no quota is refused before a chunk is read") {
    InProcessPeer server(true, spill_policy(0));
    peer::PushOptions push;
    push.codec = "raw";
    push.purpose = peer::PushPurpose::kSpill;
    auto client = server.client();
    const auto chain = product_chain(660);
    const auto refused = client.push_encoded(12, key_of(chain), chain, frame_of(*server.codecs, "raw"), push);
    REQUIRE_FALSE(refused.has_value());
    CHECK(refused.error().code == ErrorCode::kPermissionDenied);
    CHECK_THAT(refused.error().message, Catch::Contains("no accept_spill_bytes"));
    CHECK(server.store->stats().entries == 0);
  }
}

TEST_CASE("a bandwidth probe is bounded and rate-limited per connection", "[peer][fidelity][unit]") {
  InProcessPeer server;
  auto client = server.client();
  const auto elapsed = client.probe_bandwidth(peer::kMaxProbeBytes);
  REQUIRE(elapsed.has_value());
  CHECK(elapsed.value().count() > 0);
  CHECK(client.probe_bandwidth(0).error().code == ErrorCode::kInvalidArgument);
  CHECK(client.probe_bandwidth(peer::kMaxProbeBytes + 1).error().code == ErrorCode::kInvalidArgument);
  // A second probe within a second on the same connection ends it, with the reason.
  const auto refused = client.probe_bandwidth(1);
  REQUIRE_FALSE(refused.has_value());
  CHECK_THAT(refused.error().message, Catch::Contains("once a second"));
  auto fresh = server.client();  // the server serves on; a new connection may probe
  CHECK(fresh.probe_bandwidth(4096).has_value());
}

TEST_CASE("a summary carries the server's node state", "[peer][fidelity][unit]") {
  InProcessPeer server;
  const auto chain = product_chain(500);
  const auto entry = entry_of(chain, Fidelity::exact());
  REQUIRE(server.store->put(key_of(chain), entry).has_value());
  auto client = server.client();
  const auto summary = client.summary_reply();
  REQUIRE(summary.has_value());
  const auto& node = summary.value().node;
  CHECK(node.store_budget == kStoreBudget);
  CHECK(node.store_used == entry->info.bytes);
  CHECK(node.arena_capacity == 0);  // no arena: nothing to report
  CHECK(node.arena_in_use == 0);
  CHECK(node.queued_transfers == 0);
  CHECK(node.spill_accept_left == 7);  // from the node_state hook, for this client
  REQUIRE(summary.value().keys.size() == 1);
  CHECK(summary.value().keys.front() == key_of(chain));
  const auto keys = client.summary();
  REQUIRE(keys.has_value());
  CHECK(keys.value().size() == 1);
}
