#pragma once

// The first tokens of a stored entry as an entry of their own: what a lookup serves when the
// store holds more than the prefix asked for (a longer chain's entry, the prompt's limit).

#include <cstdint>
#include <memory>

#include "kvrelay/core/kv_tokens.h"
#include "kvrelay/core/result.h"
#include "kvrelay/kv_store/arena.h"
#include "kvrelay/kv_store/entry.h"

namespace kvrelay::kv_store {

// The first `tokens` tokens of an entry's KV (every layer's K and V) as a new sealed entry, in
// `arena` when one is given and has room: the fidelity of those tokens, the chain's prefix.
[[nodiscard]] Result<std::shared_ptr<const StoredEntry>> slice_entry(const StoredEntry& entry, std::uint64_t tokens,
                                                                     ShmArena* arena = nullptr);

// The tokens `runs` select (a span that does not start at 0, or kept positions) as a new sealed
// entry, for one worker: no chain (it is not a prefix of one), its fidelity `fidelity` when given,
// else that of the tokens up to the last run's end (positions keep their original numbering).
[[nodiscard]] Result<std::shared_ptr<const StoredEntry>> select_entry_tokens(const StoredEntry& entry,
                                                                             std::span<const TokenRun> runs,
                                                                             ShmArena* arena = nullptr,
                                                                             const Fidelity* fidelity = nullptr);

}  // namespace kvrelay::kv_store
