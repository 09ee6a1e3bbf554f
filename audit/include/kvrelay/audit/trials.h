#pragma once

// The public trials format (docs/audit.md): JSON lines, one object per trial. A complete trial
// carries at least route, treatment, context_tokens, ttft_ms and pair_id (null for an unpaired
// trial). The daemon's online audit writes a trial in two lines instead, so the assignment is on
// disk before the outcome exists: {"event": "assignment", ...} then {"event": "outcome",
// "request_id", "ttft_ms", ...}; reading joins them by request_id. What was delivered can differ
// from what was assigned (a lookup misses, a receiver cannot take a span): a trial records both,
// the delivered treatment and its reason in the outcome record of the two-record form.

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"
#include "kvrelay/core/treatment.h"

namespace kvrelay::audit {

// A treatment: what span of A's context moves as KV, and through which medium (core's type,
// shared with the front proxy and the KV path).
using Treatment = kvrelay::Treatment;

// The standard treatments of the design: T0 tokens only, T1 A's prompt KV, T2 A's generated KV,
// T3 all of A's KV (raw by default).
[[nodiscard]] std::vector<Treatment> standard_treatments(std::string_view kv_medium = "kv_raw");
[[nodiscard]] bool is_known_span(std::string_view span) noexcept;

struct Trial {
  std::string route;
  std::string treatment;  // as assigned (randomized): what intent-to-treat groups by
  std::uint64_t context_tokens = 0;
  double ttft_ms = 0.0;
  std::optional<std::string> pair_id;  // trials sharing one are a context under several treatments
  // Optional covariates and outcomes.
  std::string request_id;
  std::string medium;
  std::string span;
  std::string sender_model;
  std::string receiver_model;
  std::string receiver_agent;
  std::string stratum;  // overrides the computed stratum when set
  std::optional<double> load;
  std::optional<double> e2e_ms;
  std::optional<std::uint64_t> bytes;
  std::optional<double> top1_agreement;
  std::optional<std::uint64_t> output_tokens;
  std::optional<std::uint64_t> cached_tokens;
  std::optional<std::uint64_t> status;
  std::optional<std::uint64_t> repeat;
  // What the request actually got, when it differs or was checked: absent means delivered as
  // assigned. delivery_reason says why (free text, e.g. "lookup_miss") when they differ.
  std::optional<std::string> delivered_treatment{};
  std::string delivery_reason{};
};

// The treatment a trial was delivered: delivered_treatment, or the assigned one when absent (or
// empty, which the writers treat as absent).
[[nodiscard]] const std::string& delivered_treatment_of(const Trial& trial) noexcept;
[[nodiscard]] bool delivered_as_assigned(const Trial& trial) noexcept;

struct TrialSet {
  std::vector<Trial> trials;
  std::size_t assignments_without_outcome = 0;  // online requests that never finished (attrition)
  std::size_t failed_outcomes = 0;              // outcomes with a non-2xx status, left out
};

[[nodiscard]] nlohmann::json trial_to_json(const Trial& trial);
// One line, no trailing newline.
[[nodiscard]] std::string trial_line(const Trial& trial);
// The online audit's two records. The assignment carries no outcome and no delivery (both are
// known only when the response ends); the outcome record carries them.
[[nodiscard]] std::string assignment_line(const Trial& trial);
struct OutcomeRecord {
  std::string request_id;
  double ttft_ms = 0.0;
  double e2e_ms = 0.0;
  unsigned status = 0;
  // Default member initializers: {request_id, ttft, e2e, status} alone is a complete record.
  std::optional<std::uint64_t> prompt_tokens{};  // the worker's, for a text prompt's length
  std::optional<std::uint64_t> cached_tokens{};
  std::optional<std::string> delivered_treatment{};  // absent: delivered as assigned
  std::string delivery_reason{};                     // written when non-empty
};
[[nodiscard]] std::string outcome_line(const OutcomeRecord& outcome);

// Parses JSON lines (blank lines skipped). Errors name the line and the field:
// "trials line 3: field 'ttft_ms': expected a non-negative number, got \"fast\"".
[[nodiscard]] Result<TrialSet> parse_trials(std::string_view text, std::string_view source = "trials");
[[nodiscard]] Result<TrialSet> read_trials_file(const std::string& path);

}  // namespace kvrelay::audit
