#pragma once

// The self-describing frame every encoded KV payload travels in; byte layout in
// docs/wire-format.md ("KV frames"). Decoding validates every field, the lengths and the xxh3
// checksum before it writes a byte of output.

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/kv_layout.h"
#include "kvrelay/core/result.h"
#include "kvrelay/core/warm_buffers.h"

namespace kvrelay::codec {

inline constexpr std::uint32_t kFrameMagic = 0x4652564BU;  // "KVRF" in file order
inline constexpr std::uint16_t kFrameVersion = 1;
inline constexpr std::size_t kFrameHeaderSize = 52;
inline constexpr std::size_t kFrameTrailerSize = 8;
inline constexpr std::size_t kMaxFrameParamsSize = 1024;
inline constexpr std::uint8_t kFrameFlagZstdStage = 0x1;

struct FrameHeader {
  std::uint16_t version = kFrameVersion;
  std::uint8_t flags = 0;
  std::uint32_t codec_id = 0;
  KvLayout layout;
  std::vector<std::uint8_t> params;
  std::uint64_t inner_length = 0;    // codec payload bytes (before the zstd stage, if any)
  std::uint64_t payload_length = 0;  // bytes stored in the frame
  std::uint64_t checksum = 0;
};

struct EncodeOptions {
  bool zstd_stage = false;
  int zstd_level = 3;
  std::vector<std::uint8_t> params;  // empty: the codec's defaults
  // Another implementation of the same codec (same id, same payload bytes) that does the
  // encoding, e.g. cuda_implementation() (device_codecs.h); null: the codec's own.
  const kvrelay_codec_plugin* implementation = nullptr;
};

[[nodiscard]] Result<std::vector<std::uint8_t>> encode_frame(const Codec& codec, const KvLayout& layout,
                                                             std::span<const std::uint8_t> kv,
                                                             const EncodeOptions& options = {});

// Largest frame encode_frame_into may write for this codec, layout and options.
[[nodiscard]] Result<std::uint64_t> max_frame_size(const Codec& codec, const KvLayout& layout,
                                                   const EncodeOptions& options = {});
// Encodes into a caller-owned buffer of at least max_frame_size() bytes (reuse it: fresh large
// buffers cost page faults); returns the frame's size.
[[nodiscard]] Result<std::size_t> encode_frame_into(const Codec& codec, const KvLayout& layout,
                                                    std::span<const std::uint8_t> kv, const EncodeOptions& options,
                                                    std::span<std::uint8_t> frame);

// Parses and checks the header, the lengths and the checksum (not the codec payload).
[[nodiscard]] Result<FrameHeader> inspect_frame(std::span<const std::uint8_t> frame);
// The codec spec a header names ("int4+zstd"); a null codec when `registry` lacks its id.
[[nodiscard]] CodecSpec frame_codec(const CodecRegistry& registry, const FrameHeader& header);

// Decodes into `output`, whose size must be the frame layout's total size. On failure the
// output's contents are unspecified but no byte outside it is touched.
// `implementation`: another implementation of the frame's codec that does the decoding (it must
// carry the frame's codec id), e.g. cuda_implementation() (device_codecs.h); null: the codec's own.
[[nodiscard]] Status decode_frame(const CodecRegistry& registry, std::span<const std::uint8_t> frame,
                                  std::span<std::uint8_t> output, const kvrelay_codec_plugin* implementation = nullptr);

// A frame's KV, checked like decode_frame. A raw frame without a zstd stage holds the KV
// verbatim: `kv` is then a view into the frame (no copy). Any other codec decodes into
// `storage`, a buffer from `buffers`. Refuses layouts above `max_output_bytes`.
struct DecodedKv {
  FrameHeader header;
  std::span<const std::uint8_t> kv;
  WarmBufferPool::Lease storage;
};
[[nodiscard]] Result<DecodedKv> decode_frame_view(const CodecRegistry& registry, std::span<const std::uint8_t> frame,
                                                  std::uint64_t max_output_bytes, WarmBufferPool& buffers);

// Allocating variant; refuses layouts above `max_output_bytes` (hostile frames can claim terabytes).
[[nodiscard]] Result<std::vector<std::uint8_t>> decode_frame(const CodecRegistry& registry,
                                                             std::span<const std::uint8_t> frame,
                                                             std::uint64_t max_output_bytes,
                                                             const kvrelay_codec_plugin* implementation = nullptr);

}  // namespace kvrelay::codec
