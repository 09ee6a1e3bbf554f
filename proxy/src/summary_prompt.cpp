#include "kvrelay/proxy/summary_prompt.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace kvrelay::proxy {

namespace {

using nlohmann::json;

auto invalid_prompt(std::string message) {
  return fail(ErrorCode::kInvalidArgument, std::move(message));
}

Result<std::optional<std::uint64_t>> read_hint(const json& kvrelay, const char* field) {
  const auto it = kvrelay.find(field);
  if (it == kvrelay.end() || it->is_null()) return std::optional<std::uint64_t>();
  if (!it->is_number_unsigned() || it->get<std::uint64_t>() == 0) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("kv_transfer_params.kvrelay.{} must be a positive integer, got {}", field, it->dump()));
  }
  return std::optional<std::uint64_t>(it->get<std::uint64_t>());
}

// The prompt member of a body as the proxy forwards it: a batch of one ([[ids]]) is its ids.
const json* prompt_of(const json& document) {
  const auto it = document.find("prompt");
  if (it == document.end()) return nullptr;
  if (it->is_array() && it->size() == 1 && (*it)[0].is_array()) return &(*it)[0];
  return &*it;
}

// Bytes of one UTF-8 sequence starting with `lead`; 0 for a byte that cannot start one.
std::size_t utf8_sequence_bytes(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead & 0xE0) == 0xC0) return 2;
  if ((lead & 0xF0) == 0xE0) return 3;
  if ((lead & 0xF8) == 0xF0) return 4;
  return 0;
}

}  // namespace

Result<SummarisablePrompt> summarisable_prompt(std::string_view body) {
  const json document = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!document.is_object()) return invalid_prompt("request body is not a JSON object");
  SummarisablePrompt prompt;
  const json* value = prompt_of(document);
  if (value == nullptr) return invalid_prompt("no prompt (chat messages are not summarised)");
  if (value->is_string()) {
    prompt.kind = PromptKind::kText;
    prompt.text = value->get<std::string>();
  } else if (value->is_array() && !value->empty()) {
    prompt.kind = PromptKind::kTokenIds;
    prompt.tokens.reserve(value->size());
    for (const auto& id : *value) {
      if (!id.is_number_unsigned() || id.get<std::uint64_t>() > std::numeric_limits<TokenId>::max()) {
        return invalid_prompt(fmt::format("prompt holds {}, not a token id", id.dump()));
      }
      prompt.tokens.push_back(id.get<TokenId>());
    }
  } else {
    return invalid_prompt("the prompt is neither text nor one list of token ids");
  }
  const auto params = document.find("kv_transfer_params");
  const bool has_params = params != document.end() && params->is_object();
  if (has_params) {
    if (const auto kvrelay = params->find("kvrelay"); kvrelay != params->end() && kvrelay->is_object()) {
      KVRELAY_TRY(const auto tokens, read_hint(*kvrelay, "handoff_tokens"));
      KVRELAY_TRY(const auto chars, read_hint(*kvrelay, "handoff_chars"));
      prompt.handoff_tokens = tokens;
      prompt.handoff_chars = chars;
    }
  }
  if (const auto budget = document.find("max_tokens"); budget != document.end() && budget->is_number_unsigned()) {
    prompt.max_tokens = static_cast<std::uint32_t>(std::min<std::uint64_t>(budget->get<std::uint64_t>(), UINT32_MAX));
  }
  for (const json* holder : {&document, has_params ? &*params : nullptr}) {
    if (holder == nullptr) continue;
    const auto salt = holder->find("cache_salt");
    if (salt != holder->end() && salt->is_string()) {
      prompt.cache_salt = salt->get<std::string>();
      break;
    }
  }
  return prompt;
}

Result<SummarySpan> text_span(const std::string& text, std::uint64_t chars) {
  std::size_t bytes = 0;
  for (std::uint64_t index = 0; index < chars; ++index) {
    if (bytes >= text.size()) {
      return fail(ErrorCode::kOutOfRange,
                  fmt::format("handoff_chars {} exceeds the prompt's {} characters", chars, index));
    }
    const std::size_t length = utf8_sequence_bytes(static_cast<unsigned char>(text[bytes]));
    if (length == 0 || bytes + length > text.size()) {
      return fail(ErrorCode::kInvalidArgument, fmt::format("the prompt is not UTF-8 at byte {}", bytes));
    }
    bytes += length;
  }
  SummarySpan span;
  span.chars = chars;
  span.text_bytes = bytes;
  span.tokens = (bytes + 3) / 4;  // no tokenizer here: ~4 bytes a token, for pricing and the record
  return span;
}

std::string summariser_request_body(const SummarisablePrompt& prompt, const SummarySpan& span,
                                    const RouteSummaryPolicy& settings) {
  json request{{"max_tokens", settings.max_tokens}, {"temperature", 0}, {"stream", false}};
  if (prompt.kind == PromptKind::kTokenIds) {
    const auto end =
        prompt.tokens.begin() + static_cast<std::ptrdiff_t>(std::min<std::uint64_t>(span.tokens, prompt.tokens.size()));
    request["prompt"] = std::vector<TokenId>(prompt.tokens.begin(), end);
  } else {
    request["prompt"] = prompt.text.substr(0, span.text_bytes) + settings.instruction;
  }
  if (!settings.model.empty()) request["model"] = settings.model;
  return request.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<Summary> parse_summariser_reply(unsigned status, std::string_view body, PromptKind kind) {
  const auto snippet = [&] { return std::string(body.substr(0, 200)); };
  if (status < 200 || status >= 300) {
    return fail(ErrorCode::kIo, fmt::format("the summariser answered {}: {}", status, snippet()));
  }
  const json document = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!document.is_object()) return fail(ErrorCode::kInvalidArgument, "the summariser's answer is not a JSON object");
  const auto choices = document.find("choices");
  if (choices == document.end() || !choices->is_array() || choices->empty() || !(*choices)[0].is_object()) {
    return fail(ErrorCode::kInvalidArgument, "the summariser's answer has no choices[0]");
  }
  const json& choice = (*choices)[0];
  Summary summary;
  if (kind == PromptKind::kTokenIds) {
    const auto ids = choice.find("token_ids");
    if (ids == choice.end() || !ids->is_array()) {
      return fail(ErrorCode::kUnsupported,
                  "the summariser returned no token ids (choices[0].token_ids) for a token-id prompt");
    }
    for (const auto& id : *ids) {
      if (!id.is_number_unsigned() || id.get<std::uint64_t>() > std::numeric_limits<TokenId>::max()) {
        return fail(ErrorCode::kInvalidArgument, fmt::format("the summariser returned {} as a token id", id.dump()));
      }
      summary.tokens.push_back(id.get<TokenId>());
    }
    if (summary.tokens.empty()) return fail(ErrorCode::kNotFound, "the summariser returned an empty summary");
    summary.completion_tokens = summary.tokens.size();
  } else {
    const auto text = choice.find("text");
    if (text == choice.end() || !text->is_string() || text->get_ref<const std::string&>().empty()) {
      return fail(ErrorCode::kNotFound, "the summariser returned no text (choices[0].text)");
    }
    summary.text = text->get<std::string>();
  }
  if (const auto usage = document.find("usage"); usage != document.end() && usage->is_object()) {
    const auto completion = usage->find("completion_tokens");
    if (completion != usage->end() && completion->is_number_unsigned()) {
      summary.completion_tokens = completion->get<std::uint64_t>();
    }
  }
  if (kind == PromptKind::kText && summary.completion_tokens == 0)
    summary.completion_tokens = (summary.text.size() + 3) / 4;
  return summary;
}

Result<std::string> body_with_summary(std::string_view body, const SummarisablePrompt& prompt, const SummarySpan& span,
                                      const Summary& summary, const std::string& prompt_template) {
  json document = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!document.is_object() || !document.contains("prompt")) {
    return fail(ErrorCode::kInvalidArgument, "request body has no prompt");
  }
  if (prompt.kind == PromptKind::kTokenIds) {
    if (span.tokens > prompt.tokens.size()) {
      return fail(ErrorCode::kOutOfRange,
                  fmt::format("span of {} tokens exceeds the prompt's {}", span.tokens, prompt.tokens.size()));
    }
    std::vector<TokenId> ids = summary.tokens;
    ids.insert(ids.end(), prompt.tokens.begin() + static_cast<std::ptrdiff_t>(span.tokens), prompt.tokens.end());
    document["prompt"] = std::move(ids);
  } else {
    if (span.text_bytes > prompt.text.size()) {
      return fail(ErrorCode::kOutOfRange, "span exceeds the prompt's text");
    }
    std::string filled;
    constexpr std::string_view kPlaceholder = "{summary}";
    std::size_t from = 0;
    for (std::size_t at = prompt_template.find(kPlaceholder); at != std::string::npos;
         at = prompt_template.find(kPlaceholder, from)) {
      filled.append(prompt_template, from, at - from);
      filled += summary.text;
      from = at + kPlaceholder.size();
    }
    filled.append(prompt_template, from);
    document["prompt"] = filled + prompt.text.substr(span.text_bytes);
  }
  return document.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::uint64_t summary_bytes(const Summary& summary, PromptKind kind) {
  return kind == PromptKind::kTokenIds ? summary.tokens.size() * sizeof(TokenId) : summary.text.size();
}

}  // namespace kvrelay::proxy
