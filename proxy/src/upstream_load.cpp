#include "kvrelay/proxy/upstream_load.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <string>

namespace kvrelay::proxy {

namespace {

enum class Field { kNone, kWaiting, kRunning, kKvUsage, kTtftSum, kTtftCount, kTpotSum, kTpotCount, kCpuSeconds };

Field field_of(std::string_view name) noexcept {
  if (name == "vllm:num_requests_waiting" || name == "tgi_queue_size") return Field::kWaiting;
  if (name == "vllm:num_requests_running" || name == "tgi_batch_current_size") return Field::kRunning;
  // vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; accept both generations.
  if (name == "vllm:kv_cache_usage_perc" || name == "vllm:gpu_cache_usage_perc") return Field::kKvUsage;
  if (name == "vllm:time_to_first_token_seconds_sum") return Field::kTtftSum;
  if (name == "vllm:time_to_first_token_seconds_count") return Field::kTtftCount;
  // Time per output token: vLLM's name before and after its rename, and TGI's per-request mean.
  if (name == "vllm:time_per_output_token_seconds_sum" || name == "vllm:inter_token_latency_seconds_sum" ||
      name == "tgi_request_mean_time_per_token_duration_sum") {
    return Field::kTpotSum;
  }
  if (name == "vllm:time_per_output_token_seconds_count" || name == "vllm:inter_token_latency_seconds_count" ||
      name == "tgi_request_mean_time_per_token_duration_count") {
    return Field::kTpotCount;
  }
  if (name == "process_cpu_seconds_total") return Field::kCpuSeconds;
  return Field::kNone;
}

bool is_name_char(char c, bool first) noexcept {
  const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
  return alpha || (!first && c >= '0' && c <= '9');
}

// Skips a `{name="value",...}` label block; returns the position after it or npos if malformed.
std::size_t skip_labels(std::string_view line, std::size_t pos) noexcept {
  ++pos;  // '{'
  bool in_value = false;
  for (; pos < line.size(); ++pos) {
    const char c = line[pos];
    if (in_value) {
      if (c == '\\') {
        ++pos;  // the escaped character
      } else if (c == '"') {
        in_value = false;
      }
    } else if (c == '"') {
      in_value = true;
    } else if (c == '}') {
      return pos + 1;
    }
  }
  return std::string_view::npos;
}

std::optional<double> parse_sample_value(std::string_view text) noexcept {
  if (text == "NaN") return std::nan("");
  if (text == "+Inf" || text == "Inf") return HUGE_VAL;
  if (text == "-Inf") return -HUGE_VAL;
  double value = 0.0;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc{} || end != text.data() + text.size()) return std::nullopt;
  return value;
}

void add_to(std::optional<double>& slot, double value) {
  slot = slot.value_or(0.0) + value;
}

}  // namespace

Result<UpstreamLoad> parse_upstream_metrics(std::string_view exposition) {
  UpstreamLoad load;
  std::optional<double> ttft_sum;
  std::optional<double> ttft_count;
  std::optional<double> tpot_sum;
  std::optional<double> tpot_count;
  std::size_t line_number = 0;
  while (!exposition.empty()) {
    const auto newline = exposition.find('\n');
    std::string_view line = exposition.substr(0, newline);
    exposition = newline == std::string_view::npos ? std::string_view{} : exposition.substr(newline + 1);
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const auto first = line.find_first_not_of(" \t");
    if (first == std::string_view::npos || line[first] == '#') continue;
    line.remove_prefix(first);

    std::size_t pos = 0;
    while (pos < line.size() && is_name_char(line[pos], pos == 0))
      ++pos;
    if (pos == 0) return fail(ErrorCode::kInvalidArgument, fmt::format("metrics line {}: no metric name", line_number));
    const std::string_view name = line.substr(0, pos);
    if (pos < line.size() && line[pos] == '{') {
      pos = skip_labels(line, pos);
      if (pos == std::string_view::npos) {
        return fail(ErrorCode::kInvalidArgument,
                    fmt::format("metrics line {}: unterminated label set of '{}'", line_number, name));
      }
    }
    const auto value_start = line.find_first_not_of(" \t", pos);
    if (value_start == std::string_view::npos || value_start == pos) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("metrics line {}: '{}' has no value", line_number, name));
    }
    const auto value_end = line.find_first_of(" \t", value_start);  // a timestamp may follow
    const auto value = parse_sample_value(line.substr(value_start, value_end - value_start));
    if (!value) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("metrics line {}: value of '{}' is not a number", line_number, name));
    }
    switch (field_of(name)) {
      case Field::kWaiting:
        add_to(load.requests_waiting, *value);
        break;
      case Field::kRunning:
        add_to(load.requests_running, *value);
        break;
      case Field::kKvUsage:
        // One value per model; the busiest cache is the one a transfer would contend for.
        load.kv_cache_usage = std::max(load.kv_cache_usage.value_or(0.0), *value);
        break;
      case Field::kTtftSum:
        add_to(ttft_sum, *value);
        break;
      case Field::kTtftCount:
        add_to(ttft_count, *value);
        break;
      case Field::kTpotSum:
        add_to(tpot_sum, *value);
        break;
      case Field::kTpotCount:
        add_to(tpot_count, *value);
        break;
      case Field::kCpuSeconds:
        add_to(load.cpu_seconds, *value);  // several processes (labelled) are one engine's CPU
        break;
      case Field::kNone:
        break;
    }
  }
  if (ttft_sum && ttft_count) load.time_to_first_token = HistogramTotals{*ttft_sum, *ttft_count};
  if (tpot_sum && tpot_count) load.time_per_output_token = HistogramTotals{*tpot_sum, *tpot_count};
  return load;
}

std::optional<double> mean_between(const HistogramTotals& before, const HistogramTotals& after) noexcept {
  const double count = after.count - before.count;
  const double sum = after.sum - before.sum;
  if (!(count > 0.0) || sum < 0.0) return std::nullopt;
  return sum / count;
}

std::optional<double> cpu_load_between(double cpu_before, double cpu_after, double wall_seconds,
                                       unsigned cores) noexcept {
  const double used = cpu_after - cpu_before;
  if (!(wall_seconds > 0.0) || cores == 0 || !(used >= 0.0)) return std::nullopt;
  return used / wall_seconds / static_cast<double>(cores);
}

}  // namespace kvrelay::proxy
