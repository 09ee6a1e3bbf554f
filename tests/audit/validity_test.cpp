// Statistical validity by simulation: audits with a known (planted) effect go through the same
// analyze() the CLI and the daemon use, and the intervals and tests must hold their nominal
// rates. 1,000 audits per check; with that many, a 95% coverage has a standard error of 0.7
// points, so the 93-97% band is about +-3 standard errors.

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <random>

#include "kvrelay/audit/analysis.h"

using namespace kvrelay::audit;

namespace {

constexpr int kAudits = 1000;

Trial make_trial(const std::string& treatment, std::uint64_t tokens, double ttft_ms,
                 std::optional<std::string> pair = std::nullopt) {
  Trial trial;
  trial.route = "a-to-b";
  trial.treatment = treatment;
  trial.context_tokens = tokens;
  trial.ttft_ms = ttft_ms;
  trial.pair_id = std::move(pair);
  return trial;
}

AnalysisOptions no_bootstrap() {
  AnalysisOptions options;
  options.bootstrap.resamples = 0;
  return options;
}

// Online design: independent trials, unequal variances (Welch's case).
TrialSet unpaired_audit(std::mt19937_64& generator, double effect_ms, int treatments = 1, int per_arm = 25) {
  std::normal_distribution<double> baseline(400.0, 60.0);
  std::normal_distribution<double> treated(400.0 + effect_ms, 25.0);
  TrialSet set;
  for (int i = 0; i < per_arm; ++i)
    set.trials.push_back(make_trial("T0", 512, baseline(generator)));
  for (int t = 1; t <= treatments; ++t) {
    for (int i = 0; i < per_arm; ++i)
      set.trials.push_back(make_trial(fmt::format("T{}", t), 512, treated(generator)));
  }
  return set;
}

// Offline design: every context under every treatment; contexts differ far more than the noise.
TrialSet paired_audit(std::mt19937_64& generator, double effect_ms, int treatments = 1, int contexts = 20) {
  std::normal_distribution<double> context_level(600.0, 200.0);
  std::normal_distribution<double> noise(0.0, 15.0);
  TrialSet set;
  for (int c = 0; c < contexts; ++c) {
    const double level = context_level(generator);
    const auto pair = fmt::format("ctx{}", c);
    set.trials.push_back(make_trial("T0", 2048, level + noise(generator), pair));
    for (int t = 1; t <= treatments; ++t) {
      set.trials.push_back(make_trial(fmt::format("T{}", t), 2048, level + effect_ms + noise(generator), pair));
    }
  }
  return set;
}

struct Rates {
  double coverage = 0.0;
  double rejection = 0.0;
  double wilcoxon_rejection = 0.0;
};

template <class MakeAudit>
Rates simulate(MakeAudit make_audit, double true_effect, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  int covered = 0;
  int rejected = 0;
  int wilcoxon_rejected = 0;
  for (int audit = 0; audit < kAudits; ++audit) {
    const auto report = analyze(make_audit(generator), no_bootstrap());
    REQUIRE(report);
    REQUIRE(report.value().overall.size() == 1);
    const auto& effect = report.value().overall[0];
    REQUIRE(effect.t_test);
    if (effect.t_test->ci95.low <= true_effect && true_effect <= effect.t_test->ci95.high) ++covered;
    if (effect.t_test->p_value < 0.05) ++rejected;
    if (effect.wilcoxon && effect.wilcoxon->p_value < 0.05) ++wilcoxon_rejected;
  }
  return {covered / double(kAudits), rejected / double(kAudits), wilcoxon_rejected / double(kAudits)};
}

}  // namespace

TEST_CASE("Welch design: 95% CIs cover a planted effect in 93-97% of audits", "[audit][validity]") {
  const auto rates = simulate([](auto& g) { return unpaired_audit(g, -50.0); }, -50.0, 11);
  INFO("coverage " << rates.coverage << ", power " << rates.rejection);
  CHECK(rates.coverage >= 0.93);
  CHECK(rates.coverage <= 0.97);
  CHECK(rates.rejection > 0.9);  // the planted effect is found
}

TEST_CASE("Welch design: false-positive rate at 0.05 is 3-7% with no effect", "[audit][validity]") {
  const auto rates = simulate([](auto& g) { return unpaired_audit(g, 0.0); }, 0.0, 12);
  INFO("false positives " << rates.rejection);
  CHECK(rates.rejection >= 0.03);
  CHECK(rates.rejection <= 0.07);
}

TEST_CASE("Paired design: 95% CIs cover a planted effect in 93-97% of audits", "[audit][validity]") {
  const auto rates = simulate([](auto& g) { return paired_audit(g, -20.0); }, -20.0, 13);
  INFO("coverage " << rates.coverage << ", power " << rates.rejection);
  CHECK(rates.coverage >= 0.93);
  CHECK(rates.coverage <= 0.97);
  CHECK(rates.rejection > 0.9);
}

TEST_CASE("Paired design: t and Wilcoxon false-positive rates are 3-7% with no effect", "[audit][validity]") {
  const auto rates = simulate([](auto& g) { return paired_audit(g, 0.0); }, 0.0, 14);
  INFO("t false positives " << rates.rejection << ", Wilcoxon " << rates.wilcoxon_rejection);
  CHECK(rates.rejection >= 0.03);
  CHECK(rates.rejection <= 0.07);
  CHECK(rates.wilcoxon_rejection >= 0.03);
  CHECK(rates.wilcoxon_rejection <= 0.07);
}

TEST_CASE("Stratified overall effect: CIs cover the size-weighted effect in 93-97% of audits", "[audit][validity]") {
  // Short contexts: no effect, 30 trials per arm; long contexts: -90 ms, 10 per arm. The
  // overall effect weights strata by size: (60 * 0 + 20 * -90) / 80 = -22.5 ms.
  const double true_effect = -22.5;
  const auto make = [](std::mt19937_64& generator) {
    std::normal_distribution<double> short_ttft(50.0, 10.0);
    std::normal_distribution<double> long_ttft(900.0, 80.0);
    TrialSet set;
    for (int i = 0; i < 30; ++i) {
      set.trials.push_back(make_trial("T0", 100, short_ttft(generator)));
      set.trials.push_back(make_trial("T3", 100, short_ttft(generator)));
    }
    for (int i = 0; i < 10; ++i) {
      set.trials.push_back(make_trial("T0", 2000, long_ttft(generator)));
      set.trials.push_back(make_trial("T3", 2000, long_ttft(generator) - 90.0));
    }
    return set;
  };
  const auto rates = simulate(make, true_effect, 15);
  INFO("coverage " << rates.coverage);
  CHECK(rates.coverage >= 0.93);
  CHECK(rates.coverage <= 0.97);
}

TEST_CASE("Holm keeps the family-wise error rate at or below 0.05", "[audit][validity]") {
  // Four null treatments against one baseline per family, 1,000 families, both designs.
  // Unadjusted, the chance of at least one false positive is far above 0.05; Holm's must not be.
  for (const bool paired : {false, true}) {
    std::mt19937_64 generator(paired ? 17 : 16);
    int any_raw = 0;
    int any_holm = 0;
    for (int family = 0; family < kAudits; ++family) {
      const auto trials = paired ? paired_audit(generator, 0.0, 4) : unpaired_audit(generator, 0.0, 4);
      const auto report = analyze(trials, no_bootstrap());
      REQUIRE(report);
      REQUIRE(report.value().overall.size() == 4);
      bool raw = false;
      bool holm = false;
      for (const auto& effect : report.value().overall) {
        raw = raw || effect.t_test->p_value < 0.05;
        holm = holm || *effect.p_holm < 0.05;
      }
      any_raw += raw ? 1 : 0;
      any_holm += holm ? 1 : 0;
    }
    const double raw_rate = any_raw / double(kAudits);
    const double holm_rate = any_holm / double(kAudits);
    INFO((paired ? "paired" : "Welch") << ": family-wise error unadjusted " << raw_rate << ", Holm " << holm_rate);
    CHECK(raw_rate > 0.075);  // 3.5 standard errors above the nominal 0.05
    CHECK(holm_rate <= 0.05);
  }
}
