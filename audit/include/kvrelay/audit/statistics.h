#pragma once

// The statistics an audit reports, on plain vectors of milliseconds. Distributions come from
// Boost.Math (Student's t, normal) with a policy that reports domain problems as NaN instead of
// throwing, so degenerate samples (n < 2, zero variance) give a defined result, never an
// exception on the data path. Every two-sample figure is treatment minus baseline.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <vector>

namespace kvrelay::audit {

struct Interval {
  double low = 0.0;
  double high = 0.0;
};

struct TTestResult {
  double difference = 0.0;  // mean(treatment) - mean(baseline), or mean of paired differences
  double standard_error = 0.0;
  double degrees_of_freedom = 0.0;
  double t = 0.0;
  double p_value = 1.0;  // two-sided
  Interval ci95;
};

struct WilcoxonResult {
  double statistic = 0.0;  // min(W+, W-), the two-sided statistic scipy reports
  double p_value = 1.0;    // two-sided
  std::size_t n = 0;       // non-zero differences used
  bool exact = false;      // exact null distribution (no ties, no zeros, n <= 50) or normal approximation
};

[[nodiscard]] double mean(std::span<const double> values);
// Sample variance (n - 1 in the denominator); 0 for fewer than two values.
[[nodiscard]] double sample_variance(std::span<const double> values);
// Linear interpolation between order statistics (Hyndman-Fan type 7, numpy's default).
[[nodiscard]] double quantile(std::span<const double> values, double probability);
[[nodiscard]] double median(std::span<const double> values);

// Welch's unequal-variance t-test with its 95% confidence interval (Welch-Satterthwaite df).
// Needs two values per arm; otherwise nullopt.
[[nodiscard]] std::optional<TTestResult> welch_t_test(std::span<const double> treatment,
                                                      std::span<const double> baseline);
// Student's two-sample t-test with the pooled variance (df = n1 + n2 - 2). Exact under normal
// errors when both arms share one variance, as they do under the hypothesis that they are
// samples of one population (the as-treated selection check); needs one value per arm and three
// in all, otherwise nullopt.
[[nodiscard]] std::optional<TTestResult> student_t_test(std::span<const double> treatment,
                                                        std::span<const double> baseline);
// Paired t-test on treatment[i] - baseline[i]; needs two pairs and equal lengths.
[[nodiscard]] std::optional<TTestResult> paired_t_test(std::span<const double> treatment,
                                                       std::span<const double> baseline);
// A t-based estimate from an arbitrary difference, standard error and df (stratified effects).
[[nodiscard]] TTestResult t_test_from(double difference, double standard_error, double degrees_of_freedom);

// Wilcoxon signed-rank test on treatment[i] - baseline[i]. Zero differences are dropped
// (Wilcoxon's method); exact when n <= 50 with no ties, else the normal approximation with the
// tie correction of the variance and a continuity correction. nullopt without a non-zero pair.
[[nodiscard]] std::optional<WilcoxonResult> wilcoxon_signed_rank(std::span<const double> treatment,
                                                                 std::span<const double> baseline);

// Holm's step-down adjustment; returns adjusted p-values in the input order.
[[nodiscard]] std::vector<double> holm_adjust(std::span<const double> p_values);

// One bootstrap draw of the difference (treatment - baseline) in mean, median and p99. Paired
// draws resample pair indices (both spans the same length); unpaired ones each arm on its own.
struct DifferenceDraw {
  double mean = 0.0;
  double median = 0.0;
  double p99 = 0.0;
};
[[nodiscard]] DifferenceDraw draw_difference(std::span<const double> treatment, std::span<const double> baseline,
                                             bool paired, std::mt19937_64& generator);

// 95% percentile interval of bootstrap draws (sorts them).
[[nodiscard]] Interval percentile_interval(std::vector<double>& draws);

// Percentile bootstrap intervals (95%) of the difference in mean, median and 99th percentile.
struct BootstrapResult {
  Interval mean_difference;
  Interval median_difference;
  Interval p99_difference;
  std::size_t resamples = 0;
};
struct BootstrapOptions {
  std::size_t resamples = 2000;
  std::uint64_t seed = 1;
};
// Unpaired: each arm resampled with replacement on its own.
[[nodiscard]] std::optional<BootstrapResult> bootstrap_unpaired(std::span<const double> treatment,
                                                                std::span<const double> baseline,
                                                                const BootstrapOptions& options);
// Paired: pair indices resampled, so each resample keeps the pairs together.
[[nodiscard]] std::optional<BootstrapResult> bootstrap_paired(std::span<const double> treatment,
                                                              std::span<const double> baseline,
                                                              const BootstrapOptions& options);

// 100 * difference / baseline mean; NaN when the baseline mean is 0.
[[nodiscard]] double percent_change(double difference, double baseline_mean);

}  // namespace kvrelay::audit
