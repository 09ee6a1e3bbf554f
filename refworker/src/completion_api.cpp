#include "kvrelay/refworker/completion_api.h"

#include <fmt/format.h>

#include <random>

namespace kvrelay::refworker {

namespace {

using nlohmann::json;

auto invalid(std::string message) {
  return fail(ErrorCode::kInvalidArgument, std::move(message));
}

// Reads an optional unsigned integer field within [min, max].
Status read_uint(const json& body, const char* name, std::uint64_t min, std::uint64_t max, std::uint64_t& out) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return ok();
  if (!it->is_number_integer()) return invalid(fmt::format("'{}' must be an integer", name));
  if (it->is_number_unsigned()) {
    out = it->get<std::uint64_t>();
  } else {
    const auto value = it->get<std::int64_t>();
    if (value < 0) return invalid(fmt::format("'{}' must be >= {}", name, min));
    out = static_cast<std::uint64_t>(value);
  }
  if (out < min || out > max) return invalid(fmt::format("'{}' = {} outside {}..{}", name, out, min, max));
  return ok();
}

Status read_bool(const json& body, const char* name, bool& out) {
  const auto it = body.find(name);
  if (it == body.end() || it->is_null()) return ok();
  if (!it->is_boolean()) return invalid(fmt::format("'{}' must be a boolean", name));
  out = it->get<bool>();
  return ok();
}

}  // namespace

Result<CompletionRequest> parse_completion_request(std::string_view body_text, const CompletionLimits& limits) {
  const json body = json::parse(body_text, nullptr, false);
  if (body.is_discarded()) return invalid("request body is not valid JSON");
  if (!body.is_object()) return invalid("request body must be a JSON object");
  CompletionRequest request;

  if (const auto it = body.find("model"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return invalid("'model' must be a string");
    request.model = it->get<std::string>();
  }

  const auto prompt = body.find("prompt");
  if (prompt == body.end()) return invalid("'prompt' is required");
  const json* ids = &*prompt;
  // [[ids]] (a batch of one) is accepted as OpenAI clients send it; larger batches are not.
  if (ids->is_array() && ids->size() == 1 && (*ids)[0].is_array()) ids = &(*ids)[0];
  if (!ids->is_array()) return invalid("'prompt' must be an array of token ids (this worker has no tokenizer)");
  if (ids->empty()) return invalid("'prompt' must not be empty");
  request.prompt.reserve(ids->size());
  for (std::size_t i = 0; i < ids->size(); ++i) {
    const json& id = (*ids)[i];
    if (!id.is_number_integer()) return invalid(fmt::format("'prompt[{}]' is not an integer token id", i));
    const auto value = id.get<std::int64_t>();
    if (value < 0 || value >= static_cast<std::int64_t>(limits.vocab_size)) {
      return fail(ErrorCode::kOutOfRange,
                  fmt::format("'prompt[{}]' = {} outside the vocabulary 0..{}", i, value, limits.vocab_size - 1));
    }
    request.prompt.push_back(static_cast<std::int32_t>(value));
  }

  std::uint64_t max_tokens = 16;
  KVRELAY_TRY(read_uint(body, "max_tokens", 1, limits.max_context, max_tokens));
  if (request.prompt.size() + max_tokens > limits.max_context) {
    return fail(ErrorCode::kOutOfRange,
                fmt::format("prompt of {} tokens + max_tokens {} exceeds the model's context of {} tokens",
                            request.prompt.size(), max_tokens, limits.max_context));
  }
  request.generation.max_tokens = static_cast<std::uint32_t>(max_tokens);

  // OpenAI's default temperature is 1; clients ask for greedy with 0.
  request.generation.sampling.temperature = 1.0F;
  if (const auto it = body.find("temperature"); it != body.end() && !it->is_null()) {
    if (!it->is_number()) return invalid("'temperature' must be a number");
    const double temperature = it->get<double>();
    if (!(temperature >= 0.0 && temperature <= 100.0)) return invalid("'temperature' must be within 0..100");
    request.generation.sampling.temperature = static_cast<float>(temperature);
  }
  if (const auto it = body.find("top_k"); it != body.end() && !it->is_null()) {
    // vLLM's convention: -1 (or 0) disables top-k.
    if (!it->is_number_integer()) return invalid("'top_k' must be an integer");
    const auto top_k = it->get<std::int64_t>();
    if (top_k < -1 || top_k > static_cast<std::int64_t>(limits.vocab_size)) {
      return invalid(fmt::format("'top_k' = {} outside -1..{}", top_k, limits.vocab_size));
    }
    request.generation.sampling.top_k = top_k <= 0 ? 0U : static_cast<std::uint32_t>(top_k);
  }
  if (body.contains("seed") && !body["seed"].is_null()) {
    std::uint64_t seed = 0;
    KVRELAY_TRY(read_uint(body, "seed", 0, UINT64_MAX, seed));
    request.generation.sampling.seed = seed;
  } else {
    request.generation.sampling.seed = std::random_device{}();
  }
  bool ignore_eos = false;
  KVRELAY_TRY(read_bool(body, "ignore_eos", ignore_eos));
  request.generation.stop_at_eos = !ignore_eos;
  KVRELAY_TRY(read_bool(body, "stream", request.stream));
  if (const auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) return invalid("'stream_options' must be an object");
    KVRELAY_TRY(read_bool(*it, "include_usage", request.include_usage_in_stream));
  }
  if (const auto it = body.find("kv_transfer_params"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) return invalid("'kv_transfer_params' must be an object");
    if (const auto params = it->find("kvrelay"); params != it->end()) request.kvrelay_params = *params;
  }
  return request;
}

std::string render_tokens(std::span<const std::int32_t> tokens) {
  std::string text;
  for (const std::int32_t token : tokens) {
    if (token >= 3 && token <= 258) {
      text.push_back(static_cast<char>(static_cast<unsigned char>(token - 3)));
    } else if (token > 258) {
      text += fmt::format("<{}>", token);
    }
  }
  return text;
}

std::string_view finish_reason_name(FinishReason reason) {
  return reason == FinishReason::kStop ? "stop" : "length";
}

json stats_json(const CompletionStats& stats) {
  return {{"prompt_tokens", stats.prompt_tokens},
          {"cached_tokens", stats.cached_tokens},
          {"prefill_tokens", stats.prefill_tokens},
          {"prefill_ms", stats.prefill_ms},
          {"lookup_ms", stats.lookup_ms},
          {"import_ms", stats.import_ms},
          {"queue_ms", stats.queue_ms},
          {"ttft_ms", stats.ttft_ms},
          {"total_ms", stats.total_ms},
          {"published_tokens", stats.published_tokens}};
}

namespace {

json usage_json(const CompletionOutcome& outcome) {
  const auto completion = outcome.generation.tokens.size();
  return {{"prompt_tokens", outcome.stats.prompt_tokens},
          {"completion_tokens", completion},
          {"total_tokens", outcome.stats.prompt_tokens + completion},
          {"prompt_tokens_details", {{"cached_tokens", outcome.stats.cached_tokens}}}};
}

json envelope(const ResponseIdentity& identity, json choice) {
  return {{"id", identity.id},
          {"object", "text_completion"},
          {"created", identity.created},
          {"model", identity.model},
          {"choices", json::array({std::move(choice)})}};
}

}  // namespace

json completion_response(const ResponseIdentity& identity, const CompletionOutcome& outcome) {
  const auto& tokens = outcome.generation.tokens;
  json response = envelope(identity, {{"index", 0},
                                      {"text", render_tokens(tokens)},
                                      {"token_ids", tokens},
                                      {"logprobs", nullptr},
                                      {"finish_reason", finish_reason_name(outcome.generation.finish_reason)}});
  response["usage"] = usage_json(outcome);
  response["kvrelay"] = stats_json(outcome.stats);
  return response;
}

json stream_token_event(const ResponseIdentity& identity, std::int32_t token) {
  const std::int32_t one[1] = {token};
  return envelope(identity, {{"index", 0},
                             {"text", render_tokens(one)},
                             {"token_ids", json::array({token})},
                             {"logprobs", nullptr},
                             {"finish_reason", nullptr}});
}

json stream_final_event(const ResponseIdentity& identity, const CompletionOutcome& outcome) {
  json event = envelope(identity, {{"index", 0},
                                   {"text", ""},
                                   {"token_ids", json::array()},
                                   {"logprobs", nullptr},
                                   {"finish_reason", finish_reason_name(outcome.generation.finish_reason)}});
  event["usage"] = usage_json(outcome);
  event["kvrelay"] = stats_json(outcome.stats);
  return event;
}

std::string dump_json(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string sse_event(const json& event) {
  return "data: " + dump_json(event) + "\n\n";
}

}  // namespace kvrelay::refworker
