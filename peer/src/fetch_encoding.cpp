#include "kvrelay/peer/fetch_encoding.h"

#include <chrono>

#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/core/kv_tokens.h"

namespace kvrelay::peer {

Result<EncodedFetch> encode_for_fetch(const KvLayout& entry_layout, std::span<const std::byte> entry_bytes,
                                      std::uint64_t skip_tokens, const codec::CodecSpec& spec,
                                      WarmBufferPool& buffers) {
  EncodedFetch encoded;
  encoded.layout = entry_layout;
  std::span<const std::byte> source = entry_bytes;
  WarmBufferPool::Lease tail;
  if (skip_tokens != 0) {
    encoded.layout = entry_layout.with_tokens(entry_layout.tokens - skip_tokens);
    KVRELAY_TRY(const auto tail_bytes, encoded.layout.total_bytes());
    tail = buffers.take(static_cast<std::size_t>(tail_bytes));
    KVRELAY_TRY(copy_token_range(entry_layout, entry_bytes, skip_tokens, entry_layout.tokens, tail.bytes()));
    source = tail.bytes();
  }
  codec::EncodeOptions options;
  options.zstd_stage = spec.zstd_stage;
  KVRELAY_TRY(const auto capacity, codec::max_frame_size(*spec.codec, encoded.layout, options));
  encoded.buffer = buffers.take(static_cast<std::size_t>(capacity));
  const auto raw = std::span(reinterpret_cast<const std::uint8_t*>(source.data()), source.size());
  const auto started = std::chrono::steady_clock::now();
  KVRELAY_TRY(encoded.frame_bytes,
              codec::encode_frame_into(*spec.codec, encoded.layout, raw, options, encoded.buffer.u8()));
  encoded.encode_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  encoded.raw_bytes = raw.size();
  return encoded;
}

}  // namespace kvrelay::peer
