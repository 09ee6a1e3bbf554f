#pragma once

// Which blocks of a lookup an audit treatment's span serves (issue #28): A's prompt span (T1),
// A's generated span (T2) or all of it (T3), cut at the prompt boundary A's worker reported when
// it published (EntryChain::prompt_tokens). Pure: no I/O.

#include <cstddef>
#include <cstdint>
#include <optional>

#include "kvrelay/core/result.h"
#include "kvrelay/core/treatment.h"

namespace kvrelay::broker {

// Blocks [first_block, end_block) of the lookup's chain.
struct SpanCut {
  std::size_t first_block = 0;
  std::size_t end_block = 0;
  [[nodiscard]] std::size_t blocks() const noexcept { return end_block - first_block; }
};

struct SpanInputs {
  KvSpan span = KvSpan::kAll;
  std::size_t available_blocks = 0;  // what the lookup could serve whole (held or fetched)
  std::uint32_t block_tokens = 0;
  // Where A's prompt ends: the treatment's own prompt_tokens (the offline runner knows it), else
  // the served entry's chain; nullopt when neither says.
  std::optional<std::uint64_t> prompt_boundary;
  bool client_takes_spans = false;  // the worker set kResolveSpan: it prefills what precedes a span
};

// kNotFound with the reason a span cannot be delivered (the worker then prefills everything).
// kNone and kAll serve every available block.
[[nodiscard]] Result<SpanCut> cut_span(const SpanInputs& in);

}  // namespace kvrelay::broker
