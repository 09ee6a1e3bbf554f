// Issue #28, treatments as delivered: the online audit's T1, T2 and T3 reach B's worker as
// assigned (A's prompt span, A's generated span imported after B prefills the prompt span
// itself, all of it), every trial says what was delivered, and a receiver declared prefix-only
// is never assigned T2. Real processes: reference workers running stories260K behind one
// sidecar, whose front proxy draws the treatments.

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <map>
#include <sstream>
#include <string>

#include "kvrelay/codec_plugins/sparse.h"

#include "support/kv_path_fixture.h"
#include "support/skip.h"

using namespace kvrelay::test;
using nlohmann::json;

namespace {

constexpr int kPromptTokens = 100;       // A's prompt: 6 whole blocks of 16
constexpr int kAnswerTokens = 60;        // A's answer: its published KV covers 159 tokens, 9 blocks
constexpr int kPromptBlocksTokens = 96;  // T1: A's whole prompt blocks
constexpr int kContextTokens = 144;      // T3: A's 9 blocks
constexpr int kGeneratedTokens = 32;     // T2: blocks 7 and 8 (block 6 holds tokens 96..111, part prompt)

struct Trials {
  std::map<std::string, std::string> assigned;  // request id -> treatment
  std::map<std::string, json> outcomes;         // request id -> outcome record
};

Trials read_trials(const std::filesystem::path& path, std::size_t outcomes) {
  Trials trials;
  std::istringstream lines(trials_with_outcomes(path, outcomes));
  for (std::string line; std::getline(lines, line);) {
    if (line.empty()) continue;
    const auto record = json::parse(line);
    if (record.value("event", "") == "assignment") {
      trials.assigned[record["request_id"]] = record["treatment"];
    } else if (record.value("event", "") == "outcome") {
      trials.outcomes[record["request_id"]] = record;
    }
  }
  return trials;
}

json audited_route(const std::string& id, const std::string& to, const std::filesystem::path& trials_file) {
  return {{"id", id},
          {"from", "writer"},
          {"to", to},
          {"audit",
           {{"fraction", 1.0},
            {"trials_file", trials_file.string()},
            {"treatments", json::array({{{"name", "T0"}, {"medium", "tokens"}, {"span", "none"}},
                                        {{"name", "T1"}, {"medium", "kv_raw"}, {"span", "prompt"}},
                                        {{"name", "T2"}, {"medium", "kv_raw"}, {"span", "generated"}},
                                        {{"name", "T3"}, {"medium", "kv_raw"}, {"span", "all"}}})}}}};
}

}  // namespace

TEST_CASE("online audit: T1 T2 and T3 are delivered as assigned and B answers as from tokens",
          "[proxy][audit][kv_path][process][audit_live]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  Sidecar node{"node-1"};
  RefworkerUnderTest writer({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  RefworkerUnderTest reader({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  RefworkerUnderTest prefix_reader({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  RefworkerUnderTest reference({"--model", model->string()});
  TempDir dir;
  const auto trials_file = dir / "trials.jsonl";
  auto b = agent_json("reader", "", reader.port(), stories_model_json());
  b["accepts_kv_spans"] = true;
  // Declared prefix-only (as vLLM is): audit_fraction's T0..T3 leave T2 out for it.
  auto c = agent_json("prefix-reader", "", prefix_reader.port(), stories_model_json());
  const json agents = json::array({agent_json("writer", "", writer.port(), stories_model_json()), b, c});
  json routes = json::array(
      {audited_route("writer-to-reader", "reader", trials_file),
       {{"id", "writer-to-prefix-reader"}, {"from", "writer"}, {"to", "prefix-reader"}, {"audit_fraction", 1.0}}});
  node.start(sidecar_policy(node, agents, routes));

  std::map<std::string, int> assigned_counts;
  int prefix_reader_trials = 0;
  for (int seed = 0; seed < 16; ++seed) {
    INFO("seed " << seed);
    const auto a_prompt = context_prompt(500 + seed, kPromptTokens);
    const auto a = node.complete("writer", greedy(a_prompt, kAnswerTokens, true));
    const auto b_prompt = handoff_prompt(a_prompt, a);
    const auto expected =
        json::parse(http_request(reference.port(), "POST", "/v1/completions", greedy(b_prompt, 6, true).dump()).body);
    const auto answer = node.complete("reader", greedy(b_prompt, 6, true));
    // Exact KV of any span leaves B's greedy answer as a full prefill's.
    CHECK(answer["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]);
    const auto prefix_answer = node.complete("prefix-reader", greedy(b_prompt, 6, true));
    CHECK(prefix_answer["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]);
    ++prefix_reader_trials;
  }

  const auto trials = read_trials(trials_file, 16);
  REQUIRE(trials.assigned.size() == 16);
  REQUIRE(trials.outcomes.size() == 16);
  std::map<std::string, int> delivered_counts;
  for (const auto& [request_id, treatment] : trials.assigned) {
    INFO(request_id << " assigned " << treatment);
    const auto& outcome = trials.outcomes.at(request_id);
    INFO(outcome.dump());
    ++assigned_counts[treatment];
    const auto delivered = outcome.value("delivered_treatment", std::string("(none recorded)"));
    ++delivered_counts[delivered];
    CHECK(delivered == treatment);
    CHECK(outcome.value("delivery_reason", std::string()).empty());
    const int cached = outcome["cached_tokens"].get<int>();
    if (treatment == "T0") CHECK(cached == 0);
    if (treatment == "T1") CHECK(cached == kPromptBlocksTokens);
    if (treatment == "T2") CHECK(cached == kGeneratedTokens);
    if (treatment == "T3") CHECK(cached == kContextTokens);
  }
  CHECK(delivered_counts == assigned_counts);
  for (const auto* name : {"T0", "T1", "T2", "T3"})
    CHECK(assigned_counts[name] >= 1);

  // The decision log says where a span started and ended, at A's published boundary.
  bool saw_generated = false;
  for (const auto& decision : node.decisions(200)) {
    if (!decision.contains("span") || decision["span"]["span"] != "generated") continue;
    saw_generated = true;
    CHECK(decision["span"]["prompt_boundary"] == kPromptTokens);
    CHECK(decision["span"]["first_token"] == 112);
  }
  CHECK(saw_generated);

  // The prefix-only receiver's trials (its route keeps them in memory): never T2, as the
  // treatments its lookups carried show.
  std::map<std::string, int> prefix_only_assigned;
  const auto decisions = node.decisions(200);
  for (const auto& decision : decisions) {
    if (decision.value("agent", "") != "prefix-reader" || !decision.contains("treatment")) continue;
    ++prefix_only_assigned[decision["treatment"]["name"].get<std::string>()];
  }
  CHECK(prefix_only_assigned["T2"] == 0);
  CHECK(prefix_only_assigned["T0"] + prefix_only_assigned["T1"] + prefix_only_assigned["T3"] == prefix_reader_trials);
}

TEST_CASE("kv_sparse forced: B attends over the kept positions of A's KV and answers with bytes and costs logged",
          "[proxy][kv_path][sparse][process][audit_live]") {
  const auto model = stories_model_path();
  if (!model) KVRELAY_SKIP("stories260K.bin not found");
  Sidecar node{"node-1"};
  RefworkerUnderTest writer({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  RefworkerUnderTest reader({"--model", model->string()}, {"--kvrelay-socket", node.socket_path()});
  auto b = agent_json("reader", "", reader.port(), stories_model_json());
  b["accepts_sparse_kv"] = true;
  const json agents = json::array({agent_json("writer", "", writer.port(), stories_model_json()), b});
  node.start(
      sidecar_policy(node, agents, json::array({{{"id", "writer-to-reader"}, {"from", "writer"}, {"to", "reader"}}})));
  node.force_medium("writer-to-reader", "kv_sparse");
  const auto a_prompt = context_prompt(900, kPromptTokens);
  const auto a = node.complete("writer", greedy(a_prompt, kAnswerTokens, true));
  const auto entries_before = json::parse(admin_request(node.admin_port(), "GET", "/admin/kv").body);
  const auto answer = node.complete("reader", greedy(handoff_prompt(a_prompt, a), 6, true));
  CHECK(answer["choices"][0]["token_ids"].size() == 6);
  const auto decision = node.decisions(1).at(0);
  INFO(decision.dump());
  CHECK(decision["medium"] == "kv_sparse");
  CHECK(decision["source"] == "forced");
  REQUIRE(decision.contains("sparse"));
  // The sparse codec's rule (sinks, recent window, top quarter of the middle by key norm) over
  // A's 144 tokens: what B imported, not A's whole context.
  const auto kept = kvrelay::codec::sparse_kept_count(kContextTokens, kvrelay::codec::SparseKeep{});
  REQUIRE(kept < static_cast<std::uint64_t>(kContextTokens));
  CHECK(decision["sparse"]["of_tokens"] == kContextTokens);
  CHECK(decision["sparse"]["kept_tokens"] == kept);
  CHECK(answer["kvrelay"]["cached_tokens"] == kept);
  CHECK(decision["fidelity"]["lossy_codec"] == "sparse");
  CHECK(decision["cost"].is_object());  // the engine priced the forced medium beside the others
  CHECK(decision["served_tokens"] == kContextTokens);
  // B's KV attended over some positions only: it is not published as a chain prefix.
  const auto entries_after = json::parse(admin_request(node.admin_port(), "GET", "/admin/kv").body);
  CHECK(entries_after["entries"].size() == entries_before["entries"].size());

  // The audit can randomise it too: every request drawn S (kv_sparse), delivered as assigned.
  TempDir dir;
  const auto trials_file = dir / "trials.jsonl";
  node.reload(sidecar_policy(
      node, agents,
      json::array({{{"id", "writer-to-reader"},
                    {"from", "writer"},
                    {"to", "reader"},
                    {"audit",
                     {{"fraction", 1.0},
                      {"trials_file", trials_file.string()},
                      {"treatments", json::array({{{"name", "S"}, {"medium", "kv_sparse"}, {"span", "all"}}})}}}}})));
  const auto a_prompt2 = context_prompt(901, kPromptTokens);
  const auto a2 = node.complete("writer", greedy(a_prompt2, kAnswerTokens, true));
  const auto audited = node.complete("reader", greedy(handoff_prompt(a_prompt2, a2), 6, true));
  CHECK(audited["kvrelay"]["cached_tokens"] == kept);
  const auto trials = read_trials(trials_file, 1);
  REQUIRE(trials.outcomes.size() == 1);
  CHECK(trials.assigned.begin()->second == "S");
  CHECK(trials.outcomes.begin()->second.value("delivered_treatment", std::string()) == "S");
}
