// `kvrelay audit` end to end: the real binary on trials files, a real daemon auditing live
// requests to a real reference worker, and the offline runner against a sidecar with two
// reference workers on one node.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "kvrelay/audit/trials.h"

#include "support/child_process.h"
#include "support/http_client.h"
#include "support/refworker_process.h"
#include "support/skip.h"
#include "support/test_paths.h"

using namespace kvrelay::test;
using Catch::Matchers::Contains;
using nlohmann::json;

namespace {

constexpr const char* kTinyShape = "layers=2,dim=64,heads=2,kv_heads=1,ffn=128,vocab=512,seq_len=2048";

// A paired replay over three length buckets with T3 clearly faster at long lengths.
std::string replay_trials() {
  std::mt19937_64 generator(5);
  std::normal_distribution<double> noise(0.0, 2.0);
  std::string text;
  int context = 0;
  for (const std::uint64_t tokens : {40ULL, 100ULL, 200ULL, 300ULL, 600ULL, 900ULL, 1100ULL, 1600ULL, 2000ULL}) {
    for (int repeat = 0; repeat < 2; ++repeat, ++context) {
      for (const char* treatment : {"T0", "T3"}) {
        kvrelay::audit::Trial trial;
        trial.route = "a-to-b";
        trial.treatment = treatment;
        trial.context_tokens = tokens;
        const double n = static_cast<double>(tokens);
        trial.ttft_ms = (trial.treatment == "T0" ? 5.0 + 0.5 * n : 30.0 + 0.05 * n) + noise(generator);
        trial.pair_id = std::to_string(context);
        trial.receiver_agent = "b";
        trial.medium = trial.treatment == "T0" ? "tokens" : "kv_raw";
        trial.span = trial.treatment == "T0" ? "none" : "all";
        text += kvrelay::audit::trial_line(trial) + "\n";
      }
    }
  }
  return text;
}

CommandResult run_kvrelay(std::vector<std::string> args, const TempDir& dir) {
  args.insert(args.begin(), kvrelay_binary().string());
  return run_command(args, dir.path());
}

json tiny_model() {
  return {{"architecture", "llama"}, {"layers", 2},     {"kv_heads", 1},
          {"head_dim", 32},          {"dtype", "fp32"}, {"weights", "synthetic-tiny"}};
}

std::vector<std::string> read_lines(const std::filesystem::path& path) {
  std::ifstream file(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(file, line);)
    lines.push_back(line);
  return lines;
}

}  // namespace

TEST_CASE("audit analyze renders JSON and Markdown and a well-formed SVG", "[audit][cli][process]") {
  TempDir dir;
  write_file(dir / "trials.jsonl", replay_trials());
  const auto as_json =
      run_kvrelay({"audit", "analyze", "--trials", (dir / "trials.jsonl").string(), "--bootstrap", "500"}, dir);
  REQUIRE(as_json.exit_status == 0);
  const auto report = json::parse(as_json.out);
  REQUIRE(report["strata"].size() == 3);
  const auto& long_effect = report["strata"][2]["effects"][0];
  CHECK(long_effect["treatment"] == "T3");
  CHECK(long_effect["baseline"] == "T0");
  CHECK(long_effect["paired"] == true);
  CHECK(long_effect["mean_diff_ms"].get<double>() < 0.0);
  CHECK(long_effect["p_value"].get<double>() < 0.01);
  CHECK(report["overall"][0]["p_holm"].is_number());
  REQUIRE(report["break_even"].size() == 1);
  CHECK(report["break_even"][0]["kind"] == "faster_above");

  const auto markdown =
      run_kvrelay({"audit", "analyze", "--trials", (dir / "trials.jsonl").string(), "--format", "markdown"}, dir);
  REQUIRE(markdown.exit_status == 0);
  CHECK_THAT(markdown.out, Contains("# kvrelay audit report"));
  CHECK_THAT(markdown.out, Contains("## Stratum >=1024 any"));

  const auto svg_path = (dir / "report.svg").string();
  const auto svg = run_kvrelay({"audit", "analyze", "--trials", (dir / "trials.jsonl").string(), "--format", "svg",
                                "--out", svg_path, "--buckets", "128,512,1024"},
                               dir);
  REQUIRE(svg.exit_status == 0);
  const auto text = read_file(svg_path);
  CHECK_THAT(text, Contains("<svg"));
  CHECK_THAT(text, Contains("class=\"break-even\""));
  // Well-formed XML, checked by an independent parser.
  const auto parsed = run_command({"/usr/bin/env", "python3", "-c",
                                   "import sys, xml.etree.ElementTree as ET; r = ET.parse(sys.argv[1]).getroot(); "
                                   "assert r.tag.endswith('svg'), r.tag; print(len(list(r.iter())))",
                                   svg_path},
                                  dir.path());
  if (parsed.exit_status == 127) KVRELAY_SKIP("python3 not found: SVG well-formedness not checked by an XML parser");
  INFO(parsed.err);
  CHECK(parsed.exit_status == 0);
  CHECK(std::stoi(parsed.out) > 50);
}

TEST_CASE("audit analyze and calibrate reject bad trials with the line and field", "[audit][cli][process]") {
  TempDir dir;
  write_file(dir / "bad.jsonl",
             replay_trials() +
                 R"({"route":"a-to-b","treatment":"T0","context_tokens":"long","ttft_ms":3,"pair_id":null})"
                 "\n");
  const auto analyzed = run_kvrelay({"audit", "analyze", "--trials", (dir / "bad.jsonl").string()}, dir);
  CHECK(analyzed.exit_status != 0);
  CHECK_THAT(analyzed.err, Contains("line 37: field 'context_tokens': expected a non-negative integer, got \"long\""));
  const auto calibrated = run_kvrelay({"audit", "calibrate", "--trials", (dir / "bad.jsonl").string()}, dir);
  CHECK(calibrated.exit_status != 0);
  CHECK_THAT(calibrated.err, Contains("line 37"));
  const auto missing = run_kvrelay({"audit", "analyze", "--trials", (dir / "nothing.jsonl").string()}, dir);
  CHECK(missing.exit_status != 0);
  CHECK_THAT(missing.err, Contains("cannot open trials file"));
  const auto bad_format =
      run_kvrelay({"audit", "analyze", "--trials", (dir / "bad.jsonl").string(), "--format", "pdf"}, dir);
  CHECK(bad_format.exit_status != 0);
  write_file(dir / "no-baseline.jsonl",
             R"({"route":"r","treatment":"T3","context_tokens":9,"ttft_ms":3,"pair_id":null})"
             "\n");
  const auto no_baseline = run_kvrelay({"audit", "analyze", "--trials", (dir / "no-baseline.jsonl").string()}, dir);
  CHECK(no_baseline.exit_status != 0);
  CHECK_THAT(no_baseline.err, Contains("no trial has the baseline treatment 'T0'"));
}

TEST_CASE("audit calibrate writes a cost_model fragment the policy loader accepts", "[audit][cli][process]") {
  TempDir dir;
  write_file(dir / "trials.jsonl", replay_trials());
  const auto calibrated = run_kvrelay(
      {"audit", "calibrate", "--trials", (dir / "trials.jsonl").string(), "--out", (dir / "fragment.json").string()},
      dir);
  REQUIRE(calibrated.exit_status == 0);
  const auto fragment = json::parse(read_file(dir / "fragment.json"));
  const auto& prefill = fragment["cost_model"]["agents"]["b"]["prefill_s"];
  CHECK(prefill["b"].get<double>() == Approx(0.0005).epsilon(0.05));  // 0.5 ms per token, planted
  // The operator's step: paste cost_model into the policy; check-config must accept it.
  json policy{{"schema_version", 1},
              {"node", {{"id", "n"}}},
              {"listen", {{"http", "127.0.0.1:0"}}},
              {"agents", json::array({{{"id", "a"}, {"upstream", "http://127.0.0.1:1"}, {"model", tiny_model()}},
                                      {{"id", "b"}, {"upstream", "http://127.0.0.1:2"}, {"model", tiny_model()}}})},
              {"routes", json::array({{{"id", "a-to-b"}, {"from", "a"}, {"to", "b"}}})},
              {"cost_model", fragment["cost_model"]}};
  write_file(dir / "policy.json", policy.dump(2));
  const auto checked = run_kvrelay({"check-config", (dir / "policy.json").string()}, dir);
  INFO(checked.err);
  CHECK(checked.exit_status == 0);
}

TEST_CASE("online audit: assignments precede outcomes in the trials file and feed the admin report",
          "[audit][online][process]") {
  TempDir dir;
  RefworkerUnderTest worker({"--synthetic", kTinyShape, "--seed", "1"});
  const auto trials_file = dir / "trials.jsonl";
  const json policy{
      {"schema_version", 1},
      {"node", {{"id", "n"}}},
      {"listen", {{"http", "127.0.0.1:0"}, {"admin", "127.0.0.1:0"}}},
      {"agents", json::array({{{"id", "a"}, {"upstream", "http://127.0.0.1:1"}, {"model", tiny_model()}},
                              {{"id", "b"},
                               {"upstream", fmt::format("http://127.0.0.1:{}", worker.port())},
                               {"model", tiny_model()},
                               {"kv_connector", true}}})},
      {"routes", json::array({{{"id", "a-to-b"},
                               {"from", "a"},
                               {"to", "b"},
                               {"audit",
                                {{"fraction", 1.0},
                                 {"treatments", json::array({{{"name", "T0"}, {"medium", "tokens"}, {"span", "none"}},
                                                             {{"name", "T3"}, {"medium", "kv_raw"}, {"span", "all"}}})},
                                 {"trials_file", trials_file.string()},
                                 {"client_treatments", true}}}}})},
      {"logging", {{"level", "warn"}}}};
  write_file(dir / "policy.json", policy.dump(2));
  ChildProcess daemon({kvrelay_binary().string(), "serve", "--config", (dir / "policy.json").string(), "--ready-file",
                       (dir / "ready.json").string()},
                      dir.path());
  REQUIRE(wait_until([&] { return std::filesystem::exists(dir / "ready.json") || !daemon.running(); },
                     std::chrono::seconds(20)));
  const auto ready = json::parse(read_file(dir / "ready.json"));
  const auto port = ready["http"].get<std::uint16_t>();
  const auto admin_port = ready["admin"].get<std::uint16_t>();

  constexpr int kRequests = 12;
  for (int i = 0; i < kRequests; ++i) {
    json prompt = json::array({1});
    for (int t = 0; t < 20 + 10 * i; ++t)
      prompt.push_back(3 + (t * 7 + i) % 200);
    const json body{{"prompt", prompt}, {"max_tokens", 3}, {"temperature", 0}, {"stream", i % 2 == 0}};
    const auto reply = http_request(port, "POST", "/agents/b/v1/completions", body.dump());
    REQUIRE(reply.status == 200);
  }
  // A client that names its treatment (the offline runner) keeps it and is not re-randomized, since
  // the route allows client treatments.
  const json forced{{"prompt", json::array({1, 5, 6})},
                    {"max_tokens", 2},
                    {"kv_transfer_params",
                     {{"kvrelay", {{"treatment", {{"name", "T1"}, {"medium", "kv_raw"}, {"span", "prompt"}}}}}}}};
  REQUIRE(http_request(port, "POST", "/agents/b/v1/completions", forced.dump()).status == 200);

  REQUIRE(wait_until([&] { return read_lines(trials_file).size() >= 2 * kRequests; }, std::chrono::seconds(10)));
  const auto lines = read_lines(trials_file);
  CHECK(lines.size() == 2 * kRequests);
  std::map<std::string, std::size_t> assigned_at;
  std::size_t outcomes = 0;
  for (std::size_t index = 0; index < lines.size(); ++index) {
    const auto record = json::parse(lines[index]);
    const auto id = record["request_id"].get<std::string>();
    if (record["event"] == "assignment") {
      CHECK_FALSE(record.contains("ttft_ms"));
      CHECK((record["treatment"] == "T0" || record["treatment"] == "T3"));
      CHECK(record["context_tokens"].get<int>() >= 21);
      CHECK(record["receiver_agent"] == "b");
      assigned_at[id] = index;
    } else {
      REQUIRE(record["event"] == "outcome");
      REQUIRE(assigned_at.contains(id));  // the assignment was written first
      CHECK(record["status"] == 200);
      CHECK(record["ttft_ms"].get<double>() > 0.0);
      CHECK(record["e2e_ms"].get<double>() >= record["ttft_ms"].get<double>());
      CHECK(record.contains("cached_tokens"));  // joined from the worker's kvrelay stats
      ++outcomes;
    }
  }
  CHECK(outcomes == kRequests);
  const auto parsed = kvrelay::audit::read_trials_file(trials_file.string());
  REQUIRE(parsed);
  CHECK(parsed.value().trials.size() == kRequests);

  const auto report = http_request(admin_port, "GET", "/admin/audit/report", "");
  REQUIRE(report.status == 200);
  const auto body = json::parse(report.body);
  CHECK(body["in_flight"] == 0);
  if (body.contains("error")) {
    CHECK_THAT(body["error"].get<std::string>(), Contains("baseline"));  // every draw was T3 (p = 2^-12)
  } else {
    CHECK(body["trials"] == kRequests);
    REQUIRE(body["overall"].size() == 1);
    CHECK(body["overall"][0]["paired"] == false);  // online trials are independent: Welch
  }
  const auto markdown = http_request(admin_port, "GET", "/admin/audit/report?format=markdown", "");
  CHECK((markdown.status == 200 || markdown.status == 409));
  CHECK(http_request(admin_port, "GET", "/admin/audit/report?format=pdf", "").status == 400);
  const auto calibration = http_request(admin_port, "GET", "/admin/audit/calibration", "");
  REQUIRE(calibration.status == 200);
  const auto fragment = json::parse(calibration.body);
  CHECK(fragment["calibration"]["trials"] == kRequests);
  CHECK(fragment["cost_model"].contains("agents"));
}

namespace {

constexpr const char* kReplayShape = "layers=4,dim=256,heads=4,kv_heads=2,ffn=688,vocab=512,seq_len=4096";

// One sidecar, agent A and agent B as reference workers on its shared-memory data plane, and
// `kvrelay audit run` over contexts in three length buckets. Returns the run and the trials.
struct ReplayRun {
  CommandResult run;
  std::vector<json> trials;
};

ReplayRun replay_through_sidecar(const TempDir& dir, int repeats) {
  const auto socket = (dir / "kvrelay.sock").string();
  RefworkerUnderTest agent_a({"--synthetic", kReplayShape, "--seed", "1"}, {"--kvrelay-socket", socket});
  RefworkerUnderTest agent_b({"--synthetic", kReplayShape, "--seed", "1"}, {"--kvrelay-socket", socket});
  const json model{{"architecture", "llama"}, {"layers", 4},     {"kv_heads", 2},
                   {"head_dim", 64},          {"dtype", "fp32"}, {"weights", "synthetic-replay"}};
  const json policy{{"schema_version", 1},
                    {"node", {{"id", "n"}}},
                    {"listen", {{"http", "127.0.0.1:0"}, {"unix_socket", socket}}},
                    {"agents", json::array({{{"id", "a"},
                                             {"upstream", fmt::format("http://127.0.0.1:{}", agent_a.port())},
                                             {"model", model},
                                             {"kv_connector", true}},
                                            {{"id", "b"},
                                             {"upstream", fmt::format("http://127.0.0.1:{}", agent_b.port())},
                                             {"model", model},
                                             {"kv_connector", true}}})},
                    // The runner names each request's treatment; the route has to allow that.
                    {"routes", json::array({{{"id", "a-to-b"},
                                             {"from", "a"},
                                             {"to", "b"},
                                             {"audit", {{"fraction", 0}, {"client_treatments", true}}}}})},
                    {"logging", {{"level", "warn"}}}};
  write_file(dir / "policy.json", policy.dump(2));
  ChildProcess sidecar({kvrelay_binary().string(), "serve", "--config", (dir / "policy.json").string(), "--ready-file",
                        (dir / "ready.json").string()},
                       dir.path());
  REQUIRE(wait_until([&] { return std::filesystem::exists(dir / "ready.json") || !sidecar.running(); },
                     std::chrono::seconds(20)));
  const auto port = json::parse(read_file(dir / "ready.json"))["http"].get<std::uint16_t>();

  std::string contexts;
  int seed = 0;
  for (const int length : {60, 150, 400, 700, 1200, 1800}) {
    json prompt = json::array({1});
    for (int t = 1; t < length; ++t)
      prompt.push_back(3 + (t * 37 + seed) % 500);
    contexts += json{{"prompt", prompt}, {"b_followup", json::array({300, 301, 302, 303})}}.dump() + "\n";
    ++seed;
  }
  write_file(dir / "contexts.jsonl", contexts);
  ReplayRun result;
  result.run = run_command({kvrelay_binary().string(),
                            "audit",
                            "run",
                            "--contexts",
                            (dir / "contexts.jsonl").string(),
                            "--sidecar",
                            fmt::format("http://127.0.0.1:{}", port),
                            "--agent-a",
                            "a",
                            "--agent-b",
                            "b",
                            "--treatments",
                            "T0,T3",
                            "--repeats",
                            std::to_string(repeats),
                            "--seed",
                            "3",
                            "--out",
                            (dir / "trials.jsonl").string(),
                            "--a-max-tokens",
                            "8",
                            "--b-max-tokens",
                            "2",
                            "--bootstrap",
                            "500"},
                           dir.path(), std::chrono::seconds(120));
  for (const auto& line : read_lines(dir / "trials.jsonl"))
    result.trials.push_back(json::parse(line));
  return result;
}

}  // namespace

TEST_CASE("audit run replays contexts under each treatment as a paired design", "[audit][run][process]") {
  TempDir dir;
  const auto replay = replay_through_sidecar(dir, 2);
  INFO(replay.run.err);
  REQUIRE(replay.run.exit_status == 0);
  REQUIRE(replay.trials.size() == 6 * 2 * 2);  // contexts x repeats x treatments
  std::map<std::string, std::vector<std::string>> treatments_by_pair;
  for (const auto& trial : replay.trials) {
    treatments_by_pair[trial["pair_id"].get<std::string>()].push_back(trial["treatment"].get<std::string>());
    CHECK(trial["ttft_ms"].get<double>() > 0.0);
    CHECK(trial.contains("cached_tokens"));
    if (trial["treatment"] == "T3") {
      CHECK(trial["medium"] == "kv_raw");
      CHECK(trial["cached_tokens"].get<int>() > 0);  // B imported A's KV
    }
  }
  CHECK(treatments_by_pair.size() == 12);
  for (const auto& [pair, treatments] : treatments_by_pair)
    CHECK(treatments.size() == 2);
  const auto report = json::parse(replay.run.out);
  REQUIRE(report["strata"].size() == 3);
  for (const auto& stratum : report["strata"]) {
    REQUIRE(stratum["effects"].size() == 1);
    CHECK(stratum["effects"][0]["paired"] == true);
    CHECK(stratum["effects"][0]["n"] == 4);  // 2 contexts x 2 repeats
  }
}

// The sidecar's lookup honors kv_transfer_params.kvrelay.treatment (T0 => a miss, T3 => all of
// A's KV), so the paired replay can tell the two apart.
TEST_CASE("audit run finds T3 faster than T0 at long lengths", "[kvpath][audit][run][process]") {
  TempDir dir;
  const auto replay = replay_through_sidecar(dir, 3);
  INFO(replay.run.err);
  REQUIRE(replay.run.exit_status == 0);
  for (const auto& trial : replay.trials) {
    if (trial["treatment"] == "T0") CHECK(trial["cached_tokens"] == 0);  // tokens only: B prefills all
  }
  const auto report = json::parse(replay.run.out);
  REQUIRE(report["strata"].size() == 3);
  const auto& long_effect = report["strata"][2]["effects"][0];
  CHECK(report["strata"][2]["length_bucket"] == ">=1024");
  CHECK(long_effect["treatment"] == "T3");
  CHECK(long_effect["mean_diff_ms"].get<double>() < 0.0);
  CHECK(long_effect["p_value"].get<double>() < 0.01);
  CHECK(long_effect["p_wilcoxon"].is_number());
}
