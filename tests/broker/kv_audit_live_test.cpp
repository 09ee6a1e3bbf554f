// Issue #28, a planted effect end to end: B's sidecar audits a cross-node route live (T0 tokens
// against T3 all of A's KV) with audit.calibrate "live". Partway through, the link to A slows
// down tenfold (a relay in front of A's peer port paces what A sends). The engine's choice for
// the route moves from kv_raw to tokens within a bounded number of audited requests, the online
// audit sees the effect of T3 turn from a gain into a loss, and live calibration refits kv_raw's
// correction from those audited outcomes, a bounded step. (The engine's own link and handoff
// estimates see the slower link too, so which moves the choice first varies;
// live_calibration_test.cpp shows a correction alone moving it.) Real processes: two sidecars and two reference workers
// on a synthetic model heavy enough that KV pays on a fast link.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "support/kv_path_fixture.h"
#include "support/stalling_relay.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

// 8 KiB of KV a token: a 700-token context is 5.7 MB, ~0.1 s of prefill on one core.
constexpr const char* kShape = "layers=4,dim=256,heads=4,kv_heads=4,ffn=512,vocab=512,seq_len=1024";
constexpr int kContextTokens = 700;
constexpr double kThrottledBytesPerS = 8e6;  // ~0.7 s for that KV: over 5x the prefill
constexpr int kWindow = 8;                   // audited outcomes per refit
constexpr int kMaxAuditedToMove = 40;        // the bound the choice must move within (a count)

json model_json_of(const RefworkerUnderTest& worker) {
  const auto models = json::parse(http_request(worker.port(), "GET", "/v1/models").body);
  const auto& fingerprint = models["data"][0]["kvrelay"];
  return {{"architecture", fingerprint["architecture"]},
          {"layers", fingerprint["layers"]},
          {"kv_heads", fingerprint["kv_heads"]},
          {"head_dim", fingerprint["head_dim"]},
          {"dtype", fingerprint["dtype"]},
          {"weights", fingerprint["weights_identity"]}};
}

json audited_route() {
  return {{"id", "writer-to-reader"},
          {"from", "writer"},
          {"to", "reader"},
          {"allowed_media", {"tokens", "kv_raw"}},
          {"audit",
           {{"fraction", 0.5},
            {"treatments", json::array({{{"name", "T0"}, {"medium", "tokens"}, {"span", "none"}},
                                        {{"name", "T3"}, {"medium", "kv_raw"}, {"span", "all"}}})},
            {"calibrate", "live"},
            {"calibrate_window", kWindow},
            {"calibrate_max_step_s", 0.2}}}};
}

json context(int seed) {
  json prompt = json::array({1});
  for (int index = 1; index < kContextTokens; ++index)
    prompt.push_back(3 + (index * 31 + seed * 97) % 500);
  return prompt;
}

struct Lookup {
  bool audited = false;
  std::string treatment;
  std::string engine_choice;  // what the engine chose, or would have, for this lookup
};

// The newest lookup of the reader (audited or not) and what the engine chose for it.
Lookup last_lookup(const Sidecar& node) {
  for (const auto& decision : node.decisions(20)) {
    if (decision.value("kind", "") != "lookup" || decision.value("agent", "") != "reader") continue;
    Lookup lookup;
    lookup.audited = decision.contains("treatment");
    if (lookup.audited) lookup.treatment = decision["treatment"]["name"];
    lookup.engine_choice = decision["cost"].value("chosen", std::string());
    return lookup;
  }
  FAIL("no lookup of the reader in the decision log");
  return {};
}

// The live calibration's refits on this sidecar, oldest first.
json live_refits(const Sidecar& node) {
  const auto reply = admin_request(node.admin_port(), "GET", "/admin/audit/calibration");
  REQUIRE(reply.status == 200);
  return json::parse(reply.body)["live"]["refits"];
}

double mean(const std::vector<double>& values) {
  double sum = 0.0;
  for (const double value : values)
    sum += value;
  return values.empty() ? 0.0 : sum / static_cast<double>(values.size());
}

}  // namespace

TEST_CASE("audit live: a link throttled partway moves the choice and live calibration refits kv_raw",
          "[proxy][audit][calibration][process][audit_live]") {
  Sidecar node_a{"node-a"};
  Sidecar node_b{"node-b"};
  RefworkerUnderTest writer({"--synthetic", kShape, "--seed", "11"}, {"--kvrelay-socket", node_a.socket_path()});
  RefworkerUnderTest reader({"--synthetic", kShape, "--seed", "11"}, {"--kvrelay-socket", node_b.socket_path()});
  const json model = model_json_of(writer);
  REQUIRE(model == model_json_of(reader));
  node_a.start(sidecar_policy(
      node_a, json::array({agent_json("writer", "", writer.port(), model), agent_json("reader", "node-b", 1, model)}),
      json::array({audited_route()}), json::array({{{"id", "node-b"}, {"address", "127.0.0.1:1"}}})));
  StallingRelay relay(node_a.peer_port());
  node_b.start(sidecar_policy(
      node_b, json::array({agent_json("writer", "node-a", 1, model), agent_json("reader", "", reader.port(), model)}),
      json::array({audited_route()}),
      json::array({{{"id", "node-a"}, {"address", "127.0.0.1:" + std::to_string(relay.port())}}})));

  std::map<std::string, std::vector<double>> before_ms;  // treatment -> B's time to first byte
  std::map<std::string, std::vector<double>> after_ms;
  int seed = 0;
  const auto handoff = [&](std::map<std::string, std::vector<double>>& ttft) {
    const auto a_prompt = context(++seed);
    const auto a = node_a.complete("writer", greedy(a_prompt, 4, true));
    const auto started = std::chrono::steady_clock::now();
    (void)node_b.complete("reader", greedy(handoff_prompt(a_prompt, a), 1, true));
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count();
    const auto lookup = last_lookup(node_b);
    if (lookup.audited) ttft[lookup.treatment].push_back(ms);
    return lookup;
  };

  // Fast link: KV pays, and the engine chooses it.
  Lookup lookup;
  for (int i = 0; i < 24; ++i)
    lookup = handoff(before_ms);
  CHECK(lookup.engine_choice == "kv_raw");
  REQUIRE(before_ms["T0"].size() >= 2);
  REQUIRE(before_ms["T3"].size() >= 2);
  CHECK(mean(before_ms["T3"]) < mean(before_ms["T0"]));  // the audit sees KV's gain

  // The link slows tenfold. Count audited requests until the engine's choice moves to tokens.
  const std::size_t refits_before = live_refits(node_b).size();
  relay.pace(StallingRelay::Direction::kToClient, kThrottledBytesPerS);
  int audited_after = 0;
  int moved_at = -1;
  for (int i = 0; i < 4 * kMaxAuditedToMove && audited_after < kMaxAuditedToMove; ++i) {
    lookup = handoff(after_ms);
    if (lookup.audited) ++audited_after;
    if (lookup.engine_choice == "tokens") {
      moved_at = audited_after;
      break;
    }
  }
  INFO("audited requests after the throttle until the choice moved: " << moved_at);
  REQUIRE(moved_at >= 0);
  CHECK(moved_at <= kMaxAuditedToMove);

  // More handoffs until the audit holds both arms under the throttle and live calibration has
  // refitted kv_raw from them (outcomes are filed as each relay finishes, so poll).
  const auto refitted_kv_raw = [&](const json& refits) -> std::optional<json> {
    for (std::size_t index = refits_before; index < refits.size(); ++index) {
      for (const auto& medium : refits[index]["media"])
        if (medium["medium"] == "kv_raw") return medium;
    }
    return std::nullopt;
  };
  std::optional<json> refit;
  for (int i = 0; i < 64; ++i) {
    refit = refitted_kv_raw(live_refits(node_b));
    if (refit && after_ms["T3"].size() >= 3 && after_ms["T0"].size() >= 3) break;
    (void)handoff(after_ms);
  }
  INFO("audited after the throttle: T0 " << after_ms["T0"].size() << ", T3 " << after_ms["T3"].size());
  // The audit detected the changed effect: T3 now costs B more than T0.
  REQUIRE(after_ms["T3"].size() >= 3);
  REQUIRE(after_ms["T0"].size() >= 3);
  CHECK(mean(after_ms["T3"]) > mean(after_ms["T0"]));
  // Live calibration refitted the route's kv_raw correction from the throttled trials, a bounded
  // step; its direction depends on how far the engine's own link estimates had caught up
  // (live_calibration_test.cpp shows a correction moving the choice on its own).
  REQUIRE(refit);
  INFO("kv_raw refit after the throttle: " << refit->dump());
  CHECK(std::abs(refit->at("after_s").get<double>() - refit->at("before_s").get<double>()) <= 0.2 + 1e-9);
  CHECK(refit->at("samples").get<int>() >= 2);
  // Each refit is in the decision log too.
  bool logged = false;
  for (const auto& decision : node_b.decisions(200))
    logged = logged || (decision.value("kind", "") == "calibration" && decision["route"] == "writer-to-reader");
  CHECK(logged);
}
