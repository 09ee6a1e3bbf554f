#pragma once

// The OpenAI completions protocol as pure functions: request JSON in, typed request out;
// outcomes in, response JSON / SSE events out. No I/O, no model.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/core/result.h"
#include "kvrelay/refworker/generation.h"

namespace kvrelay::refworker {

struct CompletionRequest {
  std::string model;
  std::vector<std::int32_t> prompt;
  GenerationOptions generation;
  bool stream = false;
  bool include_usage_in_stream = true;
  nlohmann::json kvrelay_params;  // kv_transfer_params.kvrelay, kept verbatim (null if absent)
};

// Limits a request is checked against before it reaches the model thread.
struct CompletionLimits {
  std::uint32_t vocab_size = 0;
  std::uint32_t max_context = 0;  // prompt + max_tokens must fit
};

// Validates everything: prompt is a non-empty array of in-vocabulary ids, numbers in range,
// types right. Errors are kInvalidArgument with a message naming the field.
[[nodiscard]] Result<CompletionRequest> parse_completion_request(std::string_view body, const CompletionLimits& limits);

// What the worker measured for one request, echoed to the client in a "kvrelay" object.
struct CompletionStats {
  std::uint64_t prompt_tokens = 0;
  std::uint64_t cached_tokens = 0;   // imported from a KV prefix
  std::uint64_t prefill_tokens = 0;  // computed
  double prefill_ms = 0.0;
  double lookup_ms = 0.0;  // the connector's lookup (the sidecar's Resolve: choice, fetch, handoff)
  double import_ms = 0.0;  // loading the returned prefix into the session's KV cache
  double queue_ms = 0.0;
  double ttft_ms = 0.0;  // arrival to first token
  double total_ms = 0.0;
  std::uint64_t published_tokens = 0;
};

struct CompletionOutcome {
  GenerationResult generation;
  CompletionStats stats;
};

// Ids 3..258 are the bytes 0x00..0xFF; ids 0..2 (unk, BOS, EOS) render as nothing and merges as
// "<id>" (no tokenizer ships with the checkpoints).
[[nodiscard]] std::string render_tokens(std::span<const std::int32_t> tokens);

[[nodiscard]] std::string_view finish_reason_name(FinishReason reason);

struct ResponseIdentity {
  std::string id;
  std::int64_t created = 0;
  std::string model;
};

[[nodiscard]] nlohmann::json completion_response(const ResponseIdentity& identity, const CompletionOutcome& outcome);
[[nodiscard]] nlohmann::json stream_token_event(const ResponseIdentity& identity, std::int32_t token);
[[nodiscard]] nlohmann::json stream_final_event(const ResponseIdentity& identity, const CompletionOutcome& outcome);
[[nodiscard]] nlohmann::json stats_json(const CompletionStats& stats);

// "data: <json>\n\n" with invalid UTF-8 (raw byte tokens) replaced, never thrown on.
[[nodiscard]] std::string sse_event(const nlohmann::json& event);
[[nodiscard]] std::string dump_json(const nlohmann::json& value);

}  // namespace kvrelay::refworker
