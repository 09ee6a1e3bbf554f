#include "kvrelay/proxy/online_audit.h"

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kvrelay/broker/request_signature.h"
#include "kvrelay/broker/tenant_chain.h"
#include "kvrelay/proxy/front_proxy.h"

#include "support/child_process.h"
#include "support/test_paths.h"

using namespace kvrelay::proxy;
using nlohmann::json;

namespace {

kvrelay::RoutePolicy audited_route(double fraction, std::string trials_file) {
  kvrelay::RoutePolicy route;
  route.id = "a-to-b";
  route.from_agent = "a";
  route.to_agent = "b";
  route.audit.fraction = fraction;
  route.audit.treatments = kvrelay::default_audit_treatments();
  route.audit.trials_file = std::move(trials_file);
  return route;
}

}  // namespace

TEST_CASE("injected kv_transfer_params keep a client's treatment only where a route allows it", "[proxy][audit]") {
  constexpr const char* kClientBody =
      R"({"prompt":[1,2],"kv_transfer_params":{"other":1,"kvrelay":{"treatment":{"name":"T0"},"agent":"spoofed"}}})";
  const auto forced = inject_kv_transfer_params(kClientBody, json{{"agent", "b"}, {"request_id", "r1"}},
                                                KvParamsInjection{true, {}, {}});
  REQUIRE(forced);
  CHECK_FALSE(forced.value().client_treatment_dropped);
  const auto body = json::parse(forced.value().body);
  CHECK(body["kv_transfer_params"]["other"] == 1);
  CHECK(body["kv_transfer_params"]["kvrelay"]["treatment"]["name"] == "T0");
  CHECK(body["kv_transfer_params"]["kvrelay"]["agent"] == "b");  // everything else is the sidecar's
  const auto dropped = inject_kv_transfer_params(kClientBody, json{{"agent", "b"}});
  REQUIRE(dropped);
  CHECK(dropped.value().client_treatment_dropped);
  CHECK_FALSE(json::parse(dropped.value().body)["kv_transfer_params"]["kvrelay"].contains("treatment"));
  const auto plain = inject_kv_transfer_params(R"({"prompt":[1]})", json{{"agent", "b"}});
  REQUIRE(plain);
  CHECK_FALSE(plain.value().client_treatment_dropped);
  CHECK_FALSE(json::parse(plain.value().body)["kv_transfer_params"]["kvrelay"].contains("treatment"));
  CHECK_FALSE(json::parse(plain.value().body)["kv_transfer_params"]["kvrelay"].contains("max_tokens"));
  CHECK_FALSE(json::parse(plain.value().body)["kv_transfer_params"]["kvrelay"].contains("signature"));
  CHECK_FALSE(json::parse(plain.value().body)["kv_transfer_params"]["kvrelay"].contains("chain_root"));
}

TEST_CASE("injected kv_transfer_params carry the tenant's chain root and are signed", "[proxy][security]") {
  const KvParamsInjection injection{false, "tenant-salt-0123456789", "node-key-0123456789"};
  const auto salted = inject_kv_transfer_params(R"({"prompt":[1],"cache_salt":"s1"})", json{{"agent", "b"}}, injection);
  REQUIRE(salted);
  const auto kvrelay = json::parse(salted.value().body)["kv_transfer_params"]["kvrelay"];
  CHECK(kvrelay["chain_root"] ==
        kvrelay::block_hash_hex(kvrelay::broker::derive_chain_root("tenant-salt-0123456789", "s1")));
  CHECK(kvrelay::broker::request_signature_valid(kvrelay, "node-key-0123456789"));
  // The cache salt may also come in kv_transfer_params (top level wins, as vLLM reads it there).
  const auto in_params = inject_kv_transfer_params(R"({"prompt":[1],"kv_transfer_params":{"cache_salt":"s1"}})",
                                                   json{{"agent", "b"}}, injection);
  REQUIRE(in_params);
  CHECK(json::parse(in_params.value().body)["kv_transfer_params"]["kvrelay"]["chain_root"] == kvrelay["chain_root"]);
  const auto bad_salt = inject_kv_transfer_params(R"({"prompt":[1],"cache_salt":7})", json{{"agent", "b"}}, injection);
  REQUIRE_FALSE(bad_salt);
  CHECK_THAT(bad_salt.error().message, Catch::Contains("cache_salt"));
}

TEST_CASE("injected kv_transfer_params carry the request's answer budget", "[proxy][kv_path]") {
  const auto completion = inject_kv_transfer_params(R"({"prompt":[1],"max_tokens":64})", json{{"agent", "b"}});
  REQUIRE(completion);
  CHECK(json::parse(completion.value().body)["kv_transfer_params"]["kvrelay"]["max_tokens"] == 64);
  const auto chat = inject_kv_transfer_params(R"({"messages":[],"max_completion_tokens":9})", json{{"agent", "b"}});
  REQUIRE(chat);
  CHECK(json::parse(chat.value().body)["kv_transfer_params"]["kvrelay"]["max_tokens"] == 9);
  // Not a count: left out rather than guessed.
  const auto bad = inject_kv_transfer_params(R"({"prompt":[1],"max_tokens":-3})", json{{"agent", "b"}});
  REQUIRE(bad);
  CHECK_FALSE(json::parse(bad.value().body)["kv_transfer_params"]["kvrelay"].contains("max_tokens"));
}

TEST_CASE("prompt length and worker stats for audit covariates", "[proxy][audit]") {
  CHECK(prompt_token_count(R"({"prompt":[1,2,3]})") == 3);
  CHECK(prompt_token_count(R"({"prompt":"text"})") == 0);
  CHECK(prompt_token_count(R"({"prompt":[1,"x"]})") == 0);
  CHECK(prompt_token_count("not json") == 0);
  const auto stats = worker_stats_from_tail(
      R"(..."usage":{"prompt_tokens":9},"kvrelay":{"prompt_tokens":225,"cached_tokens":208,"ttft_ms":3.5}}
)");
  REQUIRE(stats);
  CHECK((*stats)["cached_tokens"] == 208);
  const auto streamed = worker_stats_from_tail("data: {\"kvrelay\":{\"cached_tokens\":16}}\n\ndata: [DONE]\n\n");
  REQUIRE(streamed);
  CHECK((*streamed)["cached_tokens"] == 16);
  CHECK_FALSE(worker_stats_from_tail("data: [DONE]\n\n"));
  CHECK_FALSE(worker_stats_from_tail(R"("kvrelay":{"cut)"));
}

TEST_CASE("online audit draws at the route's fraction and uniformly over treatments", "[proxy][audit]") {
  OnlineAudit audit(1000, 42);
  const auto route = audited_route(0.25, "");
  std::map<std::string, int> counts;
  constexpr int kDraws = 20000;
  for (int i = 0; i < kDraws; ++i) {
    if (const auto treatment = audit.draw(route)) ++counts[treatment->name];
  }
  int audited = 0;
  for (const auto& [name, count] : counts)
    audited += count;
  // Binomial(20000, 0.25): sd 61; 5 sd either side. Each of 4 treatments: 1/4 of the audited.
  CHECK(std::abs(audited - kDraws / 4) < 310);
  REQUIRE(counts.size() == 4);
  for (const auto& [name, count] : counts)
    CHECK(std::abs(count - audited / 4) < 5 * 35);
  CHECK_FALSE(audit.draw(audited_route(0.0, "")));
}

TEST_CASE("online audit writes the assignment before the outcome and joins them", "[proxy][audit]") {
  kvrelay::test::TempDir dir;
  const auto path = (dir / "trials.jsonl").string();
  OnlineAudit audit(1000, 1);
  const auto route = audited_route(1.0, path);
  const auto treatment = audit.draw(route);
  REQUIRE(treatment);
  kvrelay::audit::Trial covariates;
  covariates.context_tokens = 0;  // a text prompt: the worker's stats fill it in
  audit.record_assignment(route, "req-1", *treatment, covariates);
  const auto before = kvrelay::test::read_file(path);
  CHECK(json::parse(before)["event"] == "assignment");
  CHECK(audit.snapshot().assignments_without_outcome == 1);
  audit.record_outcome("req-1", AuditOutcome{4.0, 9.0, 200, 300, 288});
  audit.record_outcome("unknown", AuditOutcome{1.0, 1.0, 200, {}, {}});  // ignored
  const auto trials = audit.snapshot();
  REQUIRE(trials.trials.size() == 1);
  CHECK(trials.trials[0].context_tokens == 300);
  CHECK(trials.trials[0].cached_tokens == 288U);
  CHECK(trials.trials[0].treatment == treatment->name);
  const auto parsed = kvrelay::audit::read_trials_file(path);
  REQUIRE(parsed);
  REQUIRE(parsed.value().trials.size() == 1);
  CHECK(parsed.value().trials[0].ttft_ms == 4.0);
  CHECK(parsed.value().trials[0].context_tokens == 300);  // from the outcome's worker stats
  CHECK(parsed.value().trials[0].cached_tokens == 288U);
}
