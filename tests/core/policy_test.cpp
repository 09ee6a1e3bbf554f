#include "kvrelay/core/policy.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <string>

#include "support/test_paths.h"

using kvrelay::parse_policy;
using nlohmann::json;

namespace {

json minimal_policy() {
  return json::parse(R"({
    "schema_version": 1,
    "node": {"id": "node-a"},
    "listen": {"http": "127.0.0.1:0"},
    "peers": [{"id": "node-b", "address": "127.0.0.1:7071"}],
    "agents": [
      {"id": "a", "upstream": "http://127.0.0.1:9000",
       "model": {"architecture": "llama", "layers": 5, "kv_heads": 4, "head_dim": 8, "dtype": "fp32", "weights": "w"}},
      {"id": "b", "upstream": "http://127.0.0.1:9001/v1/", "node": "node-b",
       "model": {"architecture": "llama", "layers": 5, "kv_heads": 4, "head_dim": 8, "dtype": "fp32", "weights": "w"}}
    ],
    "routes": [
      {"id": "r0", "from": "a", "to": "b"},
      {"id": "r1", "from": "b", "to": "a", "priority": 3},
      {"id": "r2", "from": "a", "to": "b", "priority": 1}
    ]
  })");
}

std::string rejection(const json& document) {
  const auto result = parse_policy(document.dump(), "config/x.json");
  REQUIRE_FALSE(result);
  return result.error().message;
}

}  // namespace

TEST_CASE("every example policy in config/ loads", "[core][policy]") {
  int examples = 0;
  for (const auto& entry : std::filesystem::directory_iterator(kvrelay::test::source_dir() / "config")) {
    const auto name = entry.path().filename().string();
    if (entry.path().extension() != ".json" || name.find("schema") != std::string::npos) continue;
    INFO(name);
    // The examples name the admin token file of the hosts they are for, which this one has not.
    const auto policy = kvrelay::load_policy_file(entry.path().string(), kvrelay::PolicySecrets::kSkip);
    if (!policy) FAIL(policy.error().message);
    CHECK_FALSE(policy.value().node_id.empty());
    CHECK_FALSE(policy.value().admin.token_file.empty());  // the examples configure a token
    ++examples;
  }
  CHECK(examples >= 3);
}

TEST_CASE("a valid policy is parsed into typed fields with defaults", "[core][policy]") {
  const auto result = parse_policy(minimal_policy().dump(), "mem.json");
  REQUIRE(result);
  const auto& policy = result.value();
  CHECK(policy.node_id == "node-a");
  CHECK(policy.listen.http.port == 0);
  CHECK_FALSE(policy.listen.admin.has_value());
  REQUIRE(policy.agents.size() == 2);
  CHECK(policy.agents[1].upstream.host == "127.0.0.1");
  CHECK(policy.agents[1].upstream.port == 9001);
  CHECK(policy.agents[1].upstream.base_path == "/v1");
  CHECK(policy.agents[0].model.layout(1).bytes_per_token().value() == 1280);
  REQUIRE(policy.find_route("r1") != nullptr);
  CHECK(policy.find_route("r1")->priority == 3);
  CHECK(policy.find_route("r0")->enabled);
  CHECK(policy.find_route("r0")->hysteresis_threshold == Approx(0.15));
  CHECK(policy.limits.max_body_bytes == 16ULL * 1024 * 1024);
  CHECK(policy.limits.peer_buffer_bytes == 192ULL << 20);
  CHECK(policy.find_peer("node-b")->address.port == 7071);
}

TEST_CASE("wrong type is rejected with file, pointer and expectation", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][2]["priority"] = "high";
  CHECK(rejection(document) == R"(config/x.json: /routes/2/priority: expected integer 0..7, got "high")");
}

TEST_CASE("out-of-range values are rejected with their pointer", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][0]["audit_fraction"] = 1.5;
  document["agents"][0]["model"]["layers"] = 0;
  document["limits"] = {{"max_connections", -3}};
  const auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains("config/x.json: /routes/0/audit_fraction: expected number 0..1, got 1.5"));
  CHECK_THAT(message, Catch::Contains("/agents/0/model/layers: expected integer 1..1024, got 0"));
  CHECK_THAT(message, Catch::Contains("/limits/max_connections: expected integer 1..1048576, got -3"));
}

TEST_CASE("peer transfer buffers can be kept smaller, or not at all", "[core][policy]") {
  auto document = minimal_policy();
  document["limits"] = {{"peer_buffer_bytes", 0}};
  const auto none = parse_policy(document.dump(), "config/x.json");
  REQUIRE(none);
  CHECK(none.value().limits.peer_buffer_bytes == 0);
  document["limits"] = {{"peer_buffer_bytes", -1}};
  CHECK_THAT(rejection(document), Catch::Contains("/limits/peer_buffer_bytes: expected integer"));
}

TEST_CASE("peer chunk staging is on unless limits.peer_staging turns it off", "[core][policy]") {
  auto document = minimal_policy();
  const auto defaults = parse_policy(document.dump(), "config/x.json");
  REQUIRE(defaults);
  CHECK(defaults.value().limits.peer_staging);
  document["limits"] = {{"peer_staging", false}};
  const auto off = parse_policy(document.dump(), "config/x.json");
  REQUIRE(off);
  CHECK_FALSE(off.value().limits.peer_staging);
  document["limits"] = {{"peer_staging", "no"}};
  CHECK_THAT(rejection(document), Catch::Contains("/limits/peer_staging: expected"));
}

TEST_CASE("the shared-memory arena has a size, and 0 turns it off", "[core][policy]") {
  auto document = minimal_policy();
  const auto defaults = parse_policy(document.dump(), "config/x.json");
  REQUIRE(defaults);
  CHECK(defaults.value().limits.shm_arena_bytes == 256ULL << 20);
  document["limits"] = {{"shm_arena_bytes", 0}};
  const auto off = parse_policy(document.dump(), "config/x.json");
  REQUIRE(off);
  CHECK(off.value().limits.shm_arena_bytes == 0);
  document["limits"] = {{"shm_arena_bytes", "big"}};
  CHECK_THAT(rejection(document), Catch::Contains("/limits/shm_arena_bytes: expected integer"));
}

TEST_CASE("a reservation waits 30 s for its claim unless limits.kv_reservation_ms says otherwise", "[core][policy]") {
  auto document = minimal_policy();
  const auto defaults = parse_policy(document.dump(), "config/x.json");
  REQUIRE(defaults);
  CHECK(defaults.value().limits.kv_reservation == std::chrono::milliseconds(30'000));
  document["limits"] = {{"kv_reservation_ms", 250}};
  const auto short_wait = parse_policy(document.dump(), "config/x.json");
  REQUIRE(short_wait);
  CHECK(short_wait.value().limits.kv_reservation == std::chrono::milliseconds(250));
  document["limits"] = {{"kv_reservation_ms", 0}};
  CHECK_THAT(rejection(document), Catch::Contains("/limits/kv_reservation_ms"));
}

TEST_CASE("memory strategy is portable unless limits.memory_strategy asks for prefault", "[core][policy]") {
  auto document = minimal_policy();
  const auto defaults = parse_policy(document.dump(), "config/x.json");
  REQUIRE(defaults);
  CHECK(defaults.value().limits.memory_strategy == kvrelay::MemoryStrategy::kPortable);
  document["limits"] = {{"memory_strategy", "prefault"}};
  const auto prefault = parse_policy(document.dump(), "config/x.json");
  REQUIRE(prefault);
  CHECK(prefault.value().limits.memory_strategy == kvrelay::MemoryStrategy::kPrefault);
  document["limits"] = {{"memory_strategy", "portable"}};
  CHECK(parse_policy(document.dump(), "config/x.json").value().limits.memory_strategy ==
        kvrelay::MemoryStrategy::kPortable);
  document["limits"] = {{"memory_strategy", "lazy"}};
  CHECK_THAT(
      rejection(document),
      Catch::Contains("config/x.json: /limits/memory_strategy: expected \"portable\" or \"prefault\", got \"lazy\""));
  document["limits"] = {{"memory_strategy", true}};
  CHECK_THAT(rejection(document), Catch::Contains("/limits/memory_strategy: expected \"portable\" or \"prefault\""));
}

TEST_CASE("memory strategy names round-trip and nothing else parses", "[core][policy]") {
  using kvrelay::MemoryStrategy;
  for (const auto strategy : {MemoryStrategy::kPortable, MemoryStrategy::kPrefault}) {
    CHECK(kvrelay::parse_memory_strategy(kvrelay::to_string(strategy)) == strategy);
  }
  static_assert(kvrelay::to_string(MemoryStrategy::kPrefault) == "prefault");
  CHECK_FALSE(kvrelay::parse_memory_strategy("Prefault"));
  CHECK_FALSE(kvrelay::parse_memory_strategy(""));
}

TEST_CASE("an agent's tensor_parallel_size is 1 unless set, and must share out its KV heads", "[core][policy]") {
  auto document = minimal_policy();
  const auto defaults = parse_policy(document.dump(), "config/x.json");
  REQUIRE(defaults);
  CHECK(defaults.value().agents[0].tensor_parallel_size == 1);
  document["agents"][0]["tensor_parallel_size"] = 2;
  const auto two = parse_policy(document.dump(), "config/x.json");
  REQUIRE(two);
  CHECK(two.value().agents[0].tensor_parallel_size == 2);
  document["agents"][0]["tensor_parallel_size"] = 0;
  CHECK_THAT(rejection(document), Catch::Contains("/agents/0/tensor_parallel_size"));
  document["agents"][0]["tensor_parallel_size"] = 3;  // 4 heads do not share out over 3 ranks
  CHECK_THAT(rejection(document), Catch::Contains("/agents/0/tensor_parallel_size") &&
                                      Catch::Contains("not a multiple of tensor_parallel_size"));
  document["agents"][0]["tensor_parallel_size"] = 8;  // more ranks than heads: one each, replicated
  CHECK(parse_policy(document.dump(), "config/x.json"));
}

TEST_CASE("unknown keys are rejected, listing what is allowed", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][1]["colour"] = "blue";
  document["surprise"] = true;
  const auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains("config/x.json: /routes/1/colour: unknown key (allowed here:"));
  CHECK_THAT(message, Catch::Contains("config/x.json: /surprise: unknown key"));
}

TEST_CASE("missing required keys are named by pointer", "[core][policy]") {
  auto document = minimal_policy();
  document.erase("schema_version");
  document["agents"][0].erase("upstream");
  const auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains("/schema_version: required key is missing"));
  CHECK_THAT(message, Catch::Contains("/agents/0/upstream: required key is missing"));
}

TEST_CASE("dangling references are rejected", "[core][policy]") {
  SECTION("route names an unknown agent") {
    auto document = minimal_policy();
    document["routes"][1]["to"] = "ghost";
    CHECK(rejection(document) == R"(config/x.json: /routes/1/to: expected an agent id from /agents, got "ghost")");
  }
  SECTION("agent on an unknown node") {
    auto document = minimal_policy();
    document["agents"][1]["node"] = "node-z";
    CHECK_THAT(rejection(document), Catch::Contains("/agents/1/node: expected this node's id or a peer id"));
  }
  SECTION("duplicate ids") {
    auto document = minimal_policy();
    document["routes"][2]["id"] = "r0";
    CHECK_THAT(rejection(document), Catch::Contains(R"(/routes/2/id: duplicate id "r0")"));
  }
  SECTION("forced medium outside the allowed media") {
    auto document = minimal_policy();
    document["routes"][0]["allowed_media"] = {"tokens", "kv_raw"};
    document["routes"][0]["forced_medium"] = "kv_int4";
    CHECK_THAT(rejection(document),
               Catch::Contains("/routes/0/forced_medium: expected a medium listed in allowed_media"));
  }
}

TEST_CASE("media, addresses, URLs and the schema version are validated", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][0]["allowed_media"] = {"tokens", "carrier_pigeon"};
  document["listen"]["http"] = "127.0.0.1:99999";
  document["agents"][0]["upstream"] = "https://example";
  document["schema_version"] = 2;
  const auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains(R"(/routes/0/allowed_media/1: expected a medium)"));
  CHECK_THAT(message,
             Catch::Contains(R"(/listen/http: expected "host:port" with port 0..65535, got "127.0.0.1:99999")"));
  CHECK_THAT(message, Catch::Contains("/agents/0/upstream: expected http://host[:port][/path] URL"));
  CHECK_THAT(message, Catch::Contains("/schema_version: expected 1, got 2"));
}

TEST_CASE("plugin codec media are accepted by name", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][0]["allowed_media"] = {"tokens", "codec:my_codec"};
  document["routes"][0]["forced_medium"] = "codec:my_codec";
  CHECK(parse_policy(document.dump(), "x"));
}

TEST_CASE("malformed JSON reports line and column", "[core][policy]") {
  const auto result = parse_policy("{\n  \"schema_version\": 1,\n  \"node\": {\"id\": \"a\",}\n}", "config/bad.json");
  REQUIRE_FALSE(result);
  CHECK_THAT(result.error().message, Catch::StartsWith("config/bad.json: malformed JSON at line 3, column"));
}

TEST_CASE("a number too large for a double is an error naming it, not an exception (found by fuzz_policy)",
          "[core][policy]") {
  const auto result = parse_policy("{\"schema_version\": 1E777}", "config/huge.json");
  REQUIRE_FALSE(result);
  CHECK(result.error().code == kvrelay::ErrorCode::kInvalidArgument);
  CHECK_THAT(result.error().message, Catch::StartsWith("config/huge.json: malformed JSON: "));
  CHECK_THAT(result.error().message, Catch::Contains("1E777"));
}

TEST_CASE("a missing file is reported with its path", "[core][policy]") {
  const auto result = kvrelay::load_policy_file("/nonexistent/kvrelay.json");
  REQUIRE_FALSE(result);
  CHECK(result.error().code == kvrelay::ErrorCode::kNotFound);
  CHECK_THAT(result.error().message, Catch::Contains("/nonexistent/kvrelay.json"));
}

TEST_CASE("host:port and URL parsing", "[core][policy]") {
  CHECK(kvrelay::parse_host_port("[::1]:80").value().host == "::1");
  CHECK(kvrelay::parse_host_port("localhost:0").value().port == 0);
  CHECK_FALSE(kvrelay::parse_host_port("nohost"));
  CHECK_FALSE(kvrelay::parse_host_port(":80"));
  CHECK_FALSE(kvrelay::parse_host_port("h:8x"));
  CHECK(kvrelay::parse_http_url("http://worker").value().port == 80);
  CHECK(kvrelay::parse_http_url("http://worker:8000/v1").value().base_path == "/v1");
  CHECK_FALSE(kvrelay::parse_http_url("http://worker:0"));
}

TEST_CASE("route audit block: treatments and trials file and the audit_fraction shorthand", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][0]["audit"] = json::parse(R"({"fraction": 0.2, "trials_file": "/tmp/t.jsonl",
      "treatments": [{"name": "T0", "medium": "tokens", "span": "none"},
                     {"name": "T3-int8", "medium": "kv_int8", "span": "all"}]})");
  document["routes"][1]["audit_fraction"] = 0.1;
  const auto result = parse_policy(document.dump(), "mem.json");
  REQUIRE(result);
  const auto& audited = *result.value().find_route("r0");
  CHECK(audited.audit_fraction == 0.2);
  CHECK(audited.audit.fraction == 0.2);
  CHECK(audited.audit.trials_file == "/tmp/t.jsonl");
  REQUIRE(audited.audit.treatments.size() == 2);
  CHECK(audited.audit.treatments[1] == (kvrelay::Treatment{"T3-int8", "kv_int8", kvrelay::KvSpan::kAll, std::nullopt}));
  const auto& shorthand = *result.value().find_route("r1");
  CHECK(shorthand.audit.fraction == 0.1);
  // Issue #28: a receiver that did not declare accepts_kv_spans is never offered T2.
  auto without_t2 = kvrelay::default_audit_treatments();
  std::erase_if(without_t2, [](const kvrelay::Treatment& t) { return t.span == kvrelay::KvSpan::kGenerated; });
  CHECK(shorthand.audit.treatments == without_t2);
  CHECK(shorthand.audit.standard_treatments);
  CHECK(shorthand.audit.trials_file.empty());

  const auto receiver = document["routes"][1]["to"].get<std::string>();
  for (auto& agent : document["agents"]) {
    if (agent["id"] == receiver) agent["accepts_kv_spans"] = true;
  }
  const auto spans = parse_policy(document.dump(), "mem.json");
  REQUIRE(spans);
  CHECK(spans.value().find_route("r1")->audit.treatments == kvrelay::default_audit_treatments());
}

TEST_CASE("a treatment list a receiver cannot take is a config error naming it", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][0]["audit"] = json::parse(R"({"fraction": 0.2,
      "treatments": [{"name": "T2", "medium": "kv_raw", "span": "generated"},
                     {"name": "S", "medium": "kv_sparse", "span": "all"}]})");
  const auto message = rejection(document);
  using Catch::Contains;
  CHECK_THAT(message, Contains("/routes/0/audit/treatments/0: span generated needs agent"));
  CHECK_THAT(message, Contains("to declare accepts_kv_spans"));
  CHECK_THAT(message, Contains("/routes/0/audit/treatments/1: medium kv_sparse needs agent"));
  const auto receiver = document["routes"][0]["to"].get<std::string>();
  for (auto& agent : document["agents"]) {
    if (agent["id"] == receiver) {
      agent["accepts_kv_spans"] = true;
      agent["accepts_sparse_kv"] = true;
    }
  }
  CHECK(parse_policy(document.dump(), "mem.json"));
}

TEST_CASE("bad audit blocks are rejected with pointers", "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][0]["audit"] = json::parse(R"({"fraction": 2,
      "treatments": [{"name": "T0", "medium": "tokens", "span": "all"},
                     {"name": "T0", "medium": "kv_bogus", "span": "none"},
                     {"name": "T2", "medium": "kv_raw", "span": "half"}]})");
  document["routes"][0]["audit_fraction"] = 0.5;
  document["routes"][2]["allowed_media"] = json::array({"tokens", "kv_raw"});
  document["routes"][2]["audit"] =
      json::parse(R"({"fraction": 0.5, "treatments": [{"name": "Q", "medium": "kv_int4", "span": "all"}]})");
  const auto message = rejection(document);
  using Catch::Contains;
  CHECK_THAT(message, Contains("/routes/0/audit/fraction: expected number 0..1, got 2"));
  CHECK_THAT(message, Contains("/routes/0/audit/treatments/0/span: span \"all\" with medium \"tokens\""));
  CHECK_THAT(message, Contains("/routes/0/audit/treatments/1/medium: expected a medium name, got \"kv_bogus\""));
  CHECK_THAT(message, Contains("/routes/0/audit/treatments/1/name: duplicate treatment \"T0\""));
  CHECK_THAT(message, Contains("/routes/0/audit/treatments/2/span: expected one of none, prompt, generated, all"));
  CHECK_THAT(message, Contains("/routes/0/audit_fraction: set either audit_fraction or audit.fraction, not both"));
  document["routes"][0].erase("audit");
  document["routes"][0].erase("audit_fraction");
  CHECK_THAT(
      rejection(document),
      Contains("/routes/2/audit/treatments/0/medium: expected a medium listed in allowed_media, got \"kv_int4\""));
}

TEST_CASE("cost_model section: calibrated prefill and decode and codec quality", "[core][policy]") {
  auto document = minimal_policy();
  document["cost_model"] = json::parse(R"({
      "agents": {"b": {"prefill_s": {"a": 0.004, "b": 3e-5, "c": 2e-9}, "decode_s_per_token": 0.0025}},
      "media": {"kv_int8": {"fidelity": 0.98, "extra_decode_fraction": 0.1}}})");
  const auto result = parse_policy(document.dump(), "mem.json");
  REQUIRE(result);
  const auto& cost_model = result.value().cost_model;
  REQUIRE(cost_model.agents.size() == 1);
  CHECK(cost_model.agents[0].first == "b");
  CHECK(cost_model.agents[0].second.prefill_b_s == 3e-5);
  CHECK(cost_model.agents[0].second.decode_s_per_token == 0.0025);
  REQUIRE(cost_model.media.size() == 1);
  CHECK(cost_model.media[0].second.fidelity == 0.98);

  document["cost_model"] = json::parse(R"({
      "agents": {"nobody": {"prefill_s": {"a": -1}}, "a": {"speed": 3}},
      "media": {"kv_bogus": {"fidelity": 0.5}, "kv_int4": {"fidelity": 0}}, "extra": 1})");
  const auto message = rejection(document);
  using Catch::Contains;
  CHECK_THAT(message, Contains("/cost_model/agents/nobody/prefill_s/a: expected number 0..1000000, got -1"));
  CHECK_THAT(message, Contains("/cost_model/agents/a/speed"));
  CHECK_THAT(message, Contains("/cost_model/media/kv_bogus: expected a medium name as key"));
  CHECK_THAT(message, Contains("/cost_model/media/kv_int4/fidelity: expected number"));
  CHECK_THAT(message, Contains("/cost_model/extra"));
  document["cost_model"] = json::parse(R"({"agents": {"nobody": {"decode_s_per_token": 0.01}}})");
  CHECK_THAT(rejection(document), Contains("/cost_model/agents/nobody: expected an agent id from /agents as key"));
}

TEST_CASE("the KV store evicts by utility with a 60 s recency tau unless kv_store says otherwise", "[core][policy]") {
  auto document = minimal_policy();
  const auto defaults = parse_policy(document.dump(), "config/x.json");
  REQUIRE(defaults);
  CHECK(defaults.value().kv_store.eviction == kvrelay::EvictionKind::kUtility);
  CHECK(defaults.value().kv_store.recency_tau_s == 60.0);
  document["kv_store"] = {{"eviction", "lru"}, {"recency_tau_s", 2.5}};
  const auto lru = parse_policy(document.dump(), "config/x.json");
  REQUIRE(lru);
  CHECK(lru.value().kv_store.eviction == kvrelay::EvictionKind::kLru);
  CHECK(lru.value().kv_store.recency_tau_s == 2.5);
  document["kv_store"] = {{"eviction", "lfu"}, {"recency_tau_s", 0}, {"spill", true}};
  const auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains(R"(config/x.json: /kv_store/eviction: expected "utility" or "lru", got "lfu")"));
  CHECK_THAT(message, Catch::Contains("config/x.json: /kv_store/recency_tau_s: expected number 0.001..1000000000"));
  CHECK_THAT(message, Catch::Contains("/kv_store/spill"));
  document["kv_store"] = {{"recency_tau_s", "soon"}};
  CHECK_THAT(rejection(document), Catch::Contains("/kv_store/recency_tau_s: expected number"));
}

TEST_CASE("spill and prefetch keys: defaults, ranges and a KV medium for spills", "[core][policy]") {
  auto document = minimal_policy();
  const auto defaults = parse_policy(document.dump(), "config/x.json");
  REQUIRE(defaults);
  const auto& store = defaults.value().kv_store;
  CHECK(store.spill_min_utility == 1.5);
  CHECK(store.spill_medium == "kv_lossless");
  CHECK(store.spill_inflight_bytes == 64ULL << 20);
  CHECK(store.prefetch);
  CHECK(store.prefetch_max_bytes == 256ULL << 20);
  document["kv_store"] = {{"spill_min_utility", 3},
                          {"spill_medium", "kv_int8"},
                          {"spill_inflight_bytes", 1024},
                          {"prefetch", false},
                          {"prefetch_max_bytes", 0}};
  const auto set = parse_policy(document.dump(), "config/x.json");
  REQUIRE(set);
  CHECK(set.value().kv_store.spill_min_utility == 3.0);
  CHECK(set.value().kv_store.spill_medium == "kv_int8");
  CHECK(set.value().kv_store.spill_inflight_bytes == 1024);
  CHECK_FALSE(set.value().kv_store.prefetch);
  CHECK(set.value().kv_store.prefetch_max_bytes == 0);
  document["kv_store"] = {{"spill_medium", "tokens"}, {"spill_min_utility", -1}, {"prefetch", "yes"}};
  const auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains("config/x.json: /kv_store/spill_medium: expected a KV medium"));
  CHECK_THAT(message, Catch::Contains("/kv_store/spill_min_utility: expected number"));
  CHECK_THAT(message, Catch::Contains("/kv_store/prefetch: expected"));
  document["kv_store"] = {{"spill_medium", "kv_sparse"}};
  CHECK_THAT(rejection(document), Catch::Contains("/kv_store/spill_medium: expected a KV medium"));
  document.erase("kv_store");
  document["peers"] = json::array({{{"id", "node-b"}, {"address", "127.0.0.1:7071"}, {"accept_spill_bytes", 4096}}});
  const auto peers = parse_policy(document.dump(), "config/x.json");
  INFO((peers ? std::string() : peers.error().message));
  REQUIRE(peers);
  CHECK(peers.value().peers.at(0).accept_spill_bytes == 4096);
  document["peers"][0]["accept_spill_bytes"] = -5;
  CHECK_THAT(rejection(document), Catch::Contains("/peers/0/accept_spill_bytes: expected"));
}

TEST_CASE("the scheduler section: wrr with a 10 ms slice by default, every key in range, read", "[core][policy]") {
  auto document = minimal_policy();
  const auto defaults = parse_policy(document.dump(), "config/x.json");
  REQUIRE(defaults);
  const auto& scheduler = defaults.value().scheduler;
  CHECK(scheduler.mode == kvrelay::SchedulerMode::kWrr);
  CHECK(scheduler.time_slice == std::chrono::milliseconds(10));
  CHECK(scheduler.chunk_bytes == 256U * 1024U);
  CHECK(scheduler.window_chunks == 4);
  CHECK(scheduler.preempt_max_done == 0.4);
  CHECK(scheduler.link_bytes_per_s == 0.0);
  document["scheduler"] = {{"mode", "fifo"},
                           {"time_slice_ms", 5},
                           {"chunk_bytes", 65536},
                           {"window_chunks", 8},
                           {"base", 2},
                           {"alpha", 0.5},
                           {"beta", 3},
                           {"preempt_factor", 4},
                           {"preempt_max_done", 0.25},
                           {"max_reserved_share", 0.7},
                           {"link_bytes_per_s", 1e8},
                           {"max_stall_ms", 250}};
  const auto set = parse_policy(document.dump(), "config/x.json");
  REQUIRE(set);
  const auto& read = set.value().scheduler;
  CHECK(read.mode == kvrelay::SchedulerMode::kFifo);
  CHECK(read.time_slice == std::chrono::milliseconds(5));
  CHECK(read.chunk_bytes == 65536);
  CHECK(read.window_chunks == 8);
  CHECK(read.base == 2.0);
  CHECK(read.alpha == 0.5);
  CHECK(read.beta == 3.0);
  CHECK(read.preempt_factor == 4.0);
  CHECK(read.preempt_max_done == 0.25);
  CHECK(read.max_reserved_share == 0.7);
  CHECK(read.link_bytes_per_s == 1e8);
  CHECK(read.max_stall == std::chrono::milliseconds(250));
  document["scheduler"] = {{"mode", "lottery"}, {"time_slice_ms", 25}, {"window_chunks", 1}, {"quantum", 3}};
  const auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains(R"(/scheduler/mode: expected "wrr", "fifo" or "off", got "lottery")"));
  CHECK_THAT(message, Catch::Contains("/scheduler/time_slice_ms"));
  CHECK_THAT(message, Catch::Contains("/scheduler/window_chunks"));
  CHECK_THAT(message, Catch::Contains("/scheduler/quantum"));
}

TEST_CASE("critical routes reserve shares within scheduler.max_reserved_share, errors naming the route",
          "[core][policy]") {
  auto document = minimal_policy();
  document["routes"][0]["critical"] = true;
  document["routes"][0]["reserved_share"] = 0.3;
  document["routes"][1]["critical"] = true;
  document["routes"][1]["reserved_share"] = 0.2;
  const auto parsed = parse_policy(document.dump(), "config/x.json");
  REQUIRE(parsed);
  CHECK(parsed.value().routes[0].critical);
  CHECK(parsed.value().routes[0].reserved_share == 0.3);
  CHECK_FALSE(parsed.value().routes[2].critical);
  // Together past the cap (0.5 by default): the route whose share crosses it is named.
  document["routes"][2]["critical"] = true;
  document["routes"][2]["reserved_share"] = 0.1;
  CHECK_THAT(rejection(document), Catch::Contains("/routes/2/reserved_share: critical routes reserve 0.6 of a link"));
  document["scheduler"] = {{"max_reserved_share", 0.6}};
  CHECK(parse_policy(document.dump(), "config/x.json"));
  // A share without critical, and critical without a share.
  auto lone = minimal_policy();
  lone["routes"][1]["reserved_share"] = 0.2;
  CHECK_THAT(rejection(lone), Catch::Contains("/routes/1/reserved_share: only a critical route"));
  lone["routes"][1].erase("reserved_share");
  lone["routes"][1]["critical"] = true;
  CHECK_THAT(rejection(lone), Catch::Contains("/routes/1/reserved_share: a critical route needs a reserved_share"));
  lone["routes"][1]["reserved_share"] = 0.95;
  CHECK_THAT(rejection(lone), Catch::Contains("/routes/1/reserved_share"));
}

TEST_CASE("peers use tcp and ucx is off unless the policy asks for it", "[core][policy][ucx]") {
  const auto parsed = parse_policy(minimal_policy().dump(), "config/x.json");
  REQUIRE(parsed);
  const auto& policy = parsed.value();
  CHECK(policy.peers.at(0).transport == kvrelay::PeerTransport::kTcp);
  CHECK_FALSE(policy.ucx.enabled);
  CHECK(policy.ucx.tls == "posix,tcp");
  CHECK(policy.ucx.net_devices == "lo");
  CHECK(policy.ucx.rndv_thresh_bytes == 0);
  CHECK_FALSE(policy.ucx.trusted_network);
  CHECK(kvrelay::peer_transport_name(kvrelay::PeerTransport::kTcp) == "tcp");
  CHECK(kvrelay::peer_transport_name(kvrelay::PeerTransport::kUcx) == "ucx");
}

TEST_CASE("a loopback peer with transport ucx turns ucx on", "[core][policy][ucx]") {
  auto document = minimal_policy();
  document["peers"][0]["transport"] = "ucx";
  const auto parsed = parse_policy(document.dump(), "config/x.json");
  REQUIRE(parsed);
  CHECK(parsed.value().peers.at(0).transport == kvrelay::PeerTransport::kUcx);
  CHECK(parsed.value().ucx.enabled);
  CHECK(parsed.value().ucx.tls == "posix,tcp");
  // An explicit tcp is the default spelled out.
  document["peers"][0]["transport"] = "tcp";
  const auto tcp = parse_policy(document.dump(), "config/x.json");
  REQUIRE(tcp);
  CHECK(tcp.value().peers.at(0).transport == kvrelay::PeerTransport::kTcp);
  CHECK_FALSE(tcp.value().ucx.enabled);
}

TEST_CASE("the ucx section is read and turns ucx on by its presence", "[core][policy][ucx]") {
  auto document = minimal_policy();
  document["ucx"] = json::object();
  const auto empty = parse_policy(document.dump(), "config/x.json");
  REQUIRE(empty);
  CHECK(empty.value().ucx.enabled);
  CHECK(empty.value().ucx.tls == "posix,tcp");
  document["ucx"] = {{"tls", "rc_x,sm,self,cuda_copy"},
                     {"net_devices", "mlx5_0:1,mlx5_1:1"},
                     {"rndv_thresh_bytes", 1U << 30},
                     {"trusted_network", true}};
  const auto parsed = parse_policy(document.dump(), "config/x.json");
  REQUIRE(parsed);
  const auto& ucx = parsed.value().ucx;
  CHECK(ucx.enabled);
  CHECK(ucx.tls == "rc_x,sm,self,cuda_copy");
  CHECK(ucx.net_devices == "mlx5_0:1,mlx5_1:1");
  CHECK(ucx.rndv_thresh_bytes == (1U << 30));
  CHECK(ucx.trusted_network);
  CHECK(parsed.value().peers.at(0).transport == kvrelay::PeerTransport::kTcp);
  document["ucx"] = {{"net_devices", "all"}, {"rndv_thresh_bytes", 8192}};
  const auto all = parse_policy(document.dump(), "config/x.json");
  REQUIRE(all);
  CHECK(all.value().ucx.net_devices == "all");
  CHECK(all.value().ucx.rndv_thresh_bytes == 8192);
}

TEST_CASE("a peer transport other than tcp or ucx is an error naming /peers/0/transport", "[core][policy][ucx]") {
  auto document = minimal_policy();
  document["peers"][0]["transport"] = "rdma";
  CHECK(rejection(document) == R"(config/x.json: /peers/0/transport: expected "tcp" or "ucx", got "rdma")");
  document["peers"][0]["transport"] = 1;
  CHECK_THAT(rejection(document), Catch::Contains(R"(/peers/0/transport: expected "tcp" or "ucx", got 1)"));
}

TEST_CASE("a ucx peer off loopback needs ucx.trusted_network", "[core][policy][ucx]") {
  auto document = minimal_policy();
  document["peers"][0]["address"] = "10.0.0.2:7071";
  document["peers"][0]["transport"] = "ucx";
  // The TCP peer plane is authenticated: only UCX's plaintext is left to refuse.
  document["peer_tls"] = {{"certificate", "a.pem"}, {"private_key", "a.key"}, {"ca_bundle", "ca.pem"}};
  const auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains("config/x.json: /peers/0/transport: UCX carries KV in plaintext: peer at "
                                      "10.0.0.2:7071, off loopback, needs a loopback address or /ucx/trusted_network"));
  CHECK_THAT(message, !Catch::Contains("/peers/0/address"));
  document["ucx"] = {{"trusted_network", true}};
  const auto trusted = parse_policy(document.dump(), "config/x.json");
  if (!trusted) FAIL(trusted.error().message);
  CHECK(trusted.value().ucx.enabled);
  // peer_tls's own rule stands: a plaintext TCP peer plane off loopback still needs its own trust.
  document.erase("peer_tls");
  CHECK_THAT(rejection(document), Catch::Contains("/peers/0/address: plaintext peer at 10.0.0.2:7071"));
  // Without either trust both are reported at once.
  document.erase("ucx");
  const auto both = rejection(document);
  CHECK_THAT(both, Catch::Contains("/peers/0/address: plaintext peer"));
  CHECK_THAT(both, Catch::Contains("/peers/0/transport: UCX carries KV in plaintext"));
}

TEST_CASE("a node offering ucx on a peer listener off loopback needs ucx.trusted_network", "[core][policy][ucx]") {
  auto document = minimal_policy();
  document["listen"]["peer"] = "0.0.0.0:7070";
  document["peer_tls"] = {{"trusted_network", true}};
  REQUIRE(parse_policy(document.dump(), "config/x.json"));  // tcp only: peer_tls's rule alone
  document["ucx"] = json::object();
  CHECK_THAT(rejection(document),
             Catch::Contains("config/x.json: /listen/peer: UCX is offered to peers only on loopback unless "
                             "/ucx/trusted_network"));
  document["ucx"]["trusted_network"] = true;
  CHECK(parse_policy(document.dump(), "config/x.json"));
  // On loopback the listener may offer it without trust.
  document["listen"]["peer"] = "127.0.0.1:7070";
  document["ucx"].erase("trusted_network");
  CHECK(parse_policy(document.dump(), "config/x.json"));
}

TEST_CASE("bad ucx values are rejected with their pointers", "[core][policy][ucx]") {
  auto document = minimal_policy();
  document["ucx"] = {{"tls", "posix,TCP"}, {"rndv_thresh_bytes", (1ULL << 30) + 1}};
  auto message = rejection(document);
  CHECK_THAT(message, Catch::Contains(R"(config/x.json: /ucx/tls: expected comma-separated UCX transport names)"));
  CHECK_THAT(message, Catch::Contains(R"(got "posix,TCP")"));
  CHECK_THAT(message, Catch::Contains("/ucx/rndv_thresh_bytes: expected integer 0..1073741824, got 1073741825"));
  for (const char* bad : {"", "posix,", ",tcp", "posix,,tcp", "^rc", "tcp posix"}) {
    INFO(bad);
    document["ucx"] = {{"tls", bad}};
    CHECK_THAT(rejection(document), Catch::Contains("/ucx/tls: expected"));
  }
  for (const char* bad : {"", "mlx5_0:1,", "eth0;rm", "eth 0"}) {
    INFO(bad);
    document["ucx"] = {{"net_devices", bad}};
    CHECK_THAT(rejection(document), Catch::Contains("/ucx/net_devices: expected"));
  }
  document["ucx"] = {{"rndv_thresh_bytes", -1}, {"trusted_network", "yes"}, {"zero_copy", true}};
  message = rejection(document);
  CHECK_THAT(message, Catch::Contains("/ucx/rndv_thresh_bytes: expected integer"));
  CHECK_THAT(message, Catch::Contains("/ucx/trusted_network: expected"));
  CHECK_THAT(message, Catch::Contains("/ucx/zero_copy"));
  document["ucx"] = "on";
  CHECK_THAT(rejection(document), Catch::Contains("/ucx: expected"));
}
