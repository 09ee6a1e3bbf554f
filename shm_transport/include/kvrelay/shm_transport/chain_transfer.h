#pragma once

// An entry's chain (kv_store/entry_chain.h) on the data plane, from version 5: block_tokens,
// root, tenant and the count travel in the frame, the token ids in a memfd attached to it
// (SCM_RIGHTS), since the ids of a 100k-token context do not fit one 64 KiB datagram.

#include <cstdint>
#include <span>
#include <string>

#include "kvrelay/core/byte_io.h"
#include "kvrelay/core/result.h"
#include "kvrelay/core/unique_fd.h"
#include "kvrelay/kv_store/entry_chain.h"

namespace kvrelay::shm {

// The frame's part: a chain whose `tokens` are still in the attached memfd.
struct ChainHeader {
  std::uint32_t block_tokens = 0;
  BlockHash root = 0;
  std::string tenant;
  std::uint32_t count = 0;          // token ids in the memfd
  std::uint32_t prompt_tokens = 0;  // version 7: where the publisher's prompt ends (EntryChain)
  [[nodiscard]] static ChainHeader of(const kv_store::EntryChain& chain);
};

// u32 block_tokens, u64 root, u16-length tenant, u32 count, and from data-plane version 7 u32
// prompt_tokens. Decoding refuses a zero block size, more than kv_store::kMaxChainTokens ids, a
// count that is not whole blocks and a prompt boundary past the ids.
void encode_chain_header(ByteWriter& writer, const ChainHeader& header, std::uint32_t version);
[[nodiscard]] Result<ChainHeader> decode_chain_header(ByteReader& reader, std::uint32_t version);

// A memfd holding `tokens` (little-endian u32 each), sealed against writes.
[[nodiscard]] Result<UniqueFd> chain_tokens_memfd(std::span<const TokenId> tokens);

// The chain `header` announces, its ids read once (pread) from `fd`: a memfd sealed against
// shrink and grow holding exactly header.count ids. The sender may still write it, so the ids
// are copied, never mapped, and read again by nobody.
[[nodiscard]] Result<kv_store::EntryChain> read_chain(const ChainHeader& header, int fd);

}  // namespace kvrelay::shm
