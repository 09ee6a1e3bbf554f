#pragma once

// The summary medium's prompt work (issue #28, docs/summary.md), pure and testable: which part of
// B's completions prompt is A's context, the request that asks the summariser for a summary of
// it within the route's token budget, the summariser's reply, and B's prompt with the summary in
// place of that part. The front proxy's summary responder (src/summary_responder.h) runs them
// around its asynchronous summariser call.

#include <nlohmann/json.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/core/block_hash.h"
#include "kvrelay/core/policy.h"
#include "kvrelay/core/result.h"

namespace kvrelay::proxy {

enum class PromptKind : std::uint8_t { kTokenIds, kText };

// B's completions request as the summary medium reads it.
struct SummarisablePrompt {
  PromptKind kind = PromptKind::kTokenIds;
  std::vector<TokenId> tokens;  // kTokenIds (a batch of one, [[ids]], counts as its ids)
  std::string text;             // kText
  // The client's hints, kv_transfer_params.kvrelay.handoff_tokens / handoff_chars: how many
  // leading tokens (characters, Unicode code points, for a text prompt) are A's context.
  std::optional<std::uint64_t> handoff_tokens;
  std::optional<std::uint64_t> handoff_chars;
  std::string cache_salt;                   // vLLM's top-level cache_salt, else kv_transfer_params.cache_salt
  std::optional<std::uint32_t> max_tokens;  // B's answer budget, when the client set one
};

// The prompt of a completions body; an error saying why a summary cannot stand in any part of it
// (no prompt, a batch, ids out of range, a bad hint).
[[nodiscard]] Result<SummarisablePrompt> summarisable_prompt(std::string_view body);

// The part of the prompt a summary replaces: `tokens` leading ids, or for a text prompt its
// first `chars` characters, which are `text_bytes` bytes of UTF-8 (tokens then estimates them).
struct SummarySpan {
  std::uint64_t tokens = 0;
  std::optional<std::uint64_t> chars;
  std::size_t text_bytes = 0;
};

// A text prompt's span from the client's handoff_chars; an error when the prompt is shorter or
// its UTF-8 is malformed before that point. Tokens are estimated at 4 bytes each.
[[nodiscard]] Result<SummarySpan> text_span(const std::string& text, std::uint64_t chars);

// The summariser's request: the span (ids, or text followed by the route's instruction), the
// route's token budget, greedy (temperature 0), no stream; "model" when the route names one.
[[nodiscard]] std::string summariser_request_body(const SummarisablePrompt& prompt, const SummarySpan& span,
                                                  const RouteSummaryPolicy& settings);

struct Summary {
  std::vector<TokenId> tokens;          // token-id prompts: choices[0].token_ids
  std::string text;                     // text prompts: choices[0].text
  std::uint64_t completion_tokens = 0;  // usage.completion_tokens when reported, else the ids' count
};

// The summariser's answer. A token-id prompt needs choices[0].token_ids (the reference worker
// gives them); text alone cannot be fed back as ids without the
// model's tokenizer, so it is an error, as is an empty summary or a status outside 2xx.
[[nodiscard]] Result<Summary> parse_summariser_reply(unsigned status, std::string_view body, PromptKind kind);

// B's body with the span replaced: the summary's ids before the rest of the ids, or the route's
// template with {summary} filled before the rest of the text. Every other field is kept.
[[nodiscard]] Result<std::string> body_with_summary(std::string_view body, const SummarisablePrompt& prompt,
                                                    const SummarySpan& span, const Summary& summary,
                                                    const std::string& prompt_template);

// The summary's size as it crosses to B: 4 bytes per token id, the text's bytes.
[[nodiscard]] std::uint64_t summary_bytes(const Summary& summary, PromptKind kind);

}  // namespace kvrelay::proxy
