#include "kvrelay/kv_store/entry_slice.h"

#include <fmt/format.h>

#include <vector>

#include "kvrelay/core/kv_tokens.h"
#include "kvrelay/kv_store/entry_chain.h"

namespace kvrelay::kv_store {

Result<std::shared_ptr<const StoredEntry>> slice_entry(const StoredEntry& entry, std::uint64_t tokens,
                                                       ShmArena* arena) {
  const KvLayout& layout = entry.info.layout;
  if (layout.layers == 0) return fail(ErrorCode::kLayoutMismatch, "cannot slice an opaque entry");
  if (tokens > layout.tokens) {  // checked before the slice's buffer is allocated
    return fail(ErrorCode::kOutOfRange, fmt::format("slice of {} tokens from an entry of {}", tokens, layout.tokens));
  }
  KVRELAY_TRY(const auto view, view_entry(entry));
  const KvLayout sliced = layout.with_tokens(tokens);
  KVRELAY_TRY(const std::uint64_t total, sliced.total_bytes());
  std::vector<std::byte> bytes(static_cast<std::size_t>(total));
  KVRELAY_TRY(copy_token_range(layout, view.bytes(), 0, tokens, bytes));
  KVRELAY_TRY(auto stored, make_stored_entry(sliced, bytes, arena));
  stored->fidelity = entry.fidelity.prefix(tokens);
  if (entry.chain) stored->chain = std::make_shared<const EntryChain>(chain_prefix(*entry.chain, tokens));
  return std::shared_ptr<const StoredEntry>(std::move(stored));
}

Result<std::shared_ptr<const StoredEntry>> select_entry_tokens(const StoredEntry& entry, std::span<const TokenRun> runs,
                                                               ShmArena* arena, const Fidelity* fidelity) {
  const KvLayout& layout = entry.info.layout;
  if (layout.layers == 0) return fail(ErrorCode::kLayoutMismatch, "cannot select tokens of an opaque entry");
  KVRELAY_TRY(check_token_runs(runs, layout.tokens));  // before the selection's buffer is allocated
  KVRELAY_TRY(const auto view, view_entry(entry));
  const KvLayout selected = layout.with_tokens(run_tokens(runs));
  KVRELAY_TRY(const std::uint64_t total, selected.total_bytes());
  std::vector<std::byte> bytes(static_cast<std::size_t>(total));
  KVRELAY_TRY(copy_token_runs(layout, view.bytes(), runs, bytes));
  KVRELAY_TRY(auto stored, make_stored_entry(selected, bytes, arena));
  stored->fidelity =
      fidelity != nullptr ? *fidelity : entry.fidelity.prefix(std::uint64_t{runs.back().start} + runs.back().length);
  return std::shared_ptr<const StoredEntry>(std::move(stored));
}

}  // namespace kvrelay::kv_store
