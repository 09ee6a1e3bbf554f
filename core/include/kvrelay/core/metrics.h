#pragma once

// Prometheus metrics. Each component declares its metrics once (a struct of references obtained
// from the registry at start-up) and updates them lock-free on the hot path; the registry renders
// everything in the Prometheus text exposition format for /metrics.

#include <atomic>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace kvrelay::metrics {

class Counter {
 public:
  void inc(double amount = 1.0) noexcept { value_.fetch_add(amount, std::memory_order_relaxed); }
  [[nodiscard]] double value() const noexcept { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void set(double value) noexcept { value_.store(value, std::memory_order_relaxed); }
  void inc(double amount = 1.0) noexcept { value_.fetch_add(amount, std::memory_order_relaxed); }
  void dec(double amount = 1.0) noexcept { value_.fetch_sub(amount, std::memory_order_relaxed); }
  [[nodiscard]] double value() const noexcept { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void observe(double value) noexcept;
  [[nodiscard]] const std::vector<double>& upper_bounds() const { return upper_bounds_; }
  // Non-cumulative count of bucket i (i == upper_bounds().size() is the +Inf bucket).
  [[nodiscard]] std::uint64_t bucket_count(std::size_t index) const noexcept;
  [[nodiscard]] std::uint64_t count() const noexcept { return count_.load(std::memory_order_relaxed); }
  [[nodiscard]] double sum() const noexcept { return sum_.load(std::memory_order_relaxed); }

 private:
  std::vector<double> upper_bounds_;
  std::unique_ptr<std::atomic<std::uint64_t>[]> buckets_;
  std::atomic<std::uint64_t> count_{0};
  std::atomic<double> sum_{0.0};
};

// Latency buckets in seconds, 100 us .. 60 s.
[[nodiscard]] std::vector<double> latency_buckets_seconds();

enum class MetricType { kCounter, kGauge, kHistogram };

// One metric name with a fixed set of label names; each distinct label-value tuple is a child.
// Children are created once (under a mutex) and never move, so callers keep references.
template <class Metric>
class Family {
 public:
  Family(std::vector<std::string> label_names, std::vector<double> buckets = {})
      : label_names_(std::move(label_names)), buckets_(std::move(buckets)) {}

  Metric& with(std::initializer_list<std::string_view> label_values);
  Metric& get() { return with({}); }

  template <class Visit>
  void for_each(Visit visit) const {
    const std::lock_guard lock(mutex_);
    for (const auto& [values, index] : index_)
      visit(values, children_[index]);
  }
  [[nodiscard]] const std::vector<std::string>& label_names() const { return label_names_; }

 private:
  std::vector<std::string> label_names_;
  std::vector<double> buckets_;
  mutable std::mutex mutex_;
  std::map<std::vector<std::string>, std::size_t> index_;
  std::deque<Metric> children_;
};

class Registry {
 public:
  Family<Counter>& counter(std::string name, std::string help, std::vector<std::string> label_names = {});
  Family<Gauge>& gauge(std::string name, std::string help, std::vector<std::string> label_names = {});
  Family<Histogram>& histogram(std::string name, std::string help, std::vector<std::string> label_names,
                               std::vector<double> upper_bounds);

  // Prometheus text format 0.0.4 (what `promtool check metrics` validates).
  [[nodiscard]] std::string render() const;

 private:
  struct Entry {
    std::string name;
    std::string help;
    MetricType type;
    std::unique_ptr<Family<Counter>> counters;
    std::unique_ptr<Family<Gauge>> gauges;
    std::unique_ptr<Family<Histogram>> histograms;
  };
  Entry& declare(std::string name, std::string help, MetricType type);

  mutable std::mutex mutex_;
  std::deque<Entry> entries_;
};

// Escapes a label value for the text format (backslash, double quote, newline).
[[nodiscard]] std::string escape_label_value(std::string_view value);

}  // namespace kvrelay::metrics
