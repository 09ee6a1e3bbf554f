#pragma once

// The first tokens of a stored entry as an entry of their own: what a lookup serves when the
// store holds more than the prefix asked for (a longer chain's entry, the prompt's limit).

#include <cstdint>
#include <memory>

#include "kvrelay/core/result.h"
#include "kvrelay/kv_store/arena.h"
#include "kvrelay/kv_store/entry.h"

namespace kvrelay::kv_store {

// The first `tokens` tokens of an entry's KV (every layer's K and V) as a new sealed entry, in
// `arena` when one is given and has room: the fidelity of those tokens, the chain's prefix.
[[nodiscard]] Result<std::shared_ptr<const StoredEntry>> slice_entry(const StoredEntry& entry, std::uint64_t tokens,
                                                                     ShmArena* arena = nullptr);

}  // namespace kvrelay::kv_store
