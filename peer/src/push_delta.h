#pragma once

// A pushed delta (issue #27): the sender left out the leading blocks this receiver's summary
// listed, so the frame carries only the tokens after them; the receiver joins them onto the
// entry it holds for that prefix. A prefix gone since the summary is kNotFound "prefix_gone",
// and the sender pushes the whole entry instead.

#include <cstdint>
#include <memory>
#include <span>

#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/result.h"
#include "kvrelay/core/warm_buffers.h"
#include "kvrelay/kv_store/arena.h"
#include "kvrelay/kv_store/entry_chain.h"
#include "kvrelay/kv_store/entry_store.h"

namespace kvrelay::peer {

// The entry filed under the key of the chain's block skip_tokens / block_tokens - 1: exactly
// `skip_tokens` tokens of the tail's model shape, carrying token ids (KV published without them
// never leaves its node, so nothing is joined onto it) equal to the chain's first skip_tokens, in
// the chain's tenant. A lossy head under an exact tail is "prefix_gone" too: the sender then
// sends the whole exact entry instead of the join filing less exact KV than it could.
[[nodiscard]] Result<std::shared_ptr<const kv_store::StoredEntry>> delta_head(
    kv_store::EntryStore& store, std::uint64_t model_id, const kv_store::EntryChain& chain, kv_store::ChainScope scope,
    std::uint64_t skip_tokens, const KvLayout& tail_layout, bool tail_exact);

// `head` followed token-wise by `tail`, as a new entry (in `arena` when it has room).
[[nodiscard]] Result<std::shared_ptr<kv_store::StoredEntry>> join_delta(const kv_store::StoredEntry& head,
                                                                        const KvLayout& tail_layout,
                                                                        std::span<const std::byte> tail,
                                                                        WarmBufferPool& buffers,
                                                                        kv_store::ShmArena* arena);

}  // namespace kvrelay::peer
