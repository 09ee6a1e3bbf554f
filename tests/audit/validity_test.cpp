// Statistical validity by simulation: audits with a known (planted) effect go through the same
// analyze() the CLI and the daemon use, and the intervals and tests must hold their nominal
// rates. 1,000 audits per check; with that many, a 95% coverage has a standard error of 0.7
// points, so the 93-97% band is about +-3 standard errors.

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

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

// Treatments as delivered (issue #28). What a trial is delivered can differ from what it was
// assigned: a T3 lookup misses and the receiver re-prefills (delivered T0). Intent-to-treat
// compares the randomized arms, so it estimates the effect of *assigning* T3 (the planted effect
// times the delivery probability) whatever causes non-delivery; as-treated compares what was
// delivered and recovers the planted effect only when non-delivery is independent of the outcome.
// The selection check (trials assigned T3 but delivered T0 against trials assigned T0) detects
// the dependent case and flags as-treated as biased.

namespace {

// How non-delivery of the treated arms happens in a simulated audit.
enum class Delivery {
  kAll,          // every trial delivered as assigned
  kIndependent,  // each treated trial delivered T0 with probability 0.2, at random
  kSlowestFail,  // the treated trials with the largest latent noise (its top 20%) deliver T0
};

// Online design in two length strata (different latency levels, the same planted effect):
// 25 trials per arm and stratum, every outcome level + effect x delivered + 40 ms x latent
// noise (one noise scale for every arm, so the intent-to-treat effect is exactly the planted
// effect times the delivery probability).
TrialSet delivery_audit(std::mt19937_64& generator, double effect_ms, Delivery delivery, int treatments = 1,
                        int per_arm = 25) {
  std::normal_distribution<double> noise(0.0, 1.0);
  std::bernoulli_distribution misses(0.2);
  TrialSet set;
  for (const auto& [tokens, level] : {std::pair<std::uint64_t, double>{512, 400.0}, {2048, 900.0}}) {
    for (int i = 0; i < per_arm; ++i)
      set.trials.push_back(make_trial("T0", tokens, level + 40.0 * noise(generator)));
    for (int t = 1; t <= treatments; ++t) {
      std::vector<double> latent(static_cast<std::size_t>(per_arm));
      for (auto& value : latent)
        value = noise(generator);
      std::vector<bool> delivered(latent.size(), true);
      if (delivery == Delivery::kIndependent) {
        for (std::size_t i = 0; i < delivered.size(); ++i)
          delivered[i] = !misses(generator);
      } else if (delivery == Delivery::kSlowestFail) {
        // Above the noise distribution's 80th percentile: P(fail) = 0.2 per trial, independently
        // across trials (a fixed top fifth per audit would make the ITT arm's spread partly
        // deterministic and its CIs conservative), but entirely decided by the outcome's noise.
        constexpr double kEightiethPercentile = 0.8416212335729143;
        for (std::size_t i = 0; i < delivered.size(); ++i)
          delivered[i] = latent[i] <= kEightiethPercentile;
      }
      for (std::size_t i = 0; i < latent.size(); ++i) {
        auto trial =
            make_trial(fmt::format("T{}", t), tokens, level + (delivered[i] ? effect_ms : 0.0) + 40.0 * latent[i]);
        if (!delivered[i]) {
          trial.delivered_treatment = "T0";
          trial.delivery_reason = "lookup_miss";
        }
        set.trials.push_back(std::move(trial));
      }
    }
  }
  return set;
}

bool covers(const Effect& effect, double truth) {
  return effect.t_test && effect.t_test->ci95.low <= truth && truth <= effect.t_test->ci95.high;
}

struct DeliveryRates {
  double itt_coverage = 0.0;
  double as_treated_coverage = 0.0;
  double itt_rejection = 0.0;
  double as_treated_rejection = 0.0;
  double biased = 0.0;
};

DeliveryRates simulate_delivery(double effect_ms, Delivery delivery, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  const double itt_truth = delivery == Delivery::kAll ? effect_ms : 0.8 * effect_ms;
  int itt_covered = 0, as_treated_covered = 0, itt_rejected = 0, as_treated_rejected = 0, biased = 0;
  for (int audit = 0; audit < kAudits; ++audit) {
    const auto report = analyze(delivery_audit(generator, effect_ms, delivery), no_bootstrap());
    REQUIRE(report);
    REQUIRE(report.value().overall.size() == 1);
    const auto& itt = report.value().overall[0];
    const auto& as_treated = report.value().as_treated;
    REQUIRE_FALSE(as_treated.same_as_intent_to_treat);
    REQUIRE(as_treated.overall.size() == 1);
    itt_covered += covers(itt, itt_truth) ? 1 : 0;
    as_treated_covered += covers(as_treated.overall[0], effect_ms) ? 1 : 0;
    itt_rejected += itt.t_test->p_value < 0.05 ? 1 : 0;
    as_treated_rejected += as_treated.overall[0].t_test->p_value < 0.05 ? 1 : 0;
    biased += as_treated.biased ? 1 : 0;
  }
  const auto rate = [](int count) { return count / double(kAudits); };
  return {rate(itt_covered), rate(as_treated_covered), rate(itt_rejected), rate(as_treated_rejected), rate(biased)};
}

}  // namespace

TEST_CASE("Simulated audits with non-delivery independent of the outcome: ITT and as-treated CIs cover their effects",
          "[audit][validity][delivery]") {
  // 20% of T3 trials delivered T0 at random: ITT = 0.8 x -60 = -48 ms, as-treated = -60 ms.
  const auto rates = simulate_delivery(-60.0, Delivery::kIndependent, 21);
  INFO("ITT coverage " << rates.itt_coverage << ", as-treated coverage " << rates.as_treated_coverage
                       << ", bias flagged " << rates.biased);
  CHECK(rates.itt_coverage >= 0.93);
  CHECK(rates.itt_coverage <= 0.97);
  CHECK(rates.as_treated_coverage >= 0.93);
  CHECK(rates.as_treated_coverage <= 0.97);
  // The non-delivered trials are a random sample of the T0 population: the selection check
  // fires at its nominal 5% (8% is 3.9 standard errors of a 5% rate over 1,000 audits).
  CHECK(rates.biased <= 0.08);
}

TEST_CASE(
    "Simulated audits whose slowest treated trials go undelivered: ITT still covers, as-treated is flagged biased",
    "[audit][validity][delivery]") {
  const auto rates = simulate_delivery(-60.0, Delivery::kSlowestFail, 22);
  INFO("ITT coverage " << rates.itt_coverage << ", as-treated coverage " << rates.as_treated_coverage
                       << ", bias flagged " << rates.biased);
  CHECK(rates.itt_coverage >= 0.93);
  CHECK(rates.itt_coverage <= 0.97);
  // The as-treated estimate really is biased here (the slow fifth moves from the T3 arm to the
  // T0 arm: both arms' means shift apart), so its CIs miss the planted effect most of the time...
  CHECK(rates.as_treated_coverage < 0.5);
  // ...and the report says so. The non-delivered trials sit 1.4 noise SDs (56 ms) above the T0
  // mean (the mean of a normal's top fifth), about 5 per stratum against 25 reference trials:
  // combined over the two strata t is about 4, power about 98%. Measured 98.9-99.9% over ten
  // seeds; 95% is the bound.
  CHECK(rates.biased >= 0.95);
}

TEST_CASE("Simulated audits with non-delivery and no effect: false positives per comparison 3-7%, ITT and as-treated",
          "[audit][validity][delivery]") {
  const auto rates = simulate_delivery(0.0, Delivery::kIndependent, 23);
  INFO("false positives: ITT " << rates.itt_rejection << ", as-treated " << rates.as_treated_rejection
                               << ", bias flagged " << rates.biased);
  CHECK(rates.itt_rejection >= 0.03);
  CHECK(rates.itt_rejection <= 0.07);
  CHECK(rates.as_treated_rejection >= 0.03);
  CHECK(rates.as_treated_rejection <= 0.07);
  CHECK(rates.biased <= 0.08);
}

TEST_CASE("Simulated audits with non-delivery and several null treatments: Holm keeps the family-wise rates at 0.05",
          "[audit][validity][delivery]") {
  // Four null treatments, each delivered T0 20% of the time at random, 1,000 families: Holm's
  // family-wise error for ITT and as-treated effects and for the selection checks (the bias
  // flag: four checks sharing one reference arm) stays at 0.05. For nearly independent tests
  // Holm's rate is just under 0.05 (Bonferroni's 1 - (1 - 0.05/4)^4 = 0.049; over 10,000
  // families: ITT 4.3%, as-treated 4.85%, flag 4.8%), so a 1,000-family estimate of it exceeds
  // 0.05 about as often as not: the bound is 0.05 plus 1.65 standard errors (one-sided 95%),
  // still far below the unadjusted rate.
  std::mt19937_64 generator(24);
  int itt_raw = 0, itt_holm = 0, as_treated_holm = 0, flagged = 0;
  for (int family = 0; family < kAudits; ++family) {
    const auto report = analyze(delivery_audit(generator, 0.0, Delivery::kIndependent, 4, 20), no_bootstrap());
    REQUIRE(report);
    REQUIRE(report.value().overall.size() == 4);
    REQUIRE(report.value().as_treated.overall.size() == 4);
    const auto any = [](const std::vector<Effect>& effects, bool adjusted) {
      return std::any_of(effects.begin(), effects.end(), [&](const Effect& effect) {
        return (adjusted ? *effect.p_holm : effect.t_test->p_value) < 0.05;
      });
    };
    itt_raw += any(report.value().overall, false) ? 1 : 0;
    itt_holm += any(report.value().overall, true) ? 1 : 0;
    as_treated_holm += any(report.value().as_treated.overall, true) ? 1 : 0;
    flagged += report.value().as_treated.biased ? 1 : 0;
  }
  const auto rate = [](int count) { return count / double(kAudits); };
  INFO("family-wise: ITT unadjusted " << rate(itt_raw) << ", ITT Holm " << rate(itt_holm) << ", as-treated Holm "
                                      << rate(as_treated_holm) << ", bias flag " << rate(flagged));
  const double bound = 0.05 + 1.65 * std::sqrt(0.05 * 0.95 / kAudits);  // 0.061
  CHECK(rate(itt_raw) > 0.075);
  // The primary (intent-to-treat) family meets the issue's <= 5% on this seed (4.6%); the
  // secondary analyses get the Monte Carlo allowance above.
  CHECK(rate(itt_holm) <= 0.05);
  CHECK(rate(as_treated_holm) <= bound);
  CHECK(rate(flagged) <= bound);
}

TEST_CASE("Paired audits with non-delivery: as-treated keeps the pairs that still hold and covers",
          "[audit][validity][delivery]") {
  // Offline design: each context under T0 and T1; a T1 lookup misses 20% of the time at random,
  // its pair then has no T1 arm and drops out of the as-treated comparison, which stays paired.
  std::mt19937_64 generator(25);
  int itt_covered = 0, as_treated_covered = 0, as_treated_paired = 0, flagged = 0;
  for (int audit = 0; audit < kAudits; ++audit) {
    auto trials = paired_audit(generator, -20.0, 1, 30);
    std::bernoulli_distribution misses(0.2);
    for (auto& trial : trials.trials) {
      if (trial.treatment != "T1" || !misses(generator)) continue;
      trial.ttft_ms += 20.0;  // re-prefilled: no effect
      trial.delivered_treatment = "T0";
    }
    const auto report = analyze(trials, no_bootstrap());
    REQUIRE(report);
    const auto& as_treated = report.value().as_treated;
    // With no miss at all (0.8^30, about 1 audit in 800) as-treated is the ITT comparison.
    const auto& effect = as_treated.same_as_intent_to_treat ? report.value().overall[0] : as_treated.overall.at(0);
    as_treated_covered += covers(effect, -20.0) ? 1 : 0;
    as_treated_paired += effect.paired ? 1 : 0;
    flagged += as_treated.biased ? 1 : 0;
    // ITT: each pair's difference is -20 ms (delivered) or 0 (missed) plus noise, independent
    // across pairs with mean 0.8 x -20 = -16 ms.
    itt_covered += covers(report.value().overall[0], -16.0) ? 1 : 0;
  }
  const auto rate = [](int count) { return count / double(kAudits); };
  INFO("paired: ITT coverage " << rate(itt_covered) << ", as-treated coverage " << rate(as_treated_covered)
                               << ", as-treated paired " << rate(as_treated_paired) << ", bias flagged "
                               << rate(flagged));
  CHECK(rate(itt_covered) >= 0.93);
  CHECK(rate(itt_covered) <= 0.97);
  CHECK(rate(as_treated_covered) >= 0.93);
  CHECK(rate(as_treated_covered) <= 0.97);
  CHECK(as_treated_paired == kAudits);
  CHECK(rate(flagged) <= 0.08);  // the paired selection check at its nominal rate
}
