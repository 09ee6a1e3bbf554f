#include "kvrelay/audit/statistics.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "kvrelay/audit/regression.h"

using namespace kvrelay::audit;

namespace {

// Student's sleep data (1908), R's datasets::sleep: extra hours of sleep under two drugs.
const std::vector<double> kSleepDrug1{0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0};
const std::vector<double> kSleepDrug2{1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4};
// Hollander & Wolfe (1973), p. 29: Hamilton depression scale before (y) and after (x) tranquilizer.
const std::vector<double> kDepressionX{1.83, 0.50, 1.62, 2.48, 1.68, 1.88, 1.55, 3.06, 1.30};
const std::vector<double> kDepressionY{0.878, 0.647, 0.598, 2.05, 1.06, 1.29, 1.06, 3.14, 1.29};

constexpr double kTolerance = 1e-6;

}  // namespace

// Expected values: tests/audit/expected_values.py (mpmath, 50 digits, independent of Boost);
// they agree with R's published output for these data sets (t.test(extra ~ group, sleep):
// t = -1.8608, df = 17.776, p = 0.07939, CI -3.3654832..0.2054832; paired: t = -4.0621,
// p = 0.002833, CI -2.4598858..-0.7001142; wilcox.test(x, y, paired = TRUE) on the
// depression data: V = 40, one-sided p = 0.01953).
TEST_CASE("Welch t-test matches independent values on the sleep data", "[audit][statistics]") {
  const auto result = welch_t_test(kSleepDrug2, kSleepDrug1);
  REQUIRE(result);
  CHECK(result->difference == Approx(1.58).margin(kTolerance));
  CHECK(result->t == Approx(1.86081346748685).margin(kTolerance));
  CHECK(result->degrees_of_freedom == Approx(17.7764735161785).margin(kTolerance));
  CHECK(result->p_value == Approx(0.0793941401873581).margin(kTolerance));
  CHECK(result->ci95.low == Approx(-0.205483230711711).margin(kTolerance));
  CHECK(result->ci95.high == Approx(3.36548323071171).margin(kTolerance));
}

// R: t.test(extra ~ group, sleep, var.equal = TRUE): t = -1.8608, df = 18, p = 0.07919,
// CI -3.363874..0.203874.
TEST_CASE("Student's pooled t-test matches independent values on the sleep data", "[audit][statistics]") {
  const auto result = student_t_test(kSleepDrug2, kSleepDrug1);
  REQUIRE(result);
  CHECK(result->difference == Approx(1.58).margin(kTolerance));
  CHECK(result->t == Approx(1.86081346748685).margin(kTolerance));
  CHECK(result->degrees_of_freedom == 18.0);
  CHECK(result->p_value == Approx(0.0791867142159381).margin(kTolerance));
  CHECK(result->ci95.low == Approx(-0.203874032287599).margin(kTolerance));
  CHECK(result->ci95.high == Approx(3.3638740322876).margin(kTolerance));
  // Unequal sizes, where pooling differs from Welch.
  const std::vector<double> first_four(kSleepDrug1.begin(), kSleepDrug1.begin() + 4);
  const auto unequal = student_t_test(kSleepDrug2, first_four);
  REQUIRE(unequal);
  CHECK(unequal->t == Approx(2.71375110624069).margin(kTolerance));
  CHECK(unequal->degrees_of_freedom == 12.0);
  CHECK(unequal->p_value == Approx(0.0188242652023611).margin(kTolerance));
  CHECK(unequal->ci95.low == Approx(0.572637516341216).margin(kTolerance));
  CHECK(unequal->ci95.high == Approx(5.23736248365878).margin(kTolerance));
  // One value in an arm is enough when the other has two (the variance comes from the pool).
  CHECK(student_t_test(std::vector<double>{1.0}, std::vector<double>{2.0, 3.0}));
  CHECK_FALSE(student_t_test(std::vector<double>{1.0}, std::vector<double>{2.0}));
}

TEST_CASE("Paired t-test matches independent values on the sleep data", "[audit][statistics]") {
  const auto result = paired_t_test(kSleepDrug2, kSleepDrug1);
  REQUIRE(result);
  CHECK(result->difference == Approx(1.58).margin(kTolerance));
  CHECK(result->t == Approx(4.06212768338204).margin(kTolerance));
  CHECK(result->degrees_of_freedom == 9.0);
  CHECK(result->p_value == Approx(0.00283289019738427).margin(kTolerance));
  CHECK(result->ci95.low == Approx(0.700114236723017).margin(kTolerance));
  CHECK(result->ci95.high == Approx(2.45988576327698).margin(kTolerance));

  const auto depression = paired_t_test(kDepressionX, kDepressionY);
  REQUIRE(depression);
  CHECK(depression->p_value == Approx(0.0161766274349081).margin(kTolerance));
  CHECK(depression->ci95.low == Approx(0.103778712272168).margin(kTolerance));
  CHECK(depression->ci95.high == Approx(0.759999065505609).margin(kTolerance));
}

TEST_CASE("Wilcoxon signed-rank: exact distribution without ties", "[audit][statistics]") {
  const auto result = wilcoxon_signed_rank(kDepressionX, kDepressionY);
  REQUIRE(result);
  CHECK(result->exact);
  CHECK(result->n == 9);
  CHECK(result->statistic == 5.0);
  CHECK(result->p_value == Approx(0.0390625).margin(kTolerance));  // 20 of 512 sign patterns, two-sided
}

TEST_CASE("Wilcoxon signed-rank: normal approximation with a zero and ties", "[audit][statistics]") {
  // The sleep differences contain one zero (dropped) and a tie, so the approximation applies.
  const auto result = wilcoxon_signed_rank(kSleepDrug2, kSleepDrug1);
  REQUIRE(result);
  CHECK_FALSE(result->exact);
  CHECK(result->n == 9);
  CHECK(result->statistic == 0.0);
  CHECK(result->p_value == Approx(0.00909069801592506).margin(kTolerance));
}

TEST_CASE("Wilcoxon signed-rank is symmetric and needs a non-zero pair", "[audit][statistics]") {
  const auto forward = wilcoxon_signed_rank(kDepressionX, kDepressionY);
  const auto backward = wilcoxon_signed_rank(kDepressionY, kDepressionX);
  REQUIRE(forward);
  REQUIRE(backward);
  CHECK(forward->p_value == backward->p_value);
  const std::vector<double> same{1.0, 2.0, 3.0};
  CHECK_FALSE(wilcoxon_signed_rank(same, same));
}

TEST_CASE("Holm adjustment by hand", "[audit][statistics]") {
  // Sorted: 0.005*4 = 0.02, 0.01*3 = 0.03, 0.03*2 = 0.06, 0.04*1 = 0.04 -> monotone 0.06.
  const std::vector<double> p{0.01, 0.04, 0.03, 0.005};
  const auto adjusted = holm_adjust(p);
  REQUIRE(adjusted.size() == 4);
  CHECK(adjusted[0] == Approx(0.03));
  CHECK(adjusted[1] == Approx(0.06));
  CHECK(adjusted[2] == Approx(0.06));
  CHECK(adjusted[3] == Approx(0.02));
  const std::vector<double> large{0.5, 0.9};
  CHECK(holm_adjust(large)[1] == 1.0);  // capped at 1
}

TEST_CASE("Quantiles interpolate between order statistics (type 7)", "[audit][statistics]") {
  const std::vector<double> values{4.0, 1.0, 3.0, 2.0};
  CHECK(median(values) == 2.5);
  CHECK(quantile(values, 0.0) == 1.0);
  CHECK(quantile(values, 1.0) == 4.0);
  CHECK(quantile(values, 0.99) == Approx(3.97));  // 1 + 0.99 * 3 = position 3.97
  CHECK(sample_variance(values) == Approx(5.0 / 3.0));
}

TEST_CASE("Degenerate samples give defined results and no exceptions", "[audit][statistics]") {
  const std::vector<double> one{1.0};
  const std::vector<double> flat{2.0, 2.0, 2.0};
  const std::vector<double> flat_higher{3.0, 3.0, 3.0};
  CHECK_FALSE(welch_t_test(one, flat));
  CHECK_FALSE(paired_t_test(one, one));
  const auto constant = welch_t_test(flat_higher, flat);
  REQUIRE(constant);
  CHECK(constant->difference == 1.0);
  CHECK(constant->p_value == 0.0);
  const auto none = welch_t_test(flat, flat);
  REQUIRE(none);
  CHECK(none->p_value == 1.0);
  CHECK(std::isnan(percent_change(1.0, 0.0)));
}

TEST_CASE("Bootstrap intervals are seeded and bracket the estimate and pairing narrows them", "[audit][statistics]") {
  // Contexts differ a lot; the treatment takes 10 off each one: pairs carry the information.
  std::vector<double> baseline;
  std::vector<double> treatment;
  for (int i = 0; i < 30; ++i) {
    baseline.push_back(100.0 + 37.0 * i + (i % 3));
    treatment.push_back(baseline.back() - 10.0 + (i % 5) * 0.5);
  }
  const BootstrapOptions options{1000, 7};
  const auto paired = bootstrap_paired(treatment, baseline, options);
  const auto again = bootstrap_paired(treatment, baseline, options);
  const auto unpaired = bootstrap_unpaired(treatment, baseline, options);
  REQUIRE(paired);
  REQUIRE(again);
  REQUIRE(unpaired);
  CHECK(paired->mean_difference.low == again->mean_difference.low);
  CHECK(paired->mean_difference.high == again->mean_difference.high);
  const double estimate = mean(treatment) - mean(baseline);
  CHECK(paired->mean_difference.low <= estimate);
  CHECK(paired->mean_difference.high >= estimate);
  CHECK(paired->mean_difference.high < 0.0);
  CHECK(unpaired->mean_difference.low < 0.0);
  CHECK(unpaired->mean_difference.high > 0.0);  // unpaired, the context spread hides the effect
  CHECK(paired->mean_difference.high - paired->mean_difference.low <
        0.1 * (unpaired->mean_difference.high - unpaired->mean_difference.low));
  CHECK(paired->median_difference.low <= paired->median_difference.high);
  CHECK(paired->p99_difference.low <= paired->p99_difference.high);
}

TEST_CASE("Least-squares fits", "[audit][statistics]") {
  const std::vector<double> x{0.0, 1.0, 2.0, 3.0};
  const std::vector<double> y{1.0, 3.0, 5.0, 7.0};
  const auto line = fit_line(x, y);
  REQUIRE(line);
  CHECK(line->intercept == Approx(1.0));
  CHECK(line->slope == Approx(2.0));
  std::vector<double> tokens;
  std::vector<double> seconds;
  for (double n = 64; n <= 4096; n *= 2) {
    tokens.push_back(n);
    seconds.push_back(0.01 + 2e-4 * n + 1e-8 * n * n);
  }
  const auto quadratic = fit_non_negative_quadratic(tokens, seconds);
  REQUIRE(quadratic);
  CHECK(quadratic->a == Approx(0.01).epsilon(1e-6));
  CHECK(quadratic->b == Approx(2e-4).epsilon(1e-6));
  CHECK(quadratic->c == Approx(1e-8).epsilon(1e-6));
  // A concave shape would need c < 0: the fit keeps every coefficient non-negative.
  const std::vector<double> concave{0.0, 5.0, 8.0, 9.0};
  const auto clamped = fit_non_negative_quadratic(x, concave);
  REQUIRE(clamped);
  CHECK(clamped->c >= 0.0);
  CHECK(clamped->b >= 0.0);
  CHECK(clamped->a >= 0.0);
}
