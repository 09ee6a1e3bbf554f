#include "kvrelay/core/metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace kvrelay::metrics {

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)),
      buckets_(std::make_unique<std::atomic<std::uint64_t>[]>(upper_bounds_.size() + 1)) {
  std::sort(upper_bounds_.begin(), upper_bounds_.end());
}

void Histogram::observe(double value) noexcept {
  const auto position = std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value);
  const auto index = static_cast<std::size_t>(position - upper_bounds_.begin());
  buckets_[index].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

std::uint64_t Histogram::bucket_count(std::size_t index) const noexcept {
  return index <= upper_bounds_.size() ? buckets_[index].load(std::memory_order_relaxed) : 0;
}

std::vector<double> latency_buckets_seconds() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,    0.25,    0.5,    1.0,   2.5,    5.0,   10.0, 30.0,  60.0};
}

template <class Metric>
Metric& Family<Metric>::with(std::initializer_list<std::string_view> label_values) {
  if (label_values.size() != label_names_.size()) {
    throw std::logic_error(fmt::format("metric expects {} labels, got {}", label_names_.size(), label_values.size()));
  }
  std::vector<std::string> key(label_values.begin(), label_values.end());
  const std::lock_guard lock(mutex_);
  const auto found = index_.find(key);
  if (found != index_.end()) return children_[found->second];
  if constexpr (std::is_same_v<Metric, Histogram>) {
    children_.emplace_back(buckets_);
  } else {
    children_.emplace_back();
  }
  index_.emplace(std::move(key), children_.size() - 1);
  return children_.back();
}

template class Family<Counter>;
template class Family<Gauge>;
template class Family<Histogram>;

Registry::Entry& Registry::declare(std::string name, std::string help, MetricType type) {
  const std::lock_guard lock(mutex_);
  for (const auto& entry : entries_) {
    if (entry.name == name) throw std::logic_error("metric declared twice: " + name);
  }
  entries_.push_back(Entry{std::move(name), std::move(help), type, nullptr, nullptr, nullptr});
  return entries_.back();
}

Family<Counter>& Registry::counter(std::string name, std::string help, std::vector<std::string> label_names) {
  auto& entry = declare(std::move(name), std::move(help), MetricType::kCounter);
  entry.counters = std::make_unique<Family<Counter>>(std::move(label_names));
  return *entry.counters;
}

Family<Gauge>& Registry::gauge(std::string name, std::string help, std::vector<std::string> label_names) {
  auto& entry = declare(std::move(name), std::move(help), MetricType::kGauge);
  entry.gauges = std::make_unique<Family<Gauge>>(std::move(label_names));
  return *entry.gauges;
}

Family<Histogram>& Registry::histogram(std::string name, std::string help, std::vector<std::string> label_names,
                                       std::vector<double> upper_bounds) {
  auto& entry = declare(std::move(name), std::move(help), MetricType::kHistogram);
  entry.histograms = std::make_unique<Family<Histogram>>(std::move(label_names), std::move(upper_bounds));
  return *entry.histograms;
}

std::string escape_label_value(std::string_view value) {
  std::string escaped;
  escaped.reserve(value.size());
  for (const char c : value) {
    if (c == '\\') {
      escaped += "\\\\";
    } else if (c == '"') {
      escaped += "\\\"";
    } else if (c == '\n') {
      escaped += "\\n";
    } else {
      escaped += c;
    }
  }
  return escaped;
}

namespace {

std::string format_value(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  return fmt::format("{}", value);
}

std::string render_labels(const std::vector<std::string>& names, const std::vector<std::string>& values,
                          std::string_view extra_name = {}, std::string_view extra_value = {}) {
  std::string text;
  for (std::size_t index = 0; index < names.size(); ++index) {
    text += fmt::format("{}{}=\"{}\"", text.empty() ? "" : ",", names[index], escape_label_value(values[index]));
  }
  if (!extra_name.empty()) text += fmt::format("{}{}=\"{}\"", text.empty() ? "" : ",", extra_name, extra_value);
  return text.empty() ? text : "{" + text + "}";
}

std::string escape_help(std::string_view help) {
  std::string escaped;
  for (const char c : help) {
    if (c == '\\') {
      escaped += "\\\\";
    } else if (c == '\n') {
      escaped += "\\n";
    } else {
      escaped += c;
    }
  }
  return escaped;
}

}  // namespace

std::string Registry::render() const {
  const std::lock_guard lock(mutex_);
  std::string text;
  for (const auto& entry : entries_) {
    static constexpr std::string_view kTypeNames[] = {"counter", "gauge", "histogram"};
    text += fmt::format("# HELP {} {}\n# TYPE {} {}\n", entry.name, escape_help(entry.help), entry.name,
                        kTypeNames[static_cast<int>(entry.type)]);
    switch (entry.type) {
      case MetricType::kCounter:
        entry.counters->for_each([&](const std::vector<std::string>& values, const Counter& metric) {
          text += fmt::format("{}{} {}\n", entry.name, render_labels(entry.counters->label_names(), values),
                              format_value(metric.value()));
        });
        break;
      case MetricType::kGauge:
        entry.gauges->for_each([&](const std::vector<std::string>& values, const Gauge& metric) {
          text += fmt::format("{}{} {}\n", entry.name, render_labels(entry.gauges->label_names(), values),
                              format_value(metric.value()));
        });
        break;
      case MetricType::kHistogram:
        entry.histograms->for_each([&](const std::vector<std::string>& values, const Histogram& metric) {
          const auto& names = entry.histograms->label_names();
          std::uint64_t cumulative = 0;
          for (std::size_t index = 0; index <= metric.upper_bounds().size(); ++index) {
            cumulative += metric.bucket_count(index);
            const auto bound =
                index < metric.upper_bounds().size() ? format_value(metric.upper_bounds()[index]) : "+Inf";
            text += fmt::format("{}_bucket{} {}\n", entry.name, render_labels(names, values, "le", bound), cumulative);
          }
          text += fmt::format("{}_sum{} {}\n", entry.name, render_labels(names, values), format_value(metric.sum()));
          text += fmt::format("{}_count{} {}\n", entry.name, render_labels(names, values), cumulative);
        });
        break;
    }
  }
  return text;
}

}  // namespace kvrelay::metrics
