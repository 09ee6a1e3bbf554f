// Reload tells the truth, with a real sidecar and reference workers: a live field (cost_model)
// changes the engine's cost breakdown while what the engine learned is kept, a field read at
// start is named in the reply and keeps its running value, and live route changes survive a
// reload that leaves their route as it was (or the reply says they were replaced). POST
// /admin/reload and SIGHUP share that logic.
#include <signal.h>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>

#include "refworker/skip.h"
#include "support/kv_path_fixture.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr int kAnswerTokens = 16;

// POST /admin/reload with `policy` written first; the reply body.
json reload_reply(Sidecar& sidecar, const json& policy) {
  sidecar.write_policy(policy);
  const auto reply = admin_request(sidecar.admin_port(), "POST", "/admin/reload");
  INFO(reply.body);
  REQUIRE(reply.status == 200);
  return json::parse(reply.body);
}

// GET an admin path, parsed.
json admin_get(const Sidecar& sidecar, const std::string& path) {
  const auto reply = http_request(sidecar.admin_port(), "GET", path);
  INFO(reply.error << reply.body);
  REQUIRE(reply.status == 200);
  return json::parse(reply.body);
}

// PUT /admin/routes/<route> with `changes`.
void change_route(const Sidecar& sidecar, const std::string& route, const json& changes) {
  const auto reply = admin_request(sidecar.admin_port(), "PUT", "/admin/routes/" + route, changes.dump());
  INFO(reply.body);
  REQUIRE(reply.status == 200);
}

json route_named(const Sidecar& sidecar, const std::string& id) {
  const json listing = admin_get(sidecar, "/admin/routes");
  for (const auto& route : listing["routes"])
    if (route["id"] == id) return route;
  FAIL("no route " << id);
  return {};
}

bool contains(const json& list, const std::string& item) {
  return std::find(list.begin(), list.end(), json(item)) != list.end();
}

json candidate(const json& decision, const std::string& medium) {
  REQUIRE(decision.contains("cost"));
  for (const auto& entry : decision["cost"]["candidates"])
    if (entry["medium"] == medium) return entry;
  FAIL("no candidate " << medium << " in " << decision["cost"].dump());
  return {};
}

// Writer and reader workers behind one sidecar.
struct SameNode {
  explicit SameNode(const std::filesystem::path& model)
      : writer({"--model", model.string()}, {"--kvrelay-socket", node.socket_path()}),
        reader({"--model", model.string()}, {"--kvrelay-socket", node.socket_path()}) {}
  [[nodiscard]] json agents() const {
    return json::array({agent_json("writer", "", writer.port(), stories_model_json()),
                        agent_json("reader", "", reader.port(), stories_model_json())});
  }
  // A answers, then B gets A's context; returns B's lookup record once B's prefill report (which
  // feeds the engine's measured handoff) has reached the sidecar.
  json handoff(int seed) {
    const auto a_prompt = context_prompt(seed);
    const auto a = node.complete("writer", greedy(a_prompt, 20, true));
    const auto b = node.complete("reader", greedy(handoff_prompt(a_prompt, a), kAnswerTokens));
    CHECK(b["kvrelay"]["cached_tokens"] == 208);
    const auto decision = node.decisions(1).at(0);
    ++handoffs;
    REQUIRE(wait_until(
        [&] { return node.metric_sum("kvrelay_kv_prefill_reports_total", {"agent=\"reader\""}) >= handoffs; },
        std::chrono::seconds(10)));
    return decision;
  }
  Sidecar node{"node-1"};
  RefworkerUnderTest writer;
  RefworkerUnderTest reader;
  int handoffs = 0;
};

const json kRoutes = json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}}});

}  // namespace

TEST_CASE(
    "a cost_model reload changes the engine's prices live and keeps what it learned, a topology change "
    "rebuilds it and says so",
    "[proxy][reload][e2e][process]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  SameNode pair(*model);
  const json policy = sidecar_policy(pair.node, pair.agents(), kRoutes);
  pair.node.start(policy);
  pair.node.force_medium("writer-to-reader", "kv_int8");

  (void)pair.handoff(1);
  const json learned = pair.handoff(2);
  // Learned: a measured kv_int8 handoff on this route replaced the codec's priced time.
  CHECK(candidate(learned, "kv_int8")["c_codec_s"] == 0.0);
  const double loss_before = candidate(learned, "kv_int8")["c_loss_s"].get<double>();
  REQUIRE(loss_before > 0.0);

  json calibrated = policy;
  calibrated["cost_model"] = {{"media", {{"kv_int8", {{"extra_decode_fraction", 0.5}}}}}};
  json reply = reload_reply(pair.node, calibrated);
  INFO(reply.dump());
  CHECK(reply["applied"] == true);
  CHECK(reply["engine"] == "kept");
  CHECK(contains(reply["live"], "/cost_model/media/kv_int8"));
  CHECK(reply["restart_required"].empty());
  CHECK(contains(reply["live_route_overrides"]["kept"], "writer-to-reader"));

  const json after = pair.handoff(3);
  CHECK(after["medium"] == "kv_int8");
  CHECK(after["source"] == "forced");  // the live override outlasted the reload
  // 0.01 -> 0.5 extra decode per output token, same answer budget and decode time: 50x.
  CHECK(candidate(after, "kv_int8")["c_loss_s"].get<double>() == Approx(50.0 * loss_before));
  CHECK(candidate(after, "kv_int8")["c_codec_s"] == 0.0);  // still the measured handoff

  // A new route changes the engine's topology: rebuilt, and the reply says what that cost.
  json more_routes = calibrated;
  more_routes["routes"].push_back({{"id", "reader-to-writer"}, {"from", "reader"}, {"to", "writer"}});
  json rebuilt = reload_reply(pair.node, more_routes);
  INFO(rebuilt.dump());
  CHECK(rebuilt["engine"] == "rebuilt");
  CHECK_THAT(rebuilt["engine_note"].get<std::string>(), Catch::Contains("reset"));
  CHECK(contains(rebuilt["live"], "/routes/1"));
  const json fresh = pair.handoff(4);
  CHECK(fresh["source"] == "forced");
  CHECK(candidate(fresh, "kv_int8")["c_codec_s"].get<double>() > 0.0);  // no measured handoff any more
  CHECK(candidate(fresh, "kv_int8")["c_loss_s"].get<double>() == Approx(50.0 * loss_before));
}

TEST_CASE("a reload names the fields that need a restart, and they keep their running values",
          "[proxy][reload][process]") {
  Sidecar node("node-1");
  const json agents = json::array(
      {agent_json("writer", "", 1, stories_model_json()), agent_json("reader", "", 1, stories_model_json())});
  const json policy = sidecar_policy(node, agents, kRoutes);
  node.start(policy);

  json changed = policy;
  changed["node"]["id"] = "node-renamed";
  changed["listen"]["http"] = "127.0.0.1:1";
  changed["logging"]["level"] = "debug";
  changed["limits"]["kv_store_bytes"] = 1 << 20;
  changed["codecs"] = {{"device", "auto"}};
  changed["limits"]["kv_lookup_timeout_ms"] = 3000;  // live
  json reply = reload_reply(node, changed);
  INFO(reply.dump());
  CHECK(reply["applied"] == true);
  for (const char* pointer :
       {"/node/id", "/listen/http", "/logging/level", "/limits/kv_store_bytes", "/codecs/device"}) {
    INFO(pointer);
    CHECK(contains(reply["restart_required"], pointer));
    CHECK_FALSE(contains(reply["live"], pointer));
  }
  CHECK(contains(reply["live"], "/limits/kv_lookup_timeout_ms"));
  CHECK(reply["live"].size() == 1);
  CHECK(reply["engine"] == "kept");
  CHECK_THAT(reply["status"].get<std::string>(), Catch::Contains("restart needed for /node/id"));
  // The running values: the node still announces its old id, on its old port.
  CHECK(admin_get(node, "/version")["node"] == "node-1");
  CHECK(http_request(node.http_port(), "GET", "/healthz").status == 200);

  // The same file again changes nothing more: still named, as they still differ from what runs.
  json again = reload_reply(node, changed);
  CHECK(contains(again["restart_required"], "/node/id"));
  CHECK(again["live"].empty());
}

TEST_CASE("live route changes survive a reload of an unchanged route, the reply names those the file replaced",
          "[proxy][reload][process]") {
  Sidecar node("node-1");
  const json agents = json::array(
      {agent_json("writer", "", 1, stories_model_json()), agent_json("reader", "", 1, stories_model_json())});
  json routes = kRoutes;
  routes.push_back({{"id", "reader-to-writer"}, {"from", "reader"}, {"to", "writer"}});
  const json policy = sidecar_policy(node, agents, routes);
  node.start(policy);
  node.force_medium("writer-to-reader", "kv_int8");
  change_route(node, "reader-to-writer", {{"enabled", false}});

  json edited = policy;
  edited["routes"][1]["hysteresis"] = 0.4;  // the file changes the second route only
  json reply = reload_reply(node, edited);
  INFO(reply.dump());
  CHECK(reply["live_route_overrides"]["kept"] == json::array({"writer-to-reader"}));
  CHECK(reply["live_route_overrides"]["replaced"] == json::array({"reader-to-writer"}));
  CHECK(contains(reply["live"], "/routes/1/hysteresis"));
  CHECK_THAT(reply["status"].get<std::string>(), Catch::Contains("reader-to-writer"));
  CHECK(route_named(node, "writer-to-reader")["forced_medium"] == "kv_int8");
  const json replaced = route_named(node, "reader-to-writer");
  CHECK(replaced["enabled"] == true);  // the file's value
  CHECK(replaced["hysteresis"] == 0.4);

  // SIGHUP takes the same path: the kept override outlasts it, a changed route is the file's.
  edited["routes"][0]["quality_floor"] = 0.5;
  node.write_policy(edited);
  change_route(node, "reader-to-writer", {{"forced_medium", "kv_raw"}});
  node.process().send_signal(SIGHUP);
  const bool reloaded = wait_until(
      [&] {
        const auto listing = http_request(node.admin_port(), "GET", "/admin/routes");
        return listing.status == 200 && listing.body.find("\"quality_floor\":0.5") != std::string::npos;
      },
      std::chrono::seconds(10));
  INFO(node.process().stderr_text());
  REQUIRE(reloaded);
  CHECK(route_named(node, "writer-to-reader")["forced_medium"].is_null());    // its route changed in the file
  CHECK(route_named(node, "reader-to-writer")["forced_medium"] == "kv_raw");  // unchanged route: kept
}
