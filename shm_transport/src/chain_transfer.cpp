#include "kvrelay/shm_transport/chain_transfer.h"

#include <fmt/format.h>

#include "kvrelay/kv_store/memfd.h"
#include "kvrelay/shm_transport/control_protocol.h"

namespace kvrelay::shm {

ChainHeader ChainHeader::of(const kv_store::EntryChain& chain) {
  return {chain.block_tokens, chain.root, chain.tenant, static_cast<std::uint32_t>(chain.tokens.size()),
          chain.prompt_tokens};
}

void encode_chain_header(ByteWriter& writer, const ChainHeader& header, std::uint32_t version) {
  writer.put(header.block_tokens).put(header.root).put_string(header.tenant).put(header.count);
  if (version >= kSpanDataPlaneVersion) writer.put(header.prompt_tokens);
}

Result<ChainHeader> decode_chain_header(ByteReader& reader, std::uint32_t version) {
  const auto block_tokens = reader.get<std::uint32_t>();
  const auto root = reader.get<std::uint64_t>();
  auto tenant = reader.get_string();
  const auto count = reader.get<std::uint32_t>();
  if (!block_tokens || !root || !tenant || !count) return fail(ErrorCode::kTruncated, "chain header truncated");
  if (*block_tokens == 0) return fail(ErrorCode::kProtocol, "chain with a block size of 0 tokens");
  if (*count > kv_store::kMaxChainTokens) {
    return fail(ErrorCode::kResourceExhausted,
                fmt::format("chain of {} token ids (at most {})", *count, kv_store::kMaxChainTokens));
  }
  if (*count % *block_tokens != 0) {
    return fail(ErrorCode::kProtocol,
                fmt::format("chain of {} token ids is not whole blocks of {}", *count, *block_tokens));
  }
  std::uint32_t prompt_tokens = 0;
  if (version >= kSpanDataPlaneVersion) {
    const auto boundary = reader.get<std::uint32_t>();
    if (!boundary) return fail(ErrorCode::kTruncated, "chain header truncated (prompt boundary)");
    if (*boundary > *count) {
      return fail(ErrorCode::kProtocol,
                  fmt::format("chain's prompt ends at token {}, past its {} ids", *boundary, *count));
    }
    prompt_tokens = *boundary;
  }
  return ChainHeader{*block_tokens, *root, std::move(*tenant), *count, prompt_tokens};
}

Result<UniqueFd> chain_tokens_memfd(std::span<const TokenId> tokens) {
  const auto bytes = std::as_bytes(tokens);
  KVRELAY_TRY(auto fd, kv_store::create_sealed_memfd_to_fill("kvrelay-chain", bytes.size()));
  KVRELAY_TRY(kv_store::write_memfd(fd.get(), 0, bytes));
  KVRELAY_TRY(kv_store::seal_contents(fd.get()));
  return fd;
}

Result<kv_store::EntryChain> read_chain(const ChainHeader& header, int fd) {
  auto size = kv_store::check_sealed_memfd(fd, 0);
  if (!size) return fail(size.error().code, fmt::format("chain token ids: {}", size.error().message));
  const std::uint64_t expected = std::uint64_t{header.count} * sizeof(TokenId);
  if (size.value() != expected) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("chain token-id memfd holds {} bytes; the frame announces {} ids ({} bytes)", size.value(),
                            header.count, expected));
  }
  kv_store::EntryChain chain;
  chain.block_tokens = header.block_tokens;
  chain.root = header.root;
  chain.tenant = header.tenant;
  chain.prompt_tokens = header.prompt_tokens;
  chain.tokens.resize(header.count);
  KVRELAY_TRY(kv_store::read_memfd(fd, 0, std::as_writable_bytes(std::span(chain.tokens))));
  return chain;
}

}  // namespace kvrelay::shm
