#pragma once

// A Fetch's answer before it goes out: the KV of an entry after the asker's prefix, encoded with
// the requested codec in a warm buffer. The TCP peer server and a same-host fetch over shared
// memory build it alike.

#include <cstddef>
#include <cstdint>
#include <span>

#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/result.h"
#include "kvrelay/core/warm_buffers.h"

namespace kvrelay::peer {

struct EncodedFetch {
  WarmBufferPool::Lease buffer;  // the frame is its first frame_bytes
  std::size_t frame_bytes = 0;
  std::uint64_t raw_bytes = 0;  // the KV the frame carries
  KvLayout layout;              // of those tokens
  double encode_seconds = 0.0;
  [[nodiscard]] std::span<const std::uint8_t> frame() const { return buffer.u8().first(frame_bytes); }
};

// `entry_bytes`: the whole entry of `entry_layout`, already read into memory of the caller's. Only
// the tokens after `skip_tokens` are encoded (every layer's K and V), into buffers from `buffers`
// (warm: encoding into fresh memory paid a first touch per page on every fetch).
[[nodiscard]] Result<EncodedFetch> encode_for_fetch(const KvLayout& entry_layout,
                                                    std::span<const std::byte> entry_bytes, std::uint64_t skip_tokens,
                                                    const codec::CodecSpec& spec, WarmBufferPool& buffers);

}  // namespace kvrelay::peer
