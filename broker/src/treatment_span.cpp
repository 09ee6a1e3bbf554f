#include "treatment_span.h"

#include <fmt/format.h>

namespace kvrelay::broker {

Result<SpanCut> cut_span(const SpanInputs& in) {
  const SpanCut all{0, in.available_blocks};
  if (in.span == KvSpan::kNone || in.span == KvSpan::kAll || in.block_tokens == 0) return all;
  if (in.span == KvSpan::kGenerated && !in.client_takes_spans) {
    return fail(ErrorCode::kNotFound,
                "span generated: the receiving worker imports leading prefixes only (it did not ask for spans)");
  }
  if (!in.prompt_boundary) {
    return fail(ErrorCode::kNotFound,
                fmt::format("span {}: the published KV does not say where A's prompt ends", span_name(in.span)));
  }
  const std::uint64_t boundary = *in.prompt_boundary;
  if (in.span == KvSpan::kPrompt) {
    const auto end = static_cast<std::size_t>(std::min<std::uint64_t>(in.available_blocks, boundary / in.block_tokens));
    if (end == 0) {
      return fail(ErrorCode::kNotFound,
                  fmt::format("span prompt: A's prompt ({} tokens) holds no whole block of {} tokens that this "
                              "lookup can serve",
                              boundary, in.block_tokens));
    }
    return SpanCut{0, end};
  }
  // The block that holds the boundary is part prompt: the receiver computes it with the prompt.
  const auto first = static_cast<std::size_t>((boundary + in.block_tokens - 1) / in.block_tokens);
  if (first >= in.available_blocks) {
    return fail(ErrorCode::kNotFound,
                fmt::format("span generated: no whole block of A's answer (after its {}-token prompt) among the {} "
                            "blocks this lookup can serve",
                            boundary, in.available_blocks));
  }
  return SpanCut{first, in.available_blocks};
}

}  // namespace kvrelay::broker
