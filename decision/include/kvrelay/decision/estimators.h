#pragma once

// Online estimators fed by measurements. All are windowed (the last N samples), so a real
// change shows up within one window while one noisy sample moves the estimate by at most 1/N.

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvrelay::decision {

// Throughput over a window of (bytes, seconds) samples: sum(bytes) / sum(seconds), which weights
// samples by their duration, as a long transfer tells more than a short one.
class WindowedRate {
 public:
  WindowedRate(std::size_t window, double prior_per_s);

  void observe(double amount, double seconds) noexcept;
  [[nodiscard]] double per_second() const noexcept;
  // What per_second() answers before any sample; the samples are kept.
  void set_prior(double prior_per_s) noexcept { prior_ = prior_per_s; }
  [[nodiscard]] std::size_t samples() const noexcept { return count_; }

 private:
  std::vector<std::array<double, 2>> ring_;
  std::size_t next_ = 0;
  std::size_t count_ = 0;
  double sum_amount_ = 0.0;
  double sum_seconds_ = 0.0;
  double prior_;
};

// Mean of the last N samples (RTT, codec ratio).
class WindowedMean {
 public:
  WindowedMean(std::size_t window, double prior);

  void observe(double value) noexcept;
  [[nodiscard]] double mean() const noexcept;
  [[nodiscard]] std::size_t samples() const noexcept { return count_; }

 private:
  std::vector<double> ring_;
  std::size_t next_ = 0;
  std::size_t count_ = 0;
  double sum_ = 0.0;
  double prior_;
};

// Time of a step with a fixed part and a part per byte, t = a + b*bytes, fitted over a window by
// Theil-Sen (median pairwise slope, median intercept; coefficients kept >= 0), so a few samples
// taken on a busy host do not move the prediction. Until two sizes have been seen, t is
// proportional to the bytes (the median seconds per byte).
class LinearCostFit {
 public:
  static constexpr std::size_t kWindow = 16;

  void observe(double bytes, double seconds) noexcept;
  [[nodiscard]] double predict(double bytes) const noexcept { return a_ + b_ * bytes; }
  [[nodiscard]] std::size_t samples() const noexcept { return count_; }
  [[nodiscard]] double fixed_seconds() const noexcept { return a_; }
  [[nodiscard]] double seconds_per_byte() const noexcept { return b_; }

 private:
  void refit() noexcept;

  std::array<std::array<double, 2>, kWindow> ring_{};
  std::size_t next_ = 0;
  std::size_t count_ = 0;
  double a_ = 0.0;
  double b_ = 0.0;
};

// Prefill time model t(n, cached) = a + b*n + c*n*(n + 2*cached): n new tokens attend to
// themselves and to `cached` earlier ones, so the attention term is quadratic in n and linear in
// cached. Fitted by least squares over a window of observations, coefficients kept >= 0; the
// configured prior is used until `min_samples` observations exist and also regularises the fit
// so a window with a single length cannot produce a wild extrapolation.
struct PrefillCoefficients {
  double a = 0.0;  // seconds
  double b = 0.0;  // seconds per token
  double c = 0.0;  // seconds per token pair
  [[nodiscard]] double predict(double n, double cached) const noexcept {
    return a + b * n + c * n * (n + 2.0 * cached);
  }
};

class PrefillFit {
 public:
  PrefillFit(std::size_t window, std::size_t min_samples, PrefillCoefficients prior);

  void observe(std::uint64_t new_tokens, std::uint64_t cached_tokens, double seconds) noexcept;
  [[nodiscard]] double predict(std::uint64_t new_tokens, std::uint64_t cached_tokens) const noexcept;
  [[nodiscard]] const PrefillCoefficients& coefficients() const noexcept { return current_; }
  [[nodiscard]] bool fitted() const noexcept { return count_ >= min_samples_; }
  [[nodiscard]] std::size_t samples() const noexcept { return count_; }
  // A new prior (a calibrated cost model): answered as is until min_samples, then the pull of
  // the refit. The observations are kept.
  void set_prior(PrefillCoefficients prior) noexcept;
  [[nodiscard]] const PrefillCoefficients& prior() const noexcept { return prior_; }

 private:
  struct Sample {
    double n;
    double cached;
    double seconds;
  };
  void refit() noexcept;

  std::vector<Sample> ring_;
  std::size_t next_ = 0;
  std::size_t count_ = 0;
  std::size_t min_samples_;
  PrefillCoefficients prior_;
  PrefillCoefficients current_;
};

}  // namespace kvrelay::decision
