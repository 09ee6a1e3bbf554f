#include "kvrelay/audit/statistics.h"

#include <boost/math/distributions/normal.hpp>
#include <boost/math/distributions/students_t.hpp>
#include <boost/math/policies/policy.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>

namespace kvrelay::audit {

namespace {

namespace bm = boost::math;
// Domain and evaluation problems become NaN (errno set) instead of exceptions.
using NoThrowPolicy = bm::policies::policy<bm::policies::domain_error<bm::policies::errno_on_error>,
                                           bm::policies::pole_error<bm::policies::errno_on_error>,
                                           bm::policies::overflow_error<bm::policies::errno_on_error>,
                                           bm::policies::evaluation_error<bm::policies::errno_on_error>>;
using StudentsT = bm::students_t_distribution<double, NoThrowPolicy>;
using Normal = bm::normal_distribution<double, NoThrowPolicy>;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kConfidence = 0.95;

double sorted_quantile(const std::vector<double>& sorted, double probability) {
  if (sorted.empty()) return kNaN;
  const double position = probability * static_cast<double>(sorted.size() - 1);
  const auto below = static_cast<std::size_t>(std::floor(position));
  const std::size_t above = std::min(below + 1, sorted.size() - 1);
  const double fraction = position - static_cast<double>(below);
  return sorted[below] + fraction * (sorted[above] - sorted[below]);
}

}  // namespace

Interval percentile_interval(std::vector<double>& draws) {
  std::sort(draws.begin(), draws.end());
  const double tail = (1.0 - kConfidence) / 2.0;
  return {sorted_quantile(draws, tail), sorted_quantile(draws, 1.0 - tail)};
}

namespace {

struct Summary {
  double mean = 0.0;
  double median = 0.0;
  double p99 = 0.0;
};

Summary summarize(std::vector<double>& values) {
  std::sort(values.begin(), values.end());
  return {mean(values), sorted_quantile(values, 0.5), sorted_quantile(values, 0.99)};
}

// Number of subsets of {1..n} with each rank sum: the exact null distribution of W+.
std::vector<double> signed_rank_counts(std::size_t n) {
  const std::size_t max_sum = n * (n + 1) / 2;
  std::vector<double> counts(max_sum + 1, 0.0);
  counts[0] = 1.0;
  for (std::size_t rank = 1; rank <= n; ++rank) {
    for (std::size_t sum = max_sum; sum >= rank; --sum) {
      counts[sum] += counts[sum - rank];
    }
  }
  return counts;
}

}  // namespace

double mean(std::span<const double> values) {
  if (values.empty()) return kNaN;
  return std::accumulate(values.begin(), values.end(), 0.0) / static_cast<double>(values.size());
}

double sample_variance(std::span<const double> values) {
  if (values.size() < 2) return 0.0;
  const double center = mean(values);
  double sum = 0.0;
  for (const double value : values)
    sum += (value - center) * (value - center);
  return sum / static_cast<double>(values.size() - 1);
}

double quantile(std::span<const double> values, double probability) {
  std::vector<double> sorted(values.begin(), values.end());
  std::sort(sorted.begin(), sorted.end());
  return sorted_quantile(sorted, probability);
}

double median(std::span<const double> values) {
  return quantile(values, 0.5);
}

TTestResult t_test_from(double difference, double standard_error, double degrees_of_freedom) {
  TTestResult result;
  result.difference = difference;
  result.standard_error = standard_error;
  result.degrees_of_freedom = degrees_of_freedom;
  if (!(standard_error > 0.0) || !(degrees_of_freedom > 0.0) || !std::isfinite(standard_error)) {
    // No spread: the difference is known exactly (or not at all).
    result.t = difference == 0.0 ? 0.0 : std::copysign(std::numeric_limits<double>::infinity(), difference);
    result.p_value = difference == 0.0 ? 1.0 : 0.0;
    result.ci95 = {difference, difference};
    return result;
  }
  const StudentsT distribution(degrees_of_freedom);
  result.t = difference / standard_error;
  result.p_value = std::min(1.0, 2.0 * bm::cdf(bm::complement(distribution, std::fabs(result.t))));
  const double critical = bm::quantile(bm::complement(distribution, (1.0 - kConfidence) / 2.0));
  result.ci95 = {difference - critical * standard_error, difference + critical * standard_error};
  return result;
}

std::optional<TTestResult> welch_t_test(std::span<const double> treatment, std::span<const double> baseline) {
  if (treatment.size() < 2 || baseline.size() < 2) return std::nullopt;
  const double n_treatment = static_cast<double>(treatment.size());
  const double n_baseline = static_cast<double>(baseline.size());
  const double share_treatment = sample_variance(treatment) / n_treatment;
  const double share_baseline = sample_variance(baseline) / n_baseline;
  const double variance = share_treatment + share_baseline;
  const double df =
      variance * variance /
      (share_treatment * share_treatment / (n_treatment - 1.0) + share_baseline * share_baseline / (n_baseline - 1.0));
  return t_test_from(mean(treatment) - mean(baseline), std::sqrt(variance), df);
}

std::optional<TTestResult> student_t_test(std::span<const double> treatment, std::span<const double> baseline) {
  if (treatment.empty() || baseline.empty() || treatment.size() + baseline.size() < 3) return std::nullopt;
  const double n_treatment = static_cast<double>(treatment.size());
  const double n_baseline = static_cast<double>(baseline.size());
  const double df = n_treatment + n_baseline - 2.0;
  const double pooled =
      ((n_treatment - 1.0) * sample_variance(treatment) + (n_baseline - 1.0) * sample_variance(baseline)) / df;
  return t_test_from(mean(treatment) - mean(baseline), std::sqrt(pooled * (1.0 / n_treatment + 1.0 / n_baseline)), df);
}

std::optional<TTestResult> paired_t_test(std::span<const double> treatment, std::span<const double> baseline) {
  if (treatment.size() != baseline.size() || treatment.size() < 2) return std::nullopt;
  std::vector<double> differences(treatment.size());
  for (std::size_t i = 0; i < treatment.size(); ++i)
    differences[i] = treatment[i] - baseline[i];
  const double n = static_cast<double>(differences.size());
  return t_test_from(mean(differences), std::sqrt(sample_variance(differences) / n), n - 1.0);
}

std::optional<WilcoxonResult> wilcoxon_signed_rank(std::span<const double> treatment,
                                                   std::span<const double> baseline) {
  if (treatment.size() != baseline.size()) return std::nullopt;
  std::vector<double> differences;
  for (std::size_t i = 0; i < treatment.size(); ++i) {
    const double difference = treatment[i] - baseline[i];
    if (difference != 0.0) differences.push_back(difference);
  }
  const std::size_t n = differences.size();
  if (n == 0) return std::nullopt;
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return std::fabs(differences[a]) < std::fabs(differences[b]); });
  // Mid-ranks for ties; the tie groups also correct the normal approximation's variance.
  std::vector<double> ranks(n);
  double tie_term = 0.0;
  for (std::size_t start = 0; start < n;) {
    std::size_t end = start + 1;
    while (end < n && std::fabs(differences[order[end]]) == std::fabs(differences[order[start]]))
      ++end;
    const double mid_rank = (static_cast<double>(start + 1) + static_cast<double>(end)) / 2.0;
    for (std::size_t k = start; k < end; ++k)
      ranks[order[k]] = mid_rank;
    const double group = static_cast<double>(end - start);
    tie_term += group * (group * group - 1.0);
    start = end;
  }
  double w_plus = 0.0;
  double w_minus = 0.0;
  for (std::size_t i = 0; i < n; ++i)
    (differences[i] > 0.0 ? w_plus : w_minus) += ranks[i];
  WilcoxonResult result;
  result.n = n;
  result.statistic = std::min(w_plus, w_minus);
  const double count = static_cast<double>(n);
  if (n <= 50 && tie_term == 0.0) {
    result.exact = true;
    const auto counts = signed_rank_counts(n);
    const double total = std::ldexp(1.0, static_cast<int>(n));
    const auto statistic = static_cast<std::size_t>(result.statistic);
    double lower_tail = 0.0;  // P(W <= statistic); by symmetry equal to the upper tail of max(W+, W-)
    for (std::size_t sum = 0; sum <= statistic; ++sum)
      lower_tail += counts[sum];
    result.p_value = std::min(1.0, 2.0 * lower_tail / total);
    return result;
  }
  const double expected = count * (count + 1.0) / 4.0;
  const double variance = (count * (count + 1.0) * (2.0 * count + 1.0) - tie_term / 2.0) / 24.0;
  if (!(variance > 0.0)) {
    result.p_value = 1.0;
    return result;
  }
  const double distance = result.statistic - expected;
  const double continuity = distance > 0.0 ? 0.5 : (distance < 0.0 ? -0.5 : 0.0);
  const double z = (distance - continuity) / std::sqrt(variance);
  const Normal standard_normal(0.0, 1.0);
  result.p_value = std::min(1.0, 2.0 * bm::cdf(bm::complement(standard_normal, std::fabs(z))));
  return result;
}

std::vector<double> holm_adjust(std::span<const double> p_values) {
  const std::size_t m = p_values.size();
  std::vector<std::size_t> order(m);
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return p_values[a] < p_values[b]; });
  std::vector<double> adjusted(m);
  double running_max = 0.0;
  for (std::size_t k = 0; k < m; ++k) {
    const double scaled = std::min(1.0, static_cast<double>(m - k) * p_values[order[k]]);
    running_max = std::max(running_max, scaled);
    adjusted[order[k]] = running_max;
  }
  return adjusted;
}

DifferenceDraw draw_difference(std::span<const double> treatment, std::span<const double> baseline, bool paired,
                               std::mt19937_64& generator) {
  std::vector<double> resampled_treatment(treatment.size());
  std::vector<double> resampled_baseline(baseline.size());
  if (paired) {
    std::uniform_int_distribution<std::size_t> pick(0, treatment.size() - 1);
    for (std::size_t i = 0; i < treatment.size(); ++i) {
      const std::size_t index = pick(generator);
      resampled_treatment[i] = treatment[index];
      resampled_baseline[i] = baseline[index];
    }
  } else {
    std::uniform_int_distribution<std::size_t> pick_treatment(0, treatment.size() - 1);
    std::uniform_int_distribution<std::size_t> pick_baseline(0, baseline.size() - 1);
    for (auto& value : resampled_treatment)
      value = treatment[pick_treatment(generator)];
    for (auto& value : resampled_baseline)
      value = baseline[pick_baseline(generator)];
  }
  const auto t = summarize(resampled_treatment);
  const auto b = summarize(resampled_baseline);
  return {t.mean - b.mean, t.median - b.median, t.p99 - b.p99};
}

namespace {

std::optional<BootstrapResult> bootstrap(std::span<const double> treatment, std::span<const double> baseline,
                                         bool paired, const BootstrapOptions& options) {
  if (treatment.empty() || baseline.empty() || options.resamples == 0) return std::nullopt;
  if (paired && treatment.size() != baseline.size()) return std::nullopt;
  std::mt19937_64 generator(options.seed);
  std::vector<double> mean_draws, median_draws, p99_draws;
  mean_draws.reserve(options.resamples);
  median_draws.reserve(options.resamples);
  p99_draws.reserve(options.resamples);
  for (std::size_t round = 0; round < options.resamples; ++round) {
    const auto draw = draw_difference(treatment, baseline, paired, generator);
    mean_draws.push_back(draw.mean);
    median_draws.push_back(draw.median);
    p99_draws.push_back(draw.p99);
  }
  return BootstrapResult{percentile_interval(mean_draws), percentile_interval(median_draws),
                         percentile_interval(p99_draws), options.resamples};
}

}  // namespace

std::optional<BootstrapResult> bootstrap_unpaired(std::span<const double> treatment, std::span<const double> baseline,
                                                  const BootstrapOptions& options) {
  return bootstrap(treatment, baseline, false, options);
}

std::optional<BootstrapResult> bootstrap_paired(std::span<const double> treatment, std::span<const double> baseline,
                                                const BootstrapOptions& options) {
  return bootstrap(treatment, baseline, true, options);
}

double percent_change(double difference, double baseline_mean) {
  if (baseline_mean == 0.0 || !std::isfinite(baseline_mean)) return kNaN;
  return 100.0 * difference / baseline_mean;
}

}  // namespace kvrelay::audit
