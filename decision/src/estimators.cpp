#include "kvrelay/decision/estimators.h"

#include <boost/math/statistics/univariate_statistics.hpp>

#include <algorithm>
#include <array>
#include <cmath>

namespace kvrelay::decision {

namespace {

// Boost.Math's median reorders the range; callers pass a non-empty scratch copy.
template <class It>
double median(It first, It last) noexcept {
  return boost::math::statistics::median(first, last);
}

}  // namespace

WindowedRate::WindowedRate(std::size_t window, double prior_per_s)
    : ring_(std::max<std::size_t>(window, 1)), prior_(prior_per_s) {}

void WindowedRate::observe(double amount, double seconds) noexcept {
  if (!(amount >= 0.0) || !(seconds > 0.0) || !std::isfinite(amount) || !std::isfinite(seconds)) {
    return;  // a broken measurement must not poison the window
  }
  auto& slot = ring_[next_];
  if (count_ == ring_.size()) {
    sum_amount_ -= slot[0];
    sum_seconds_ -= slot[1];
  } else {
    ++count_;
  }
  slot = {amount, seconds};
  sum_amount_ += amount;
  sum_seconds_ += seconds;
  next_ = (next_ + 1) % ring_.size();
  if (next_ == 0) {
    // Re-sum once per lap so subtraction round-off cannot accumulate.
    sum_amount_ = 0.0;
    sum_seconds_ = 0.0;
    for (const auto& sample : ring_) {
      sum_amount_ += sample[0];
      sum_seconds_ += sample[1];
    }
  }
}

double WindowedRate::per_second() const noexcept {
  if (count_ == 0 || !(sum_seconds_ > 0.0)) {
    return prior_;
  }
  return sum_amount_ / sum_seconds_;
}

WindowedMean::WindowedMean(std::size_t window, double prior) : ring_(std::max<std::size_t>(window, 1)), prior_(prior) {}

void WindowedMean::observe(double value) noexcept {
  if (!std::isfinite(value)) {
    return;
  }
  if (count_ == ring_.size()) {
    sum_ -= ring_[next_];
  } else {
    ++count_;
  }
  ring_[next_] = value;
  sum_ += value;
  next_ = (next_ + 1) % ring_.size();
  if (next_ == 0) {
    sum_ = 0.0;
    for (const double sample : ring_) {
      sum_ += sample;
    }
  }
}

double WindowedMean::mean() const noexcept {
  return count_ == 0 ? prior_ : sum_ / static_cast<double>(count_);
}

PrefillFit::PrefillFit(std::size_t window, std::size_t min_samples, PrefillCoefficients prior)
    : ring_(std::max<std::size_t>(window, 1)),
      min_samples_(std::max<std::size_t>(min_samples, 1)),
      prior_(prior),
      current_(prior) {}

void PrefillFit::observe(std::uint64_t new_tokens, std::uint64_t cached_tokens, double seconds) noexcept {
  if (!(seconds >= 0.0) || !std::isfinite(seconds)) {
    return;
  }
  ring_[next_] = Sample{static_cast<double>(new_tokens), static_cast<double>(cached_tokens), seconds};
  next_ = (next_ + 1) % ring_.size();
  count_ = std::min(count_ + 1, ring_.size());
  if (count_ >= min_samples_) {
    refit();
  }
}

void PrefillFit::set_prior(PrefillCoefficients prior) noexcept {
  prior_ = prior;
  if (count_ >= min_samples_) {
    refit();
  } else {
    current_ = prior;
  }
}

double PrefillFit::predict(std::uint64_t new_tokens, std::uint64_t cached_tokens) const noexcept {
  return current_.predict(static_cast<double>(new_tokens), static_cast<double>(cached_tokens));
}

namespace {

// Features scaled so the normal equations stay well conditioned with n up to ~1e5.
constexpr double kScaleB = 1e3;
constexpr double kScaleC = 1e6;
// Ridge weight pulling towards the prior, relative to the data's own scale.
constexpr double kRidge = 1e-3;

// Timing noise is multiplicative (a 3% jitter on a 5 s prefill is 150 ms, on a 20 ms one it is
// 0.6 ms), so samples are weighted by 1/t^2: the fit minimises relative error and short prefills
// are predicted as well as long ones.
double relative_weight(double seconds) {
  const double t = std::max(seconds, 1e-6);
  return 1.0 / (t * t);
}

// Solves the 3x3 system restricted to the features in `mask`; false when singular.
bool solve_masked(std::array<std::array<double, 3>, 3> m, std::array<double, 3> v, unsigned mask,
                  std::array<double, 3>& out) {
  for (std::size_t i = 0; i < 3; ++i) {
    if ((mask & (1U << i)) == 0) {
      for (std::size_t j = 0; j < 3; ++j) {
        m[i][j] = 0.0;
        m[j][i] = 0.0;
      }
      m[i][i] = 1.0;
      v[i] = 0.0;
    }
  }
  // Gaussian elimination with partial pivoting.
  for (std::size_t col = 0; col < 3; ++col) {
    std::size_t pivot = col;
    for (std::size_t row = col + 1; row < 3; ++row) {
      if (std::abs(m[row][col]) > std::abs(m[pivot][col])) {
        pivot = row;
      }
    }
    if (std::abs(m[pivot][col]) < 1e-300) {
      return false;
    }
    std::swap(m[pivot], m[col]);
    std::swap(v[pivot], v[col]);
    for (std::size_t row = col + 1; row < 3; ++row) {
      const double factor = m[row][col] / m[col][col];
      for (std::size_t k = col; k < 3; ++k) {
        m[row][k] -= factor * m[col][k];
      }
      v[row] -= factor * v[col];
    }
  }
  for (std::size_t back = 3; back-- > 0;) {
    double sum = v[back];
    for (std::size_t k = back + 1; k < 3; ++k) {
      sum -= m[back][k] * out[k];
    }
    out[back] = sum / m[back][back];
  }
  return std::isfinite(out[0]) && std::isfinite(out[1]) && std::isfinite(out[2]);
}

}  // namespace

void PrefillFit::refit() noexcept {
  std::array<std::array<double, 3>, 3> xtx{};
  std::array<double, 3> xty{};
  for (std::size_t i = 0; i < count_; ++i) {
    const Sample& s = ring_[i];
    const std::array<double, 3> x{1.0, s.n / kScaleB, s.n * (s.n + 2.0 * s.cached) / kScaleC};
    const double w = relative_weight(s.seconds);
    for (std::size_t r = 0; r < 3; ++r) {
      for (std::size_t c = 0; c < 3; ++c) {
        xtx[r][c] += w * x[r] * x[c];
      }
      xty[r] += w * x[r] * s.seconds;
    }
  }
  const std::array<double, 3> prior{prior_.a, prior_.b * kScaleB, prior_.c * kScaleC};
  // Per-feature ridge, proportional to each feature's own energy, so the pull towards the prior
  // does not depend on the units of n.
  for (std::size_t i = 0; i < 3; ++i) {
    const double ridge = kRidge * xtx[i][i];
    xtx[i][i] += ridge;
    xty[i] += ridge * prior[i];
  }
  // Non-negative least squares by enumeration: 7 subsets of 3 features, keep the feasible one
  // with the smallest residual. A negative prefill coefficient would predict negative time.
  double best_residual = -1.0;
  std::array<double, 3> best{};
  for (unsigned mask = 1; mask < 8; ++mask) {
    std::array<double, 3> theta{};
    if (!solve_masked(xtx, xty, mask, theta)) {
      continue;
    }
    if (theta[0] < 0.0 || theta[1] < 0.0 || theta[2] < 0.0) {
      continue;
    }
    double residual = 0.0;
    for (std::size_t i = 0; i < count_; ++i) {
      const Sample& s = ring_[i];
      const double predicted = theta[0] + theta[1] * s.n / kScaleB + theta[2] * s.n * (s.n + 2.0 * s.cached) / kScaleC;
      residual += relative_weight(s.seconds) * (predicted - s.seconds) * (predicted - s.seconds);
    }
    if (best_residual < 0.0 || residual < best_residual) {
      best_residual = residual;
      best = theta;
    }
  }
  if (best_residual >= 0.0) {
    current_ = PrefillCoefficients{best[0], best[1] / kScaleB, best[2] / kScaleC};
  }
}

void LinearCostFit::observe(double bytes, double seconds) noexcept {
  if (!std::isfinite(bytes) || !std::isfinite(seconds) || bytes < 0.0 || seconds < 0.0) return;
  ring_[next_] = {bytes, seconds};
  next_ = (next_ + 1) % kWindow;
  count_ = std::min(count_ + 1, kWindow);
  refit();
}

void LinearCostFit::refit() noexcept {
  // Theil-Sen: the median of the pairwise slopes, then the median intercept. A handoff measured
  // while the host was busy (a prefill or build stealing the cores) can take ten times the usual;
  // least squares let one such sample move every later prediction, the medians ignore it until
  // it is the typical case. At most 16 samples: 120 slopes, sorted in place, no allocation.
  std::array<double, kWindow*(kWindow - 1) / 2> slopes{};
  std::size_t slope_count = 0;
  for (std::size_t i = 0; i < count_; ++i) {
    for (std::size_t j = i + 1; j < count_; ++j) {
      const double dx = ring_[j][0] - ring_[i][0];
      if (dx != 0.0) slopes[slope_count++] = (ring_[j][1] - ring_[i][1]) / dx;
    }
  }
  std::array<double, kWindow> scratch{};
  const auto median_of = [&scratch](std::size_t n) { return median(scratch.begin(), scratch.begin() + n); };
  // One size, or a slope no transfer has (negative): proportional through the origin.
  const auto proportional = [&] {
    std::size_t n = 0;
    for (std::size_t i = 0; i < count_; ++i) {
      if (ring_[i][0] > 0.0) scratch[n++] = ring_[i][1] / ring_[i][0];
    }
    if (n > 0) {
      b_ = median_of(n);
      a_ = 0.0;
    } else {  // only empty transfers: their time is all fixed cost
      for (std::size_t i = 0; i < count_; ++i)
        scratch[i] = ring_[i][1];
      b_ = 0.0;
      a_ = median_of(count_);
    }
  };
  if (slope_count == 0) return proportional();
  const double slope = median(slopes.begin(), slopes.begin() + static_cast<std::ptrdiff_t>(slope_count));
  if (slope < 0.0) return proportional();
  for (std::size_t i = 0; i < count_; ++i)
    scratch[i] = ring_[i][1] - slope * ring_[i][0];
  const double intercept = median_of(count_);
  if (intercept < 0.0) return proportional();
  b_ = slope;
  a_ = intercept;
}

}  // namespace kvrelay::decision
