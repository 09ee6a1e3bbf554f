#include "kvrelay/audit/analysis.h"

#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <random>

#include "kvrelay/audit/calibrate.h"
#include "kvrelay/audit/render.h"

using namespace kvrelay::audit;
using nlohmann::json;

namespace {

Trial trial_of(const std::string& treatment, std::uint64_t tokens, double ttft_ms, std::optional<std::string> pair) {
  Trial trial;
  trial.route = "plan-to-code";
  trial.treatment = treatment;
  trial.context_tokens = tokens;
  trial.ttft_ms = ttft_ms;
  trial.pair_id = std::move(pair);
  trial.sender_model = "stories";
  trial.receiver_model = "stories";
  trial.receiver_agent = "coder";
  trial.medium = treatment == "T0" ? "tokens" : "kv_raw";
  trial.span = treatment == "T0" ? "none" : "all";
  return trial;
}

// A replay over three length buckets: T0 re-prefills (grows with length), T3 imports KV (a
// fixed cost plus a small per-token copy). Lines cross at (30 - 5) / (0.5 - 0.05) = 55.6 tokens.
TrialSet replay(std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  std::normal_distribution<double> noise(0.0, 2.0);
  TrialSet set;
  int context = 0;
  for (const std::uint64_t tokens :
       {32ULL, 64ULL, 128ULL, 200ULL, 300ULL, 500ULL, 700ULL, 900ULL, 1100ULL, 1500ULL, 2000ULL, 2048ULL}) {
    for (int repeat = 0; repeat < 2; ++repeat, ++context) {
      const auto pair = fmt::format("{}", context);
      const double n = static_cast<double>(tokens);
      set.trials.push_back(trial_of("T0", tokens, 5.0 + 0.5 * n + noise(generator), pair));
      set.trials.push_back(trial_of("T3", tokens, 30.0 + 0.05 * n + noise(generator), pair));
    }
  }
  return set;
}

}  // namespace

TEST_CASE("Report entries carry exactly the documented fields per stratum and overall", "[audit][analysis]") {
  const auto trials = replay(1);
  AnalysisOptions options;
  options.bootstrap.resamples = 300;
  const auto report = analyze(trials, options);
  REQUIRE(report);
  const json document = report_to_json(report.value());
  REQUIRE(document["strata"].size() == 3);
  CHECK(document["strata"][0]["length_bucket"] == "<256");
  CHECK(document["strata"][1]["length_bucket"] == "256-1023");
  CHECK(document["strata"][2]["length_bucket"] == ">=1024");
  CHECK(document["strata"][0]["model_pair"] == "stories->stories");
  for (const auto& entry : {document["overall"][0], document["strata"][2]["effects"][0]}) {
    for (const char* key : {"treatment", "baseline", "n", "mean_diff_ms", "ci95", "pct_change", "p_value", "p_holm",
                            "paired", "ci95_bootstrap", "median_diff_ms", "p_wilcoxon"}) {
      INFO(key);
      CHECK(entry.contains(key));
    }
    CHECK(entry["treatment"] == "T3");
    CHECK(entry["baseline"] == "T0");
    CHECK(entry["paired"] == true);
    CHECK(entry["ci95"].size() == 2);
    CHECK(entry["ci95"][0].get<double>() <= entry["mean_diff_ms"].get<double>());
  }
  // Long contexts: T3 saves about 0.45 ms per token, so ~ -700 ms at 1100-2048 tokens.
  const auto& long_effect = document["strata"][2]["effects"][0];
  CHECK(long_effect["n"] == 8);  // 4 lengths x 2 repeats, one pair each
  CHECK(long_effect["mean_diff_ms"].get<double>() < -500.0);
  CHECK(long_effect["ci95"][1].get<double>() < 0.0);
  CHECK(long_effect["p_value"].get<double>() < 0.01);
  CHECK(long_effect["pct_change"].get<double>() < -80.0);
}

TEST_CASE("Trials without pair ids are analysed with Welch's test", "[audit][analysis]") {
  auto trials = replay(2);
  for (auto& trial : trials.trials)
    trial.pair_id.reset();
  AnalysisOptions options;
  options.bootstrap.resamples = 0;
  const auto report = analyze(trials, options);
  REQUIRE(report);
  const json document = report_to_json(report.value());
  const auto& effect = document["strata"][2]["effects"][0];
  CHECK(effect["paired"] == false);
  CHECK(effect["test"] == "welch_t");
  CHECK(effect["n"] == 16);
  CHECK(effect["p_wilcoxon"].is_null());
  CHECK(effect["ci95_bootstrap"].is_null());
}

TEST_CASE("Break-even length is found and its CI covers the planted crossing", "[audit][analysis]") {
  const double truth = 25.0 / 0.45;
  const auto report = analyze(replay(3), AnalysisOptions{});
  REQUIRE(report);
  REQUIRE(report.value().break_even.size() == 1);
  const auto& estimate = report.value().break_even[0];
  CHECK(estimate.kind == CrossingKind::kFasterAbove);
  REQUIRE(estimate.break_even_tokens);
  REQUIRE(estimate.ci95);
  CHECK(*estimate.break_even_tokens == Approx(truth).margin(10.0));
  CHECK(estimate.bootstrap_agreement > 0.9);
  // Coverage over 200 simulated replays (a single 95% interval misses 1 time in 20). The
  // percentile bootstrap on 24 trials per arm is slightly liberal, hence the 88% floor.
  int covered = 0;
  constexpr int kReplays = 200;
  for (int seed = 100; seed < 100 + kReplays; ++seed) {
    const auto trials = replay(static_cast<std::uint64_t>(seed));
    std::vector<const Trial*> t3;
    std::vector<const Trial*> t0;
    for (const auto& trial : trials.trials)
      (trial.treatment == "T0" ? t0 : t3).push_back(&trial);
    const auto simulated = estimate_break_even(t3, t0, BootstrapOptions{400, static_cast<std::uint64_t>(seed)});
    REQUIRE(simulated);
    if (simulated->ci95 && simulated->ci95->low <= truth && truth <= simulated->ci95->high) ++covered;
  }
  INFO("break-even CI coverage " << covered << " of " << kReplays);
  CHECK(covered >= kReplays * 88 / 100);
}

TEST_CASE("Analysis rejects nonsense options and a missing baseline", "[audit][analysis]") {
  AnalysisOptions options;
  options.bucket_edges = {1024, 256};
  CHECK_FALSE(analyze(replay(4), options));
  options.bucket_edges = {256};
  options.baseline = "T9";
  const auto missing = analyze(replay(4), options);
  REQUIRE_FALSE(missing);
  CHECK_THAT(missing.error().message, Catch::Contains("no trial has the baseline treatment 'T9'"));
  options.baseline = "T0";
  options.route = "other-route";
  const auto empty = analyze(replay(4), options);
  REQUIRE(empty);
  CHECK(empty.value().trials == 0);
}

TEST_CASE("Markdown and SVG renderings", "[audit][analysis]") {
  auto trials = replay(5);
  trials.trials[0].treatment = "T0";
  trials.trials.back().receiver_model = "a<b&c";  // must be escaped in XML
  AnalysisOptions options;
  options.bootstrap.resamples = 200;
  const auto report = analyze(trials, options);
  REQUIRE(report);
  const auto markdown = render_markdown(report.value());
  CHECK_THAT(markdown, Catch::Contains("## Stratum >=1024 stories->stories"));
  CHECK_THAT(markdown, Catch::Contains("| T3 |"));
  CHECK_THAT(markdown, Catch::Contains("## Break-even length"));
  const auto svg = render_svg(report.value(), trials, options);
  CHECK(svg.rfind("<?xml", 0) == 0);
  CHECK_THAT(svg, Catch::Contains("class=\"break-even\""));
  CHECK_THAT(svg, Catch::Contains("class=\"ci-band\""));
  CHECK_THAT(svg, Catch::Contains("a&lt;b&amp;c"));
  CHECK_THAT(svg, !Catch::Contains("a<b"));
}

TEST_CASE("Calibration recovers a planted prefill fit and codec quality", "[audit][calibrate]") {
  TrialSet trials;
  int context = 0;
  for (const std::uint64_t tokens : {64ULL, 128ULL, 256ULL, 512ULL, 1024ULL, 2048ULL, 4096ULL}) {
    const double n = static_cast<double>(tokens);
    const double seconds = 0.004 + 3e-5 * n + 2e-9 * n * n;
    auto baseline = trial_of("T0", tokens, seconds * 1000.0, std::to_string(context));
    baseline.output_tokens = 20;
    baseline.e2e_ms = baseline.ttft_ms + 19 * 2.5;  // 2.5 ms per decoded token
    trials.trials.push_back(baseline);
    auto lossy = trial_of("T3-int8", tokens, 3.0, std::to_string(context++));
    lossy.medium = "kv_int8";
    lossy.top1_agreement = 0.98;
    lossy.output_tokens = 22;
    trials.trials.push_back(lossy);
  }
  const json fragment = calibrate(trials, CalibrationOptions{});
  const auto& agent = fragment["cost_model"]["agents"]["coder"];
  CHECK(agent["prefill_s"]["a"].get<double>() == Approx(0.004).epsilon(1e-6));
  CHECK(agent["prefill_s"]["b"].get<double>() == Approx(3e-5).epsilon(1e-6));
  CHECK(agent["prefill_s"]["c"].get<double>() == Approx(2e-9).epsilon(1e-6));
  CHECK(agent["decode_s_per_token"].get<double>() == Approx(0.0025));
  const auto& medium = fragment["cost_model"]["media"]["kv_int8"];
  CHECK(medium["fidelity"].get<double>() == Approx(0.98));
  CHECK(medium["extra_decode_fraction"].get<double>() == Approx(0.1));
  CHECK(fragment["calibration"]["agents"]["coder"]["trials"] == 7);

  // A trial delivered other than assigned would price the wrong medium: it is left out, and said.
  auto missed = trials.trials.back();
  missed.delivered_treatment = "T0";
  missed.delivery_reason = "lookup miss";
  missed.top1_agreement = 0.2;
  trials.trials.push_back(missed);
  const json with_missed = calibrate(trials, CalibrationOptions{});
  CHECK(with_missed["cost_model"]["media"]["kv_int8"]["fidelity"].get<double>() == Approx(0.98));
  CHECK(with_missed["calibration"]["skipped"].dump().find("1 trials were delivered other than assigned") !=
        std::string::npos);
}

TEST_CASE("The audit report when every trial was delivered as assigned: as-treated is intent-to-treat",
          "[audit][analysis][delivery]") {
  AnalysisOptions options;
  options.bootstrap.resamples = 0;
  const auto report = analyze(replay(6), options);
  REQUIRE(report);
  CHECK(report.value().delivery.differing == 0);
  CHECK(report.value().as_treated.same_as_intent_to_treat);
  CHECK_FALSE(report.value().as_treated.biased);
  const json document = report_to_json(report.value());
  CHECK(document["delivery"]["differing"] == 0);
  CHECK(document["delivery"]["by_assigned"]["T3"]["assigned"] == 24);
  CHECK(document["delivery"]["by_assigned"]["T3"]["delivered_as_assigned"] == 24);
  CHECK(document["delivery"]["by_assigned"]["T3"]["delivered"] == json{{"T3", 24}});
  CHECK(document["delivery"]["by_assigned"]["T3"]["reasons"] == json::object());
  const auto& as_treated = document["as_treated"];
  CHECK(as_treated["same_as_intent_to_treat"] == true);
  CHECK(as_treated["biased"] == false);
  CHECK(as_treated["selection"] == json::array());
  CHECK_FALSE(as_treated.contains("strata"));  // not repeated: the top-level effects are the same
  CHECK_FALSE(as_treated.contains("overall"));
  CHECK_THAT(as_treated["note"].get<std::string>(), Catch::Contains("delivered as assigned"));
  const auto markdown = render_markdown(report.value());
  CHECK_THAT(markdown, Catch::Contains("## Intent-to-treat overall"));
  CHECK_THAT(markdown, Catch::Contains("0 trials were delivered other than assigned"));
  CHECK_THAT(markdown, Catch::Contains("the as-treated effects are the intent-to-treat effects"));
}

TEST_CASE("The audit report with trials delivered other than assigned: both readings, counts, selection check",
          "[audit][analysis][delivery]") {
  // T3 saves ~0.45 ms per token; in the long bucket the T3 lookups of the slowest contexts miss
  // (delivered T0, slower than any T0 trial there), one more misses in the short bucket, and a
  // T3 trial gets only the prompt span (a treatment nobody was assigned).
  auto trials = replay(7);
  int misses = 0;
  for (auto& trial : trials.trials) {
    if (trial.treatment != "T3") continue;
    if (trial.context_tokens >= 2000 || (trial.context_tokens == 32 && misses == 0)) {
      trial.delivered_treatment = "T0";
      trial.delivery_reason = misses % 2 == 0 ? "lookup_miss" : "";
      trial.ttft_ms = 5.0 + 0.5 * static_cast<double>(trial.context_tokens) + 200.0;
      ++misses;
    } else if (trial.context_tokens == 500) {
      trial.delivered_treatment = "T1";
      trial.delivery_reason = "span_refused";
    }
  }
  AnalysisOptions options;
  options.bootstrap.resamples = 100;
  const auto report = analyze(trials, options);
  REQUIRE(report);
  const json document = report_to_json(report.value());
  const auto& delivery = document["delivery"];
  CHECK(delivery["differing"] == misses + 2);
  const auto& t3 = delivery["by_assigned"]["T3"];
  CHECK(t3["assigned"] == 24);
  CHECK(t3["delivered_as_assigned"] == 24 - misses - 2);
  CHECK(t3["delivered"]["T0"] == misses);
  CHECK(t3["delivered"]["T1"] == 2);
  CHECK(t3["reasons"]["lookup_miss"] == (misses + 1) / 2);
  CHECK(t3["reasons"]["unspecified"] == misses / 2);
  CHECK(t3["reasons"]["span_refused"] == 2);
  CHECK(delivery["by_assigned"]["T0"]["delivered_as_assigned"] == 24);

  // Intent-to-treat stays by assigned treatment: the top-level effects compare T3 with T0 only.
  REQUIRE(document["overall"].size() == 1);
  CHECK(document["overall"][0]["treatment"] == "T3");
  CHECK(document["overall"][0]["n_treatment"] == 24);
  const auto& as_treated = document["as_treated"];
  CHECK(as_treated["same_as_intent_to_treat"] == false);
  REQUIRE(as_treated["strata"].size() == 3);
  REQUIRE(as_treated["overall"].size() == 2);  // T1 (delivered only) and T3 against T0
  CHECK(as_treated["overall"][0]["treatment"] == "T1");
  CHECK(as_treated["overall"][1]["treatment"] == "T3");
  CHECK(as_treated["overall"][1]["n_treatment"] == 24 - misses - 2);
  for (const char* key :
       {"treatment", "baseline", "n", "mean_diff_ms", "ci95", "p_value", "p_holm", "paired", "ci95_bootstrap"}) {
    INFO(key);
    CHECK(as_treated["overall"][1].contains(key));
  }
  // The pairs still hold where both arms were delivered: as-treated stays paired.
  CHECK(as_treated["overall"][1]["paired"] == true);
  // As-treated T3 is faster than ITT T3 in the long bucket (the missed, slow trials left it).
  CHECK(as_treated["strata"][2]["effects"][0]["mean_diff_ms"].get<double>() <
        document["strata"][2]["effects"][0]["mean_diff_ms"].get<double>());

  REQUIRE(as_treated["selection"].size() == 2);
  const auto& to_t0 = as_treated["selection"][0];
  CHECK(to_t0["treatment"] == "T3");
  CHECK(to_t0["delivered"] == "T0");
  CHECK(to_t0["n_selected"] == misses);
  CHECK(to_t0["n_reference"] == 24);
  CHECK(to_t0["mean_diff_ms"].get<double>() == Approx(200.0).margin(10.0));
  CHECK(to_t0["selection_p_value"].get<double>() < 0.001);
  CHECK(to_t0["selection_p_holm"].get<double>() < 0.05);
  CHECK(to_t0["biased"] == true);
  const auto& to_t1 = as_treated["selection"][1];
  CHECK(to_t1["delivered"] == "T1");
  CHECK(to_t1["n_reference"] == 0);  // nobody was assigned T1: nothing to compare with
  CHECK(to_t1["selection_p_value"].is_null());
  CHECK(to_t1["biased"] == false);
  CHECK(as_treated["biased"] == true);
  const auto note = as_treated["note"].get<std::string>();
  CHECK_THAT(note, Catch::Contains("as-treated estimate is likely biased"));
  CHECK_THAT(note, Catch::Contains("read the intent-to-treat effects"));
  CHECK_THAT(note, Catch::Contains("assigned T3 but delivered T0"));

  const auto markdown = render_markdown(report.value());
  const auto itt = markdown.find("## Intent-to-treat overall");
  const auto treated = markdown.find("## As-treated (by delivered treatment)");
  REQUIRE(itt != std::string::npos);
  REQUIRE(treated != std::string::npos);
  CHECK(itt < treated);  // intent-to-treat first
  CHECK_THAT(markdown, Catch::Contains(fmt::format("{} of 48 trials were delivered other than assigned", misses + 2)));
  CHECK_THAT(markdown, Catch::Contains("As-treated estimate biased: **likely**"));
  CHECK_THAT(markdown, Catch::Contains("## As-treated Stratum >=1024 stories->stories"));
  CHECK_THAT(markdown, Catch::Contains("| T3 | T0 |"));  // the selection check's row
}

TEST_CASE("The audit report does not flag non-delivery unrelated to the outcome", "[audit][analysis][delivery]") {
  // Misses spread over T3 trials whose outcome is exactly what T0 would have taken (plus the
  // same noise): the selection check finds nothing and as-treated recovers T3's own effect.
  auto trials = replay(8);
  std::mt19937_64 generator(8);
  std::normal_distribution<double> noise(0.0, 2.0);
  std::size_t index = 0;
  for (auto& trial : trials.trials) {
    if (trial.treatment != "T3" || index++ % 4 != 0) continue;
    trial.delivered_treatment = "T0";
    trial.delivery_reason = "lookup_miss";
    trial.ttft_ms = 5.0 + 0.5 * static_cast<double>(trial.context_tokens) + noise(generator);
  }
  AnalysisOptions options;
  options.bootstrap.resamples = 0;
  const auto report = analyze(trials, options);
  REQUIRE(report);
  const auto& as_treated = report.value().as_treated;
  REQUIRE(as_treated.selection.size() == 1);
  REQUIRE(as_treated.selection[0].test);
  CHECK(as_treated.selection[0].test->p_value > 0.05);
  CHECK_FALSE(as_treated.biased);
  CHECK_THAT(as_treated.note, Catch::Contains("no evidence that the as-treated estimate is biased"));
}
