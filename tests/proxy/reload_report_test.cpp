// Every policy field a reload can change, through a real RuntimePolicy reading a real file:
// named live or restart-required by its JSON pointer, restart-only values kept as running.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <functional>

#include "kvrelay/proxy/runtime_policy.h"

#include "support/test_paths.h"

using namespace kvrelay;
using nlohmann::json;

namespace {

json base_policy() {
  return json::parse(R"({
    "schema_version": 1,
    "node": {"id": "node-a"},
    "listen": {"http": "127.0.0.1:0"},
    "peers": [{"id": "node-b", "address": "127.0.0.1:7071"}],
    "agents": [
      {"id": "a", "upstream": "http://127.0.0.1:9000",
       "model": {"architecture": "llama", "layers": 2, "kv_heads": 2, "head_dim": 8, "dtype": "fp16", "weights": "w"}},
      {"id": "b", "upstream": "http://127.0.0.1:9001", "node": "node-b",
       "model": {"architecture": "llama", "layers": 2, "kv_heads": 2, "head_dim": 8, "dtype": "fp16", "weights": "w"}}
    ],
    "routes": [{"id": "a-to-b", "from": "a", "to": "b"}]
  })");
}

struct Reloader {
  explicit Reloader(const json& initial) {
    test::write_file(file(), initial.dump());
    auto parsed = load_policy_file(file().string());
    REQUIRE(parsed);
    policy = std::make_unique<proxy::RuntimePolicy>(
        file().string(), std::make_shared<const Policy>(std::move(parsed).value()), registry);
  }
  proxy::ReloadReport reload(const json& next) {
    test::write_file(file(), next.dump());
    auto report = policy->reload();
    INFO((report ? std::string() : report.error().message));
    REQUIRE(report);
    return std::move(report).value();
  }
  [[nodiscard]] std::filesystem::path file() const { return dir / "policy.json"; }

  test::TempDir dir;
  metrics::Registry registry;
  std::unique_ptr<proxy::RuntimePolicy> policy;
};

bool has(const std::vector<std::string>& list, const std::string& item) {
  return std::find(list.begin(), list.end(), item) != list.end();
}

struct FieldCase {
  const char* pointer;
  bool live;
  std::function<void(json&)> edit;
};

}  // namespace

TEST_CASE("each policy field a reload changes is named live or restart-required by its pointer", "[proxy][reload]") {
  const std::vector<FieldCase> cases = {
      {"/node/id", false, [](json& p) { p["node"]["id"] = "node-z"; }},
      {"/listen/http", false, [](json& p) { p["listen"]["http"] = "127.0.0.1:1"; }},
      {"/listen/admin", false, [](json& p) { p["listen"]["admin"] = "127.0.0.1:2"; }},
      {"/listen/peer", false, [](json& p) { p["listen"]["peer"] = "127.0.0.1:3"; }},
      {"/listen/unix_socket", false, [](json& p) { p["listen"]["unix_socket"] = "/tmp/x.sock"; }},
      {"/codecs/plugin_dirs", false, [](json& p) { p["codecs"]["plugin_dirs"] = {"/opt/plugins"}; }},
      {"/codecs/device", false, [](json& p) { p["codecs"]["device"] = "auto"; }},
      {"/logging/level", false, [](json& p) { p["logging"]["level"] = "debug"; }},
      {"/logging/format", false, [](json& p) { p["logging"]["format"] = "json"; }},
      {"/limits/max_body_bytes", false, [](json& p) { p["limits"]["max_body_bytes"] = 8192; }},
      {"/limits/read_timeout_ms", false, [](json& p) { p["limits"]["read_timeout_ms"] = 1234; }},
      {"/limits/kv_store_bytes", false, [](json& p) { p["limits"]["kv_store_bytes"] = 1 << 20; }},
      {"/limits/shm_arena_bytes", false, [](json& p) { p["limits"]["shm_arena_bytes"] = 1 << 20; }},
      {"/limits/peer_staging", false, [](json& p) { p["limits"]["peer_staging"] = false; }},
      {"/kv_store/eviction", false, [](json& p) { p["kv_store"]["eviction"] = "lru"; }},
      {"/kv_store/recency_tau_s", true, [](json& p) { p["kv_store"]["recency_tau_s"] = 5; }},
      {"/kv_store/spill_min_utility", true, [](json& p) { p["kv_store"]["spill_min_utility"] = 4; }},
      {"/kv_store/spill_medium", true, [](json& p) { p["kv_store"]["spill_medium"] = "kv_int8"; }},
      {"/kv_store/spill_inflight_bytes", true, [](json& p) { p["kv_store"]["spill_inflight_bytes"] = 4096; }},
      {"/kv_store/prefetch", true, [](json& p) { p["kv_store"]["prefetch"] = false; }},
      {"/kv_store/prefetch_max_bytes", true, [](json& p) { p["kv_store"]["prefetch_max_bytes"] = 4096; }},
      {"/limits/upstream_timeout_ms", true, [](json& p) { p["limits"]["upstream_timeout_ms"] = 1000; }},
      {"/limits/kv_lookup_timeout_ms", true, [](json& p) { p["limits"]["kv_lookup_timeout_ms"] = 100; }},
      {"/limits/probe_interval_ms", true, [](json& p) { p["limits"]["probe_interval_ms"] = 100; }},
      {"/limits/peer_bandwidth_probe_interval_ms", true,
       [](json& p) { p["limits"]["peer_bandwidth_probe_interval_ms"] = 0; }},
      {"/agents/0/upstream", true, [](json& p) { p["agents"][0]["upstream"] = "http://127.0.0.1:9100"; }},
      {"/agents/1/accepts_sparse_kv", true, [](json& p) { p["agents"][1]["accepts_sparse_kv"] = true; }},
      {"/agents/1/model", true, [](json& p) { p["agents"][1]["model"]["weights"] = "v"; }},
      {"/routes/0/hysteresis", true, [](json& p) { p["routes"][0]["hysteresis"] = 0.3; }},
      {"/routes/0/quality_floor", true, [](json& p) { p["routes"][0]["quality_floor"] = 0.9; }},
      {"/routes/0/deadline_ms", true, [](json& p) { p["routes"][0]["deadline_ms"] = 50; }},
      {"/routes/0/allowed_media", true,
       [](json& p) {
         p["routes"][0]["allowed_media"] = {"tokens", "kv_raw"};
       }},
      {"/routes/0/push", true, [](json& p) { p["routes"][0]["push"] = true; }},
      {"/routes/0/audit_fraction", true, [](json& p) { p["routes"][0]["audit_fraction"] = 0.5; }},
      {"/routes/1", true,
       [](json& p) {
         p["routes"].push_back({{"id", "b-to-a"}, {"from", "b"}, {"to", "a"}});
       }},
      {"/peers/0/address", true, [](json& p) { p["peers"][0]["address"] = "127.0.0.1:7099"; }},
      {"/peers/0/accept_spill_bytes", true, [](json& p) { p["peers"][0]["accept_spill_bytes"] = 4096; }},
      {"/cost_model/media/kv_int8", true,
       [](json& p) {
         p["cost_model"] = {{"media", {{"kv_int8", {{"fidelity", 0.9}}}}}};
       }},
      {"/cost_model/agents/b", true,
       [](json& p) {
         p["cost_model"] = {{"agents", {{"b", {{"decode_s_per_token", 0.05}}}}}};
       }},
  };
  for (const auto& field : cases) {
    INFO(field.pointer);
    Reloader reloader(base_policy());
    json next = base_policy();
    field.edit(next);
    const auto report = reloader.reload(next);
    CHECK(has(field.live ? report.live : report.restart_required, field.pointer));
    CHECK(report.live.size() + report.restart_required.size() == 1);
  }
}

TEST_CASE("a restart-only field keeps its running value in the served snapshot, a live one takes effect",
          "[proxy][reload]") {
  Reloader reloader(base_policy());
  json next = base_policy();
  next["node"]["id"] = "node-z";
  next["limits"]["kv_store_bytes"] = 1 << 20;
  next["limits"]["kv_lookup_timeout_ms"] = 100;
  const auto report = reloader.reload(next);
  CHECK(report.to_json()["applied"] == true);
  const auto serving = reloader.policy->current();
  CHECK(serving->node_id == "node-a");
  CHECK(serving->limits.kv_store_bytes == LimitsPolicy{}.kv_store_bytes);
  CHECK(serving->limits.kv_lookup_timeout == std::chrono::milliseconds(100));
  // The engine's topology moved only when agents, routes, peers or plugin media did.
  CHECK_FALSE(report.engine.rebuilt);
  next["agents"][1].erase("node");  // b moves to this node: another link
  CHECK(reloader.reload(next).engine.rebuilt);
}

TEST_CASE("live route changes are applied again over an unchanged route and dropped for a changed one",
          "[proxy][reload]") {
  json initial = base_policy();
  initial["routes"].push_back({{"id", "b-to-a"}, {"from", "b"}, {"to", "a"}});
  Reloader reloader(initial);
  REQUIRE(reloader.policy->update_route("a-to-b", {{"forced_medium", "kv_int8"}, {"audit_fraction", 0.25}}));
  REQUIRE(reloader.policy->update_route("b-to-a", {{"enabled", false}}));
  json next = initial;
  next["routes"][1]["priority"] = 3;
  const auto report = reloader.reload(next);
  CHECK(report.overrides_kept == std::vector<std::string>{"a-to-b"});
  CHECK(report.overrides_replaced == std::vector<std::string>{"b-to-a"});
  const auto serving = reloader.policy->current();
  CHECK(serving->find_route("a-to-b")->forced_medium == std::optional<std::string>("kv_int8"));
  CHECK(serving->find_route("a-to-b")->audit.fraction == 0.25);
  CHECK(serving->find_route("b-to-a")->enabled);
  CHECK(serving->find_route("b-to-a")->priority == 3);
  // Kept overrides stay kept on the next reload of the same file; a removed route's are replaced.
  CHECK(reloader.reload(next).overrides_kept == std::vector<std::string>{"a-to-b"});
  next["routes"].erase(0);
  CHECK(reloader.reload(next).overrides_replaced == std::vector<std::string>{"a-to-b"});
}

TEST_CASE("a reload names each ucx key restart-required and a peer transport live", "[proxy][reload]") {
  json with_ucx = base_policy();
  with_ucx["ucx"] = {{"tls", "posix,tcp"}};
  SECTION("each key by its pointer") {
    // The UCP context is made at start from the ucx section: each key waits for a restart.
    const std::vector<FieldCase> cases = {
        {"/ucx/tls", false, [](json& p) { p["ucx"]["tls"] = "rc,sm"; }},
        {"/ucx/net_devices", false, [](json& p) { p["ucx"]["net_devices"] = "mlx5_0:1"; }},
        {"/ucx/rndv_thresh_bytes", false, [](json& p) { p["ucx"]["rndv_thresh_bytes"] = 65536; }},
        {"/ucx/trusted_network", false, [](json& p) { p["ucx"]["trusted_network"] = true; }},
        {"/ucx", false, [](json& p) { p.erase("ucx"); }},
        // PeerLinks drops a client whose transport changed: new connections take the new one.
        {"/peers/0/transport", true, [](json& p) { p["peers"][0]["transport"] = "ucx"; }},
    };
    for (const auto& field : cases) {
      INFO(field.pointer);
      Reloader reloader(with_ucx);
      json next = with_ucx;
      field.edit(next);
      const auto report = reloader.reload(next);
      CHECK(has(field.live ? report.live : report.restart_required, field.pointer));
      CHECK(report.live.size() + report.restart_required.size() == 1);
    }
  }

  SECTION("a section added to a node without UCX is named by its pointer alone") {
    Reloader reloader(base_policy());
    json next = base_policy();
    next["ucx"] = {{"tls", "tcp"}, {"trusted_network", true}};
    const auto report = reloader.reload(next);
    CHECK(report.restart_required == std::vector<std::string>{"/ucx"});
    CHECK(report.live.empty());
    CHECK_FALSE(reloader.policy->current()->ucx.enabled);
  }

  SECTION("a peer moved to ucx on a node without UCX is live and names /ucx for the restart") {
    Reloader reloader(base_policy());
    json next = base_policy();
    next["peers"][0]["transport"] = "ucx";  // turns UCX on for the file, not for the running node
    const auto report = reloader.reload(next);
    CHECK(report.live == std::vector<std::string>{"/peers/0/transport"});
    CHECK(report.restart_required == std::vector<std::string>{"/ucx"});
    const auto serving = reloader.policy->current();
    CHECK(serving->peers[0].transport == PeerTransport::kUcx);
    CHECK_FALSE(serving->ucx.enabled);
  }

  SECTION("the served snapshot keeps the running ucx settings and takes the new transport") {
    Reloader reloader(with_ucx);
    json next = with_ucx;
    next["ucx"]["tls"] = "rc,sm";
    next["ucx"]["net_devices"] = "mlx5_0:1";
    next["peers"][0]["transport"] = "ucx";
    const auto report = reloader.reload(next);
    CHECK(report.live == std::vector<std::string>{"/peers/0/transport"});
    CHECK(has(report.restart_required, "/ucx/tls"));
    CHECK(has(report.restart_required, "/ucx/net_devices"));
    const auto serving = reloader.policy->current();
    CHECK(serving->ucx.enabled);
    CHECK(serving->ucx.tls == "posix,tcp");
    CHECK(serving->ucx.net_devices == "lo");
    CHECK(serving->peers[0].transport == PeerTransport::kUcx);
    // Still named while the file differs from what runs.
    CHECK(has(reloader.reload(next).restart_required, "/ucx/tls"));
  }
}
