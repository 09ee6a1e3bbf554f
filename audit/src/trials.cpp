#include "kvrelay/audit/trials.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

namespace kvrelay::audit {

using nlohmann::json;

namespace {

// Reads one line's fields, remembering the first problem with the line number and field name.
class LineReader {
 public:
  LineReader(const json& object, std::string_view source, std::size_t line)
      : object_(object), source_(source), line_(line) {}

  [[nodiscard]] const std::optional<Error>& error() const { return error_; }

  void problem(std::string_view field, std::string_view expected) {
    if (error_) return;
    const auto found = object_.find(field);
    const std::string got = found == object_.end() ? std::string("nothing") : found->dump();
    error_ = make_error(ErrorCode::kInvalidArgument, fmt::format("{} line {}: field '{}': expected {}, got {}", source_,
                                                                 line_, field, expected, got));
  }

  bool has(std::string_view field) const {
    const auto found = object_.find(field);
    return found != object_.end() && !found->is_null();
  }

  void string(std::string_view field, std::string& out, bool required) {
    const auto found = object_.find(field);
    if (found == object_.end() || found->is_null()) {
      if (required) problem(field, "a non-empty string");
      return;
    }
    if (!found->is_string() || found->get_ref<const std::string&>().empty())
      return problem(field, "a non-empty string");
    out = found->get<std::string>();
  }

  void number(std::string_view field, double& out, bool required) {
    std::optional<double> value;
    number(field, value);
    if (value) {
      out = *value;
    } else if (required && !has(field)) {
      problem(field, "a non-negative number");
    }
  }

  void number(std::string_view field, std::optional<double>& out) {
    if (!has(field)) return;
    const auto& value = object_.at(std::string(field));
    if (!value.is_number() || !std::isfinite(value.get<double>()) || value.get<double>() < 0.0) {
      return problem(field, "a non-negative number");
    }
    out = value.get<double>();
  }

  void count(std::string_view field, std::uint64_t& out, bool required) {
    std::optional<std::uint64_t> value;
    count(field, value);
    if (value) {
      out = *value;
    } else if (required && !has(field)) {
      problem(field, "a non-negative integer");
    }
  }

  // "delivered_treatment" (a non-empty string or null: null or absent is delivered as assigned)
  // and "delivery_reason" (a non-empty string).
  void delivery(std::optional<std::string>& delivered, std::string& reason) {
    std::string name;
    string("delivered_treatment", name, false);
    if (!name.empty()) delivered = std::move(name);
    string("delivery_reason", reason, false);
  }

  void count(std::string_view field, std::optional<std::uint64_t>& out) {
    if (!has(field)) return;
    const auto& value = object_.at(std::string(field));
    if (!value.is_number_unsigned()) return problem(field, "a non-negative integer");
    out = value.get<std::uint64_t>();
  }

 private:
  const json& object_;
  std::string_view source_;
  std::size_t line_;
  std::optional<Error> error_;
};

Result<Trial> read_trial(const json& object, std::string_view source, std::size_t line, bool assignment) {
  LineReader reader(object, source, line);
  Trial trial;
  reader.string("route", trial.route, true);
  reader.string("treatment", trial.treatment, true);
  reader.count("context_tokens", trial.context_tokens, true);
  if (!assignment) reader.number("ttft_ms", trial.ttft_ms, true);
  if (!object.contains("pair_id")) {
    reader.problem("pair_id", "a string, an integer or null");
  } else if (const auto& pair = object["pair_id"]; pair.is_string() && !pair.get_ref<const std::string&>().empty()) {
    trial.pair_id = pair.get<std::string>();
  } else if (pair.is_number_integer()) {
    trial.pair_id = pair.dump();
  } else if (!pair.is_null()) {
    reader.problem("pair_id", "a string, an integer or null");
  }
  reader.string("request_id", trial.request_id, assignment);
  reader.string("medium", trial.medium, false);
  reader.string("span", trial.span, false);
  if (!trial.span.empty() && !is_known_span(trial.span)) reader.problem("span", "none, prompt, generated or all");
  reader.string("sender_model", trial.sender_model, false);
  reader.string("receiver_model", trial.receiver_model, false);
  reader.string("receiver_agent", trial.receiver_agent, false);
  reader.string("stratum", trial.stratum, false);
  reader.number("load", trial.load);
  reader.number("e2e_ms", trial.e2e_ms);
  reader.count("bytes", trial.bytes);
  reader.number("top1_agreement", trial.top1_agreement);
  if (trial.top1_agreement && *trial.top1_agreement > 1.0) reader.problem("top1_agreement", "a number in 0..1");
  reader.count("output_tokens", trial.output_tokens);
  reader.count("cached_tokens", trial.cached_tokens);
  reader.count("status", trial.status);
  reader.count("repeat", trial.repeat);
  if (assignment) {
    // Delivery is known only when the response ends: it belongs in the outcome record.
    for (const char* field : {"delivered_treatment", "delivery_reason"}) {
      if (reader.has(field)) reader.problem(field, "nothing on an assignment record (it belongs in the outcome)");
    }
  }
  reader.delivery(trial.delivered_treatment, trial.delivery_reason);
  if (reader.error()) return *reader.error();
  return trial;
}

struct PendingOutcome {
  double ttft_ms = 0.0;
  std::optional<double> e2e_ms;
  std::optional<std::uint64_t> status;
  std::optional<std::uint64_t> prompt_tokens;
  std::optional<std::uint64_t> cached_tokens;
  std::optional<std::string> delivered_treatment;
  std::string delivery_reason;
};

}  // namespace

const std::string& delivered_treatment_of(const Trial& trial) noexcept {
  return trial.delivered_treatment && !trial.delivered_treatment->empty() ? *trial.delivered_treatment
                                                                          : trial.treatment;
}

bool delivered_as_assigned(const Trial& trial) noexcept {
  return delivered_treatment_of(trial) == trial.treatment;
}

std::vector<Treatment> standard_treatments(std::string_view kv_medium) {
  const std::string medium(kv_medium);
  return {{"T0", "tokens", KvSpan::kNone, std::nullopt},
          {"T1", medium, KvSpan::kPrompt, std::nullopt},
          {"T2", medium, KvSpan::kGenerated, std::nullopt},
          {"T3", medium, KvSpan::kAll, std::nullopt}};
}

bool is_known_span(std::string_view span) noexcept {
  return parse_span(span).has_value();
}

json trial_to_json(const Trial& trial) {
  json out{{"route", trial.route},
           {"treatment", trial.treatment},
           {"context_tokens", trial.context_tokens},
           {"ttft_ms", trial.ttft_ms},
           {"pair_id", trial.pair_id ? json(*trial.pair_id) : json()}};
  const auto put_string = [&](const char* key, const std::string& value) {
    if (!value.empty()) out[key] = value;
  };
  const auto put = [&](const char* key, const auto& value) {
    if (value) out[key] = *value;
  };
  put_string("request_id", trial.request_id);
  put_string("medium", trial.medium);
  put_string("span", trial.span);
  put_string("sender_model", trial.sender_model);
  put_string("receiver_model", trial.receiver_model);
  put_string("receiver_agent", trial.receiver_agent);
  put_string("stratum", trial.stratum);
  put("load", trial.load);
  put("e2e_ms", trial.e2e_ms);
  put("bytes", trial.bytes);
  put("top1_agreement", trial.top1_agreement);
  put("output_tokens", trial.output_tokens);
  put("cached_tokens", trial.cached_tokens);
  put("status", trial.status);
  put("repeat", trial.repeat);
  if (trial.delivered_treatment && !trial.delivered_treatment->empty()) {
    out["delivered_treatment"] = *trial.delivered_treatment;
  }
  put_string("delivery_reason", trial.delivery_reason);
  return out;
}

std::string trial_line(const Trial& trial) {
  return trial_to_json(trial).dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string assignment_line(const Trial& trial) {
  json out = trial_to_json(trial);
  out.erase("ttft_ms");
  out.erase("delivered_treatment");
  out.erase("delivery_reason");
  out["event"] = "assignment";
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string outcome_line(const OutcomeRecord& outcome) {
  json out{{"event", "outcome"},
           {"request_id", outcome.request_id},
           {"ttft_ms", outcome.ttft_ms},
           {"e2e_ms", outcome.e2e_ms},
           {"status", outcome.status}};
  if (outcome.prompt_tokens) out["prompt_tokens"] = *outcome.prompt_tokens;
  if (outcome.cached_tokens) out["cached_tokens"] = *outcome.cached_tokens;
  if (outcome.delivered_treatment && !outcome.delivered_treatment->empty()) {
    out["delivered_treatment"] = *outcome.delivered_treatment;
  }
  if (!outcome.delivery_reason.empty()) out["delivery_reason"] = outcome.delivery_reason;
  return out.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<TrialSet> parse_trials(std::string_view text, std::string_view source) {
  TrialSet set;
  std::vector<Trial> assignments;
  std::map<std::string, PendingOutcome, std::less<>> outcomes;
  std::size_t line_number = 0;
  std::size_t start = 0;
  while (start <= text.size()) {
    auto end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    const auto line = text.substr(start, end - start);
    start = end + 1;
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) {
      if (end == text.size()) break;
      continue;
    }
    const json object = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (object.is_discarded() || !object.is_object()) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("{} line {}: not a JSON object", source, line_number));
    }
    std::string event;
    if (const auto found = object.find("event"); found != object.end()) {
      if (!found->is_string() || (*found != "assignment" && *found != "outcome")) {
        return fail(ErrorCode::kInvalidArgument,
                    fmt::format("{} line {}: field 'event': expected \"assignment\" or \"outcome\", got {}", source,
                                line_number, found->dump()));
      }
      event = found->get<std::string>();
    }
    if (event == "outcome") {
      LineReader reader(object, source, line_number);
      std::string request_id;
      PendingOutcome outcome;
      reader.string("request_id", request_id, true);
      reader.number("ttft_ms", outcome.ttft_ms, true);
      reader.number("e2e_ms", outcome.e2e_ms);
      reader.count("status", outcome.status);
      reader.count("prompt_tokens", outcome.prompt_tokens);
      reader.count("cached_tokens", outcome.cached_tokens);
      reader.delivery(outcome.delivered_treatment, outcome.delivery_reason);
      if (reader.error()) return *reader.error();
      outcomes[request_id] = outcome;
    } else {
      KVRELAY_TRY(auto trial, read_trial(object, source, line_number, event == "assignment"));
      (event == "assignment" ? assignments : set.trials).push_back(std::move(trial));
    }
    if (end == text.size()) break;
  }
  for (auto& trial : assignments) {
    const auto found = outcomes.find(trial.request_id);
    if (found == outcomes.end()) {
      ++set.assignments_without_outcome;
      continue;
    }
    const auto& outcome = found->second;
    if (outcome.status && (*outcome.status < 200 || *outcome.status >= 300)) {
      ++set.failed_outcomes;
      continue;
    }
    trial.ttft_ms = outcome.ttft_ms;
    trial.e2e_ms = outcome.e2e_ms;
    trial.status = outcome.status;
    if (outcome.cached_tokens) trial.cached_tokens = outcome.cached_tokens;
    trial.delivered_treatment = outcome.delivered_treatment;
    trial.delivery_reason = outcome.delivery_reason;
    // A text prompt's length is known only from the worker's answer.
    if (trial.context_tokens == 0 && outcome.prompt_tokens) trial.context_tokens = *outcome.prompt_tokens;
    set.trials.push_back(std::move(trial));
  }
  return set;
}

Result<TrialSet> read_trials_file(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return fail(ErrorCode::kNotFound, fmt::format("{}: cannot open trials file", path));
  std::ostringstream contents;
  contents << file.rdbuf();
  if (file.bad()) return fail(ErrorCode::kIo, fmt::format("{}: read failed", path));
  return parse_trials(contents.str(), path);
}

}  // namespace kvrelay::audit
