#include "kvrelay/core/kv_tokens.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

namespace kvrelay {

namespace {

Status expect_bytes(std::string_view what, const KvLayout& layout, std::size_t actual) {
  KVRELAY_TRY(const std::uint64_t expected, layout.total_bytes());
  if (expected != actual) {
    return fail(ErrorCode::kLayoutMismatch,
                fmt::format("{} holds {} bytes, its layout ({}) needs {}", what, actual, layout.describe(), expected));
  }
  return ok();
}

// Bytes of one token of one K or V tensor.
Result<std::uint64_t> tensor_row_bytes(const KvLayout& layout) {
  KVRELAY_TRY(layout.validate());
  KVRELAY_TRY(const std::uint64_t elements, layout.elements_per_token_row());
  return checked_mul(elements, dtype_size(layout.dtype));
}

}  // namespace

Status copy_token_range(const KvLayout& layout, std::span<const std::byte> kv, std::uint64_t begin, std::uint64_t end,
                        std::span<std::byte> out) {
  if (begin > end || end > layout.tokens) {
    return fail(ErrorCode::kOutOfRange,
                fmt::format("token range [{}, {}) outside a cache of {} tokens", begin, end, layout.tokens));
  }
  KVRELAY_TRY(expect_bytes("source cache", layout, kv.size()));
  KVRELAY_TRY(expect_bytes("destination", layout.with_tokens(end - begin), out.size()));
  KVRELAY_TRY(const std::uint64_t row, tensor_row_bytes(layout));
  const std::uint64_t tensors = 2ULL * layout.layers;
  const std::uint64_t count = (end - begin) * row;
  if (count == 0) return ok();  // empty spans may carry null pointers, which memcpy must not get
  for (std::uint64_t tensor = 0; tensor < tensors; ++tensor) {
    std::memcpy(out.data() + tensor * count, kv.data() + (tensor * layout.tokens + begin) * row,
                static_cast<std::size_t>(count));
  }
  return ok();
}

Status join_tokens(const KvLayout& head_layout, std::span<const std::byte> head, const KvLayout& tail_layout,
                   std::span<const std::byte> tail, std::span<std::byte> out) {
  if (head_layout.with_tokens(0) != tail_layout.with_tokens(0)) {
    return fail(ErrorCode::kLayoutMismatch,
                fmt::format("cannot join a cache of {} to one of {}", tail_layout.describe(), head_layout.describe()));
  }
  KVRELAY_TRY(const std::uint64_t tokens, checked_add(head_layout.tokens, tail_layout.tokens));
  KVRELAY_TRY(expect_bytes("head cache", head_layout, head.size()));
  KVRELAY_TRY(expect_bytes("tail cache", tail_layout, tail.size()));
  KVRELAY_TRY(expect_bytes("destination", head_layout.with_tokens(tokens), out.size()));
  KVRELAY_TRY(const std::uint64_t row, tensor_row_bytes(head_layout));
  const std::uint64_t head_bytes = head_layout.tokens * row;
  const std::uint64_t tail_bytes = tail_layout.tokens * row;
  for (std::uint64_t tensor = 0; tensor < 2ULL * head_layout.layers; ++tensor) {
    std::byte* target = out.data() + tensor * (head_bytes + tail_bytes);
    if (head_bytes != 0) std::memcpy(target, head.data() + tensor * head_bytes, static_cast<std::size_t>(head_bytes));
    if (tail_bytes != 0) {
      std::memcpy(target + head_bytes, tail.data() + tensor * tail_bytes, static_cast<std::size_t>(tail_bytes));
    }
  }
  return ok();
}

std::uint64_t run_tokens(std::span<const TokenRun> runs) noexcept {
  std::uint64_t total = 0;
  for (const TokenRun& run : runs)
    total += run.length;
  return total;
}

Status check_token_runs(std::span<const TokenRun> runs, std::uint64_t tokens) {
  std::uint64_t next = 0;  // the first position the next run may start at
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const TokenRun& run = runs[i];
    const std::uint64_t end = std::uint64_t{run.start} + run.length;
    if (run.length == 0) return fail(ErrorCode::kInvalidArgument, fmt::format("token run {} is empty", i));
    if (run.start < next) {
      return fail(ErrorCode::kInvalidArgument,
                  fmt::format("token run {} starts at {}, before the previous run ends ({})", i, run.start, next));
    }
    if (end > tokens) {
      return fail(ErrorCode::kOutOfRange,
                  fmt::format("token run {} ends at {}, past the {} tokens it selects from", i, end, tokens));
    }
    next = end;
  }
  return ok();
}

void coarsen_token_runs(std::vector<TokenRun>& runs, std::size_t max_runs) {
  for (std::uint64_t gap = 1; runs.size() > std::max<std::size_t>(max_runs, 1); gap *= 2) {
    std::vector<TokenRun> merged;
    merged.reserve(runs.size());
    for (const TokenRun& run : runs) {
      const std::uint64_t previous_end = merged.empty() ? 0 : std::uint64_t{merged.back().start} + merged.back().length;
      if (!merged.empty() && run.start - previous_end <= gap) {
        merged.back().length = static_cast<std::uint32_t>(std::uint64_t{run.start} + run.length - merged.back().start);
      } else {
        merged.push_back(run);
      }
    }
    runs = std::move(merged);
  }
}

Status copy_token_runs(const KvLayout& layout, std::span<const std::byte> kv, std::span<const TokenRun> runs,
                       std::span<std::byte> out) {
  KVRELAY_TRY(check_token_runs(runs, layout.tokens));
  KVRELAY_TRY(expect_bytes("cache", layout, kv.size()));
  const std::uint64_t kept = run_tokens(runs);
  KVRELAY_TRY(expect_bytes("destination", layout.with_tokens(kept), out.size()));
  KVRELAY_TRY(const std::uint64_t row, tensor_row_bytes(layout));
  std::byte* target = out.data();
  for (std::uint64_t tensor = 0; tensor < 2ULL * layout.layers; ++tensor) {
    const std::byte* source = kv.data() + tensor * layout.tokens * row;
    for (const TokenRun& run : runs) {
      const std::uint64_t bytes = std::uint64_t{run.length} * row;
      std::memcpy(target, source + std::uint64_t{run.start} * row, static_cast<std::size_t>(bytes));
      target += bytes;
    }
  }
  return ok();
}

}  // namespace kvrelay
