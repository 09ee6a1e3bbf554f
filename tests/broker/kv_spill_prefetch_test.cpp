// The store as the resource manager's memory (issue #27), through two real `kvrelay serve`
// processes peered over loopback; the test's shm clients play the workers of each node.
// - Spill: node A has room for one entry. An often-read entry that must make room is spilled to
//   node B (which accepts A's spills), a stub stays, and A's next lookup fetches it back from B,
//   byte for byte. A lossy spill comes back lossy, and never to a lossless lookup.
// - Prefetch: A's publish on a route into B's agent goes ahead to B at background priority; B's
//   lookup is then a local hit counted as a prefetch hit. next_agents narrows it, or asks for
//   it when kv_store.prefetch is off; names no route leads to are counted and ignored.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <string>
#include <vector>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/model_fingerprint.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/shm_transport/client.h"

#include "support/kv_path_fixture.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr std::uint32_t kSpillBlockTokens = 16;
constexpr std::uint64_t kSpillTokens = 4 * kSpillBlockTokens;
const kvrelay::ModelFingerprint kSpillModel{"llama", 5, 4, 8, kvrelay::DType::kFloat32, "stories260K"};

std::uint64_t entry_bytes_of_one() {
  return kSpillModel.layout(kSpillTokens).total_bytes().value();
}

// Entry `seed`'s token ids: whole blocks, different per seed.
std::vector<kvrelay::TokenId> spill_ids(int seed) {
  std::vector<kvrelay::TokenId> ids(kSpillTokens);
  for (std::uint64_t index = 0; index < ids.size(); ++index)
    ids[index] = static_cast<kvrelay::TokenId>(3 + (index * 37 + static_cast<std::uint64_t>(seed) * 211) % 500);
  return ids;
}

// KV a worker computed: int8-unfriendly floats, different per seed.
std::vector<float> spill_kv(int seed) {
  std::vector<float> kv(entry_bytes_of_one() / sizeof(float));
  for (std::size_t index = 0; index < kv.size(); ++index)
    kv[index] = std::sin(0.37F * static_cast<float>(index) + static_cast<float>(seed)) * 3.1F;
  return kv;
}

std::vector<std::byte> as_byte_vector(const std::vector<float>& kv) {
  const auto bytes = std::as_bytes(std::span(kv));
  return {bytes.begin(), bytes.end()};
}

// KV whose every token's rows depend on the token's position only (as a real worker's prefix
// KV does not change when the prompt grows): tensor by tensor, [tokens, kv_heads, head_dim].
std::vector<float> positional_kv(std::uint64_t tokens, int seed) {
  const auto layout = kSpillModel.layout(tokens);
  const std::uint64_t row = std::uint64_t{layout.kv_heads} * layout.head_dim;
  std::vector<float> kv(layout.total_bytes().value() / sizeof(float));
  for (std::uint64_t tensor = 0; tensor < 2ULL * layout.layers; ++tensor)
    for (std::uint64_t index = 0; index < tokens * row; ++index)
      kv[tensor * tokens * row + index] =
          std::sin(0.37F * static_cast<float>(index) + 1.3F * static_cast<float>(tensor) + static_cast<float>(seed));
  return kv;
}

// A worker of one node: publishes and looks up entries over that node's data plane.
class Worker {
 public:
  explicit Worker(const Sidecar& sidecar) {
    auto connected = kvrelay::shm::ShmClient::connect(sidecar.socket_path());
    REQUIRE(connected.has_value());
    client_.emplace(std::move(connected).value());
  }
  void publish(int seed, const json& params) { publish_ids(spill_ids(seed), spill_kv(seed), params); }
  void publish_ids(const std::vector<kvrelay::TokenId>& ids, const std::vector<float>& kv, const json& params) {
    const auto hashes = kvrelay::hash_blocks(kSpillModel.id(), ids, kSpillBlockTokens);
    kvrelay::kv_store::EntryChain chain;
    chain.block_tokens = kSpillBlockTokens;
    chain.tokens = ids;
    REQUIRE(client_
                ->publish_with_context({kSpillModel.id(), hashes.back()}, kSpillModel.layout(ids.size()),
                                       std::as_bytes(std::span(kv)), params.dump(), kvrelay::Fidelity::exact(), &chain)
                .has_value());
  }
  // The lookup of entry `seed`'s tokens and one more; nullopt on a miss.
  std::optional<kvrelay::shm::ResolvedPrefix> look_up(int seed, const json& params) {
    return look_up_ids(spill_ids(seed), params);
  }
  std::optional<kvrelay::shm::ResolvedPrefix> look_up_ids(const std::vector<kvrelay::TokenId>& ids,
                                                          const json& params) {
    const auto hashes = kvrelay::hash_blocks(kSpillModel.id(), ids, kSpillBlockTokens);
    kvrelay::shm::ResolveRequest request;
    request.model_id = kSpillModel.id();
    request.block_tokens = kSpillBlockTokens;
    request.prompt_tokens = ids.size() + 1;
    request.block_hashes.assign(hashes.begin(), hashes.end());
    request.params_json = params.dump();
    auto resolved = client_->resolve(request);
    if (!resolved && resolved.error().code == kvrelay::ErrorCode::kNotFound) return std::nullopt;
    INFO((resolved ? std::string() : resolved.error().to_string()));
    REQUIRE(resolved.has_value());
    return std::move(resolved).value();
  }

 private:
  std::optional<kvrelay::shm::ShmClient> client_;
};

std::vector<std::byte> bytes_of(const kvrelay::shm::ReadOnlyEntry& entry) {
  std::vector<std::byte> bytes(entry.info.bytes);
  REQUIRE(entry.read(0, bytes).has_value());
  return bytes;
}

json get_json(const Sidecar& sidecar, const std::string& path) {
  const auto reply = http_request(sidecar.admin_port(), "GET", path);
  REQUIRE(reply.status == 200);
  return json::parse(reply.body);
}

// The newest decision of `kind` for `request_id`.
json decision_of(const Sidecar& sidecar, const std::string& kind, const std::string& request_id) {
  for (const auto& record : sidecar.decisions(64)) {
    if (record.value("kind", "") == kind && record.value("request_id", "") == request_id) return record;
  }
  FAIL("no " << kind << " record for " << request_id);
  return json();
}

// The push record of `request_id`: the sender logs it once the receiver's Committed is back,
// which may be just after the receiver's store lists the entry.
json push_record_of(const Sidecar& sidecar, const std::string& request_id) {
  const bool logged = wait_until(
      [&] {
        for (const auto& record : sidecar.decisions(64))
          if (record.value("kind", "") == "push" && record.value("request_id", "") == request_id) return true;
        return false;
      },
      std::chrono::seconds(10));
  REQUIRE(logged);
  return decision_of(sidecar, "push", request_id);
}

json peer_json(const std::string& id, std::uint16_t port, std::uint64_t accept_spill_bytes) {
  return {{"id", id}, {"address", "127.0.0.1:" + std::to_string(port)}, {"accept_spill_bytes", accept_spill_bytes}};
}

// Until `sidecar` has heard from `peer` that it would take `bytes` of spills from it.
void wait_for_spill_room(const Sidecar& sidecar, const std::string& peer, std::uint64_t bytes) {
  const bool heard = wait_until(
      [&] {
        const auto state = get_json(sidecar, "/admin/state");
        for (const auto& view : state["peers"]["peers"]) {
          if (view.value("id", "") == peer && view.contains("node_state") &&
              view["node_state"].value("spill_accept_left", std::uint64_t{0}) >= bytes) {
            return true;
          }
        }
        return false;
      },
      std::chrono::seconds(10));
  INFO(get_json(sidecar, "/admin/state")["peers"].dump(2));
  REQUIRE(heard);
}

}  // namespace

TEST_CASE("spill: a store victim worth keeping goes to a peer and comes back on the next lookup",
          "[proxy][kv_path][spill][process]") {
  const std::uint64_t entry_bytes = entry_bytes_of_one();
  const json model = stories_model_json();
  // B keeps A's spills: up to four entries of A's agents' model.
  Sidecar b("node-b");
  json b_policy = sidecar_policy(
      b, json::array({agent_json("writer", "node-a", 1, model), agent_json("again", "node-a", 1, model)}),
      json::array(), json::array({peer_json("node-a", 1, 4 * entry_bytes)}));
  b.start(b_policy);
  // A has room for one entry; its victims of utility >= 2.5 are spilled (a put counts as one hit:
  // an entry never read has utility 2 and is dropped).
  Sidecar a("node-a");
  json a_policy =
      sidecar_policy(a, json::array({agent_json("writer", "", 1, model), agent_json("again", "", 1, model)}),
                     json::array({{{"id", "raw"}, {"from", "writer"}, {"to", "again"}, {"forced_medium", "kv_raw"}},
                                  {{"id", "int8"}, {"from", "writer"}, {"to", "again"}, {"forced_medium", "kv_int8"}}}),
                     json::array({peer_json("node-b", b.peer_port(), 4 * entry_bytes)}));
  a_policy["limits"]["kv_store_bytes"] = entry_bytes + entry_bytes / 2;
  a_policy["kv_store"] = {{"recency_tau_s", 3600}, {"spill_min_utility", 2.5}};
  a.start(a_policy);
  wait_for_spill_room(a, "node-b", entry_bytes);
  Worker worker(a);
  const json writer{{"agent", "writer"}};
  const auto lookup = [](const std::string& route, const std::string& request_id) {
    return json{{"agent", "again"}, {"route", route}, {"request_id", request_id}};
  };

  SECTION("a lossless spill is fetched back exact") {
    worker.publish(1, writer);
    for (int read = 0; read < 3; ++read)
      REQUIRE(worker.look_up(1, lookup("raw", "warm" + std::to_string(read))));
    worker.publish(2, writer);  // e1 (read thrice) must make room: spilled
    REQUIRE(wait_until([&] { return get_json(a, "/admin/kv")["spill"]["spills"] == 1; }, std::chrono::seconds(10)));
    worker.publish(3, writer);  // e2 (never read) makes room for e3: dropped
    const auto a_kv = get_json(a, "/admin/kv");
    INFO(a_kv.dump(2));
    CHECK(a_kv["spill"]["stubs"] == 1);
    CHECK(a_kv["spill"]["failures"] == 0);
    CHECK(a_kv["evictions"]["budget"] == 2);
    REQUIRE(a_kv["stubs"].size() == 1);
    CHECK(a_kv["stubs"][0]["peer"] == "node-b");
    CHECK(a_kv["stubs"][0]["tokens"] == kSpillTokens);
    const auto b_kv = get_json(b, "/admin/kv");
    INFO(b_kv.dump(2));
    CHECK(b_kv["spill"]["spilled_in_entries"] == 1);
    CHECK(b_kv["spill"]["spilled_in_bytes"] == entry_bytes);
    REQUIRE(b_kv["top"].size() == 1);
    CHECK(b_kv["top"][0]["origin"] == "spilled_in");
    CHECK(a.metric_sum("kvrelay_kv_spills_total", {"peer=\"node-b\"", "outcome=\"spilled\""}) == 1.0);

    const auto back = worker.look_up(1, lookup("raw", "back"));
    REQUIRE(back);
    CHECK(back->meta.fidelity.is_exact());
    CHECK(back->meta.blocks == kSpillTokens / kSpillBlockTokens);
    CHECK(bytes_of(back->entry) == as_byte_vector(spill_kv(1)));
    const auto record = decision_of(a, "lookup", "back");
    INFO(record.dump(2));
    CHECK(record["outcome"] == "hit_peer");
    CHECK(record["stub"]["peer"] == "node-b");
    CHECK(record["fetch_back"] == true);
    CHECK(record["fetch"][0]["peer"] == "node-b");
    CHECK(a.metric_sum("kvrelay_kv_fetch_backs_total", {"route=\"raw\""}) == 1.0);
    CHECK(get_json(a, "/admin/kv")["spill"]["fetch_backs"] == 1);
    // Back in A's store: the stub stands for nothing any more, and the next lookup is local.
    CHECK(get_json(a, "/admin/kv")["spill"]["stubs"] == 0);
    REQUIRE(worker.look_up(1, lookup("raw", "local")));
    CHECK(decision_of(a, "lookup", "local")["outcome"] == "hit_local");
  }

  SECTION("a stub whose peer no longer holds the entry is forgotten") {
    worker.publish(1, writer);
    for (int read = 0; read < 3; ++read)
      REQUIRE(worker.look_up(1, lookup("raw", "warm" + std::to_string(read))));
    worker.publish(2, writer);
    REQUIRE(wait_until([&] { return get_json(a, "/admin/kv")["spill"]["spills"] == 1; }, std::chrono::seconds(10)));
    CHECK(get_json(a, "/admin/kv")["stubs"][0]["codec"] == "lossless");
    REQUIRE(admin_request(b.admin_port(), "DELETE", "/admin/kv").status == 200);  // B drops it
    CHECK_FALSE(worker.look_up(1, lookup("raw", "lost")));
    const auto record = decision_of(a, "lookup", "lost");
    INFO(record.dump(2));
    CHECK(record["stub"]["forgotten"] == true);
    CHECK(get_json(a, "/admin/kv")["spill"]["stubs"] == 0);
  }

  SECTION("a lossy spill comes back lossy, and never answers a lossless lookup") {
    a_policy["kv_store"]["spill_medium"] = "kv_int8";
    a.reload(a_policy);
    worker.publish(4, writer);
    for (int read = 0; read < 3; ++read)
      REQUIRE(worker.look_up(4, lookup("raw", "warm" + std::to_string(read))));
    worker.publish(5, writer);  // e4 spilled as int8
    REQUIRE(wait_until([&] { return get_json(a, "/admin/kv")["spill"]["spills"] == 1; }, std::chrono::seconds(10)));
    const auto b_kv = get_json(b, "/admin/kv");
    REQUIRE(b_kv["top"].size() == 1);
    CHECK(b_kv["top"][0]["fidelity"]["lossy_codec"] == "int8");

    // The lossless route: B holds no exact KV of it, so A's worker prefills.
    CHECK_FALSE(worker.look_up(4, lookup("raw", "exact")));
    const auto refused = decision_of(a, "lookup", "exact");
    INFO(refused.dump(2));
    CHECK(refused["stub"]["peer"] == "node-b");
    CHECK_FALSE(refused.contains("fetch_back"));
    // The int8 route: served from B, marked lossy.
    const auto lossy = worker.look_up(4, lookup("int8", "lossy"));
    REQUIRE(lossy);
    CHECK(lossy->meta.fidelity.lossy_codec == "int8");
    // (int8 keeps a 64-token entry's tokens exact: its first 4 and last 128; the label is what tells.)
    CHECK(lossy->entry.info.bytes == entry_bytes);
    CHECK(decision_of(a, "lookup", "lossy")["fetch_back"] == true);
    // Not filed as exact at A: the stub stays for the next lookup.
    CHECK(get_json(a, "/admin/kv")["spill"]["stubs"] == 1);
  }
}

TEST_CASE("prefetch: a publish goes ahead to the route's remote destination, and B's lookup is a local hit",
          "[proxy][kv_path][prefetch][process]") {
  const json model = stories_model_json();
  const json routes = json::array({{{"id", "w-r"}, {"from", "writer"}, {"to", "reader"}, {"forced_medium", "kv_raw"}}});
  Sidecar b("node-b");
  b.start(sidecar_policy(b, json::array({agent_json("writer", "node-a", 1, model), agent_json("reader", "", 1, model)}),
                         routes, json::array({peer_json("node-a", 1, 0)})));
  Sidecar a("node-a");
  json a_policy =
      sidecar_policy(a, json::array({agent_json("writer", "", 1, model), agent_json("reader", "node-b", 1, model)}),
                     routes, json::array({peer_json("node-b", b.peer_port(), 0)}));
  a_policy["kv_store"]["prefetch"] = true;  // the product's default; the fixture turns it off
  a.start(a_policy);
  Worker writer(a);
  Worker reader(b);
  const auto b_entries = [&] { return get_json(b, "/admin/kv")["entries"].get<int>(); };

  writer.publish(1, {{"agent", "writer"}, {"request_id", "p1"}});
  REQUIRE(wait_until([&] { return b_entries() == 1; }, std::chrono::seconds(10)));
  CHECK(get_json(b, "/admin/kv")["top"][0]["origin"] == "prefetched");
  CHECK(push_record_of(a, "p1")["purpose"] == "prefetch");
  CHECK(a.metric_sum("kvrelay_kv_prefetches_total", {"route=\"w-r\"", "result=\"pushed\""}) == 1.0);
  const auto hit = reader.look_up(1, {{"agent", "reader"}, {"route", "w-r"}, {"request_id", "r1"}});
  REQUIRE(hit);
  CHECK(bytes_of(hit->entry) == as_byte_vector(spill_kv(1)));
  const auto record = decision_of(b, "lookup", "r1");
  INFO(record.dump(2));
  CHECK(record["outcome"] == "hit_local");
  CHECK(record["prefetch_hit"] == true);
  CHECK_FALSE(record.contains("fetch"));
  CHECK(b.metric_sum("kvrelay_kv_prefetch_hits_total", {"route=\"w-r\""}) == 1.0);
  CHECK(get_json(b, "/admin/kv")["prefetch"]["hits"] == 1);
  CHECK(get_json(a, "/admin/kv")["prefetch"]["sent"] == 1);

  // next_agents naming no route's destination: counted, ignored, and nothing prefetched.
  writer.publish(2, {{"agent", "writer"}, {"request_id", "p2"}, {"next_agents", {"nobody"}}});
  CHECK(a.metric_sum("kvrelay_kv_next_agents_ignored_total") == 1.0);
  // Prefetch off: only a publish that names the reader sends its entry ahead.
  a_policy["kv_store"] = {{"prefetch", false}};
  a.reload(a_policy);
  writer.publish(3, {{"agent", "writer"}, {"request_id", "p3"}});
  writer.publish(4, {{"agent", "writer"}, {"request_id", "p4"}, {"next_agents", {"reader"}}});
  REQUIRE(wait_until([&] { return b_entries() == 2; }, std::chrono::seconds(10)));
  CHECK(wait_until([&] { return a.metric_sum("kvrelay_kv_prefetches_total", {"result=\"pushed\""}) == 2.0; },
                   std::chrono::seconds(10)));
  CHECK(reader.look_up(4, {{"agent", "reader"}, {"route", "w-r"}, {"request_id", "r4"}}));
  CHECK(decision_of(b, "lookup", "r4")["prefetch_hit"] == true);
}

TEST_CASE("delta push: a publish extending an entry the destination holds sends only the new blocks",
          "[proxy][kv_path][push][process]") {
  const json model = stories_model_json();
  const json routes =
      json::array({{{"id", "w-r"}, {"from", "writer"}, {"to", "reader"}, {"forced_medium", "kv_raw"}, {"push", true}}});
  Sidecar b("node-b");
  b.start(sidecar_policy(b, json::array({agent_json("writer", "node-a", 1, model), agent_json("reader", "", 1, model)}),
                         routes, json::array({peer_json("node-a", 1, 0)})));
  Sidecar a("node-a");
  a.start(sidecar_policy(a, json::array({agent_json("writer", "", 1, model), agent_json("reader", "node-b", 1, model)}),
                         routes, json::array({peer_json("node-b", b.peer_port(), 0)})));
  Worker writer(a);
  Worker reader(b);
  // A conversation's first turn (64 tokens), then its second (128: the first and 64 more).
  std::vector<kvrelay::TokenId> turn2 = spill_ids(7);
  const auto more = spill_ids(8);
  turn2.insert(turn2.end(), more.begin(), more.end());
  const std::vector<kvrelay::TokenId> turn1(turn2.begin(), turn2.begin() + static_cast<std::ptrdiff_t>(kSpillTokens));
  writer.publish_ids(turn1, positional_kv(kSpillTokens, 7), {{"agent", "writer"}, {"request_id", "t1"}});
  REQUIRE(wait_until([&] { return get_json(b, "/admin/kv")["entries"] == 1; }, std::chrono::seconds(10)));
  // A learns from B's summary that B holds the first turn.
  REQUIRE(wait_until(
      [&] {
        const auto state = get_json(a, "/admin/state");
        for (const auto& view : state["peers"]["peers"])
          if (view.value("id", "") == "node-b" && view.value("summary_keys", 0) >= 1) return true;
        return false;
      },
      std::chrono::seconds(10)));
  const auto turn2_kv = positional_kv(2 * kSpillTokens, 7);
  writer.publish_ids(turn2, turn2_kv, {{"agent", "writer"}, {"request_id", "t2"}});
  REQUIRE(wait_until([&] { return get_json(b, "/admin/kv")["entries"] == 2; }, std::chrono::seconds(10)));
  const auto record = push_record_of(a, "t2");
  INFO(record.dump(2));
  CHECK(record["outcome"] == "pushed");
  CHECK(record["skip_tokens"] == kSpillTokens);
  CHECK(a.metric_sum("kvrelay_kv_pushes_total", {"route=\"w-r\"", "result=\"delta\""}) == 1.0);
  CHECK(a.metric_sum("kvrelay_kv_pushes_total", {"route=\"w-r\"", "result=\"pushed\""}) == 1.0);
  // Half the raw bytes crossed the link for the second turn.
  CHECK(a.metric_sum("kvrelay_kv_raw_bytes_total", {"direction=\"pushed\""}) ==
        static_cast<double>(2 * entry_bytes_of_one()));
  // B joined its held first turn and the pushed second half: A's second turn, byte for byte.
  const auto hit = reader.look_up_ids(turn2, {{"agent", "reader"}, {"route", "w-r"}, {"request_id", "r2"}});
  REQUIRE(hit);
  CHECK(hit->meta.blocks == turn2.size() / kSpillBlockTokens);
  CHECK(bytes_of(hit->entry) == as_byte_vector(turn2_kv));
  CHECK(decision_of(b, "lookup", "r2")["outcome"] == "hit_local");
}

TEST_CASE("probes and the global view: an idle link is probed, and summaries carry the peer's link rates",
          "[proxy][kv_path][probe][process]") {
  const json model = stories_model_json();
  Sidecar b("node-b");
  json b_policy = sidecar_policy(b, json::array({agent_json("reader", "", 1, model)}), json::array(),
                                 json::array({peer_json("node-a", 1, 0)}));
  b_policy["scheduler"] = {{"link_bytes_per_s", 1e9}};
  b.start(b_policy);
  Sidecar a("node-a");
  json a_policy = sidecar_policy(a, json::array({agent_json("reader", "node-b", 1, model)}), json::array(),
                                 json::array({peer_json("node-b", b.peer_port(), 0)}));
  a_policy["limits"]["peer_bandwidth_probe_interval_ms"] = 100;
  a.start(a_policy);
  // No KV moves between them: the prober measures the idle link itself.
  REQUIRE(wait_until(
      [&] {
        return a.metric_sum("kvrelay_peer_bandwidth_probes_total", {"peer=\"node-b\"", "result=\"ok\""}) >= 1.0;
      },
      std::chrono::seconds(10)));
  const auto state = get_json(a, "/admin/state");
  INFO(state["peers"].dump(2));
  const auto& view = state["peers"]["peers"][0];
  CHECK(view["link"]["transfer_samples"].get<int>() >= 1);
  CHECK(view["link"]["throughput_bytes_per_s"].get<double>() > 0.0);
  CHECK(view["node_state"]["link_bytes_per_s"] == 1'000'000'000);
  CHECK(view["node_state"]["sent_bytes_per_s"] == 0);  // B sent A no KV
  CHECK(a.metric_sum("kvrelay_peer_link_throughput_bytes_per_second", {"peer=\"node-b\""}) > 0.0);
}
