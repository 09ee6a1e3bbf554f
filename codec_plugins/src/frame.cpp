#include "kvrelay/codec_plugins/frame.h"

#include <zstd.h>

#include <fmt/format.h>

#include <cstring>
#include <optional>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/core/bulk_hash.h"  // the checksum is a full pass over every frame, both ways

#include "streamed_encode.h"

namespace kvrelay::codec {
namespace {

// Field offsets; docs/wire-format.md "KV frames" is the normative description.
constexpr std::size_t kOffMagic = 0;
constexpr std::size_t kOffVersion = 4;
constexpr std::size_t kOffFlags = 6;
constexpr std::size_t kOffDtype = 7;
constexpr std::size_t kOffCodec = 8;
constexpr std::size_t kOffLayers = 12;
constexpr std::size_t kOffHeads = 16;
constexpr std::size_t kOffHeadDim = 20;
constexpr std::size_t kOffTokens = 24;
constexpr std::size_t kOffParamsLength = 32;
constexpr std::size_t kOffInnerLength = 36;
constexpr std::size_t kOffPayloadLength = 44;
static_assert(kOffPayloadLength + 8 == kFrameHeaderSize);

template <class Int>
void put(std::uint8_t* out, std::size_t offset, Int value) {
  std::memcpy(out + offset, &value, sizeof(Int));
}

template <class Int>
Int get(const std::uint8_t* in, std::size_t offset) {
  Int value;
  std::memcpy(&value, in + offset, sizeof(Int));
  return value;
}

kvrelay_codec_layout to_c(const KvLayout& layout) {
  return {layout.layers, layout.kv_heads, layout.head_dim, static_cast<std::uint32_t>(layout.dtype), layout.tokens};
}

// `ran`: the implementation that returned `code` (its own error texts).
Error codec_error(const Codec& codec, const kvrelay_codec_plugin& ran, int code, const char* action) {
  const char* text = ran.error_text(code);
  auto error_code = static_cast<ErrorCode>(code);
  if (code <= 0 || code > static_cast<int>(ErrorCode::kInternal)) error_code = ErrorCode::kInternal;
  return Error{error_code, fmt::format("codec '{}' {} failed: {}", codec.name(), action, text ? text : "?")};
}

// fp8 KV moves as its bytes: only a lossless codec (raw, lossless, a lossless plugin) may carry
// it. A lossy one would quantize values it reads as something else, or convert the engine's own
// quantization a second time.
Status check_converts_nothing(const Codec& codec, const KvLayout& layout, const char* action) {
  if (!dtype_moves_as_bytes(layout.dtype) || codec.lossless()) return ok();
  return fail(ErrorCode::kUnsupported,
              fmt::format("codec '{}' is lossy and cannot {} {} KV: {} moves only as bytes (raw or lossless), "
                          "never converted",
                          codec.name(), action, dtype_name(layout.dtype), dtype_name(layout.dtype)));
}

}  // namespace

namespace {

struct EncodePlan {
  std::vector<std::uint8_t> params;
  std::uint64_t bound = 0;     // codec output bound
  std::uint64_t capacity = 0;  // whole frame bound
};

Result<EncodePlan> plan_encode(const Codec& codec, const KvLayout& layout, const EncodeOptions& options) {
  KVRELAY_TRY(auto total, layout.total_bytes());
  KVRELAY_TRY(check_converts_nothing(codec, layout, "encode"));
  EncodePlan plan;
  plan.params = options.params.empty() ? codec.default_params() : options.params;
  if (plan.params.size() > kMaxFrameParamsSize)
    return fail(ErrorCode::kInvalidArgument, "codec params above 1024 bytes");
  const kvrelay_codec_layout c_layout = to_c(layout);
  plan.bound = codec.plugin().max_encoded_size(&c_layout, plan.params.data(), plan.params.size());
  if (plan.bound == 0 && total != 0) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("codec '{}' rejects layout {} or its params", codec.name(), layout.describe()));
  }
  const std::uint64_t payload = options.zstd_stage ? ZSTD_compressBound(plan.bound) : plan.bound;
  KVRELAY_TRY(plan.capacity, checked_add(kFrameHeaderSize + plan.params.size() + kFrameTrailerSize, payload));
  return plan;
}

void write_header(std::uint8_t* out, const Codec& codec, const KvLayout& layout, const EncodeOptions& options,
                  const std::vector<std::uint8_t>& params, std::uint64_t inner_size, std::uint64_t payload_size) {
  put<std::uint32_t>(out, kOffMagic, kFrameMagic);
  put<std::uint16_t>(out, kOffVersion, kFrameVersion);
  put<std::uint8_t>(out, kOffFlags, options.zstd_stage ? kFrameFlagZstdStage : 0);
  put<std::uint8_t>(out, kOffDtype, static_cast<std::uint8_t>(layout.dtype));
  put<std::uint32_t>(out, kOffCodec, codec.id());
  put<std::uint32_t>(out, kOffLayers, layout.layers);
  put<std::uint32_t>(out, kOffHeads, layout.kv_heads);
  put<std::uint32_t>(out, kOffHeadDim, layout.head_dim);
  put<std::uint64_t>(out, kOffTokens, layout.tokens);
  put<std::uint32_t>(out, kOffParamsLength, static_cast<std::uint32_t>(params.size()));
  put<std::uint64_t>(out, kOffInnerLength, inner_size);
  put<std::uint64_t>(out, kOffPayloadLength, payload_size);
  if (!params.empty()) std::memcpy(out + kFrameHeaderSize, params.data(), params.size());
}

void hash_ready(void* context, const std::uint8_t* bytes, std::size_t size) {
  static_cast<BulkHashStream*>(context)->update(bytes, size);
}

void copy_and_hash(void* context, std::uint8_t* destination, const std::uint8_t* source, std::size_t size) {
  static_cast<BulkHashStream*>(context)->update_copy(destination, source, size);
}

}  // namespace

Result<std::uint64_t> max_frame_size(const Codec& codec, const KvLayout& layout, const EncodeOptions& options) {
  KVRELAY_TRY(auto plan, plan_encode(codec, layout, options));
  return plan.capacity;
}

Result<std::size_t> encode_frame_into(const Codec& codec, const KvLayout& layout, std::span<const std::uint8_t> kv,
                                      const EncodeOptions& options, std::span<std::uint8_t> frame) {
  KVRELAY_TRY(auto total, layout.total_bytes());
  if (kv.size() != total) {
    return fail(ErrorCode::kLayoutMismatch,
                fmt::format("KV buffer has {} bytes, layout {} needs {}", kv.size(), layout.describe(), total));
  }
  KVRELAY_TRY(auto plan, plan_encode(codec, layout, options));
  if (frame.size() < plan.capacity) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("frame buffer of {} bytes, encoding may need {}", frame.size(), plan.capacity));
  }
  if (options.implementation != nullptr && options.implementation->codec_id != codec.id()) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("implementation '{}' (codec id {}) does not implement codec '{}' (id {})",
                            options.implementation->name, options.implementation->codec_id, codec.name(), codec.id()));
  }
  const kvrelay_codec_plugin& implementation =
      options.implementation != nullptr ? *options.implementation : codec.executor();
  const kvrelay_codec_layout c_layout = to_c(layout);
  const auto& params = plan.params;
  const std::size_t prefix = kFrameHeaderSize + params.size();
  std::size_t inner_size = 0;
  std::size_t payload_size = 0;
  std::uint8_t* out = frame.data();
  // A streamed encoder's payload is hashed section by section while it is still in cache (one
  // DRAM pass fewer). The header goes first in the hash, so it is written assuming the payload
  // fills the codec's bound (the built-in streamed codecs always do); otherwise the whole frame
  // is hashed again below.
  const detail::StreamedEncodeFn streamed =
      options.zstd_stage || &implementation != &codec.plugin() ? nullptr : detail::streamed_encoder(&codec.plugin());
  std::optional<BulkHashStream> streamed_hash;
  if (streamed != nullptr) streamed_hash.emplace();
  if (streamed_hash && !streamed_hash->valid()) streamed_hash.reset();
  if (streamed_hash) {
    write_header(out, codec, layout, options, params, plan.bound, plan.bound);
    streamed_hash->update(out, prefix);
    const int code = streamed(&c_layout, params.data(), params.size(), kv.data(), kv.size(), out + prefix, plan.bound,
                              &inner_size, detail::OutputSink{hash_ready, &*streamed_hash, copy_and_hash});
    if (code != KVRELAY_CODEC_OK) return outcome::failure(codec_error(codec, codec.plugin(), code, "encode"));
    if (inner_size > plan.bound) return fail(ErrorCode::kInternal, "codec wrote past its own bound");
    payload_size = inner_size;
  } else if (options.zstd_stage) {
    // Reused per thread: fresh multi-megabyte buffers cost more in page faults than the codec.
    thread_local std::vector<std::uint8_t> inner;
    if (inner.size() < plan.bound) inner.resize(plan.bound);
    const int code = implementation.encode(&c_layout, params.data(), params.size(), kv.data(), kv.size(), inner.data(),
                                           plan.bound, &inner_size);
    if (code != KVRELAY_CODEC_OK) return outcome::failure(codec_error(codec, implementation, code, "encode"));
    if (inner_size > plan.bound) return fail(ErrorCode::kInternal, "codec wrote past its own bound");
    const std::size_t compressed = ZSTD_compress(frame.data() + prefix, plan.capacity - prefix - kFrameTrailerSize,
                                                 inner.data(), inner_size, options.zstd_level);
    if (ZSTD_isError(compressed)) {
      return fail(ErrorCode::kInternal, fmt::format("zstd stage: {}", ZSTD_getErrorName(compressed)));
    }
    payload_size = compressed;
  } else {
    const int code = implementation.encode(&c_layout, params.data(), params.size(), kv.data(), kv.size(),
                                           frame.data() + prefix, plan.bound, &inner_size);
    if (code != KVRELAY_CODEC_OK) return outcome::failure(codec_error(codec, implementation, code, "encode"));
    if (inner_size > plan.bound) return fail(ErrorCode::kInternal, "codec wrote past its own bound");
    payload_size = inner_size;
  }
  const std::size_t body = prefix + payload_size;
  if (streamed_hash && inner_size == plan.bound) {
    put<std::uint64_t>(out, body, streamed_hash->digest());
  } else {
    write_header(out, codec, layout, options, params, inner_size, payload_size);
    put<std::uint64_t>(out, body, bulk_hash64(out, body));
  }
  return body + kFrameTrailerSize;
}

Result<std::vector<std::uint8_t>> encode_frame(const Codec& codec, const KvLayout& layout,
                                               std::span<const std::uint8_t> kv, const EncodeOptions& options) {
  KVRELAY_TRY(auto capacity, max_frame_size(codec, layout, options));
  std::vector<std::uint8_t> frame(capacity);
  KVRELAY_TRY(auto size, encode_frame_into(codec, layout, kv, options, frame));
  frame.resize(size);
  return frame;
}

CodecSpec frame_codec(const CodecRegistry& registry, const FrameHeader& header) {
  return {registry.find(header.codec_id), (header.flags & kFrameFlagZstdStage) != 0};
}

Result<FrameHeader> inspect_frame(std::span<const std::uint8_t> frame) {
  if (frame.size() < kFrameHeaderSize + kFrameTrailerSize) {
    return fail(ErrorCode::kTruncated, fmt::format("frame of {} bytes is shorter than the {}-byte minimum",
                                                   frame.size(), kFrameHeaderSize + kFrameTrailerSize));
  }
  const std::uint8_t* in = frame.data();
  if (get<std::uint32_t>(in, kOffMagic) != kFrameMagic) return fail(ErrorCode::kBadMagic, "not a KV frame (bad magic)");
  FrameHeader header;
  header.version = get<std::uint16_t>(in, kOffVersion);
  if (header.version != kFrameVersion) {
    return fail(ErrorCode::kBadVersion,
                fmt::format("frame format version {} (supported: {})", header.version, kFrameVersion));
  }
  header.flags = get<std::uint8_t>(in, kOffFlags);
  if ((header.flags & ~kFrameFlagZstdStage) != 0) {
    return fail(ErrorCode::kCorrupt, fmt::format("unknown frame flags 0x{:02x}", header.flags));
  }
  const auto params_length = get<std::uint32_t>(in, kOffParamsLength);
  header.inner_length = get<std::uint64_t>(in, kOffInnerLength);
  header.payload_length = get<std::uint64_t>(in, kOffPayloadLength);
  if (params_length > kMaxFrameParamsSize) {
    return fail(ErrorCode::kCorrupt,
                fmt::format("frame params length {} above {}", params_length, kMaxFrameParamsSize));
  }
  KVRELAY_TRY(auto body, checked_add(kFrameHeaderSize + params_length, header.payload_length));
  KVRELAY_TRY(auto expected, checked_add(body, kFrameTrailerSize));
  if (frame.size() < expected) {
    return fail(ErrorCode::kTruncated,
                fmt::format("frame has {} bytes, its header announces {}", frame.size(), expected));
  }
  if (frame.size() > expected) {
    return fail(ErrorCode::kCorrupt,
                fmt::format("frame has {} trailing bytes after the announced {}", frame.size() - expected, expected));
  }
  header.checksum = get<std::uint64_t>(in, body);
  const std::uint64_t actual = bulk_hash64(in, body);
  if (actual != header.checksum) {
    return fail(ErrorCode::kChecksumMismatch,
                fmt::format("frame checksum 0x{:016x} != computed 0x{:016x}", header.checksum, actual));
  }
  const auto dtype = dtype_from_wire(get<std::uint8_t>(in, kOffDtype));
  if (!dtype) {
    return fail(ErrorCode::kLayoutMismatch, fmt::format("frame dtype {} unknown", get<std::uint8_t>(in, kOffDtype)));
  }
  header.layout = KvLayout{get<std::uint32_t>(in, kOffLayers), get<std::uint32_t>(in, kOffHeads),
                           get<std::uint32_t>(in, kOffHeadDim), *dtype, get<std::uint64_t>(in, kOffTokens)};
  if (auto valid = header.layout.validate(); !valid) {
    return fail(ErrorCode::kLayoutMismatch, "frame layout: " + valid.error().message);
  }
  KVRELAY_TRY(header.layout.total_bytes());  // kOverflow when the sizes do not fit 64 bits
  if (header.flags == 0 && header.inner_length != header.payload_length) {
    return fail(ErrorCode::kCorrupt, "frame inner length differs from payload length without a zstd stage");
  }
  header.codec_id = get<std::uint32_t>(in, kOffCodec);
  header.params.assign(in + kFrameHeaderSize, in + kFrameHeaderSize + params_length);
  return header;
}

namespace {

// decode_frame after inspect_frame has checked `header` (and the checksum) for this frame.
Status decode_inspected(const CodecRegistry& registry, const FrameHeader& header, std::span<const std::uint8_t> frame,
                        std::span<std::uint8_t> output, const kvrelay_codec_plugin* implementation) {
  const Codec* codec = registry.find(header.codec_id);
  if (codec == nullptr)
    return fail(ErrorCode::kUnknownCodec, fmt::format("frame codec id {} not registered", header.codec_id));
  if (implementation != nullptr && implementation->codec_id != header.codec_id) {
    return fail(ErrorCode::kInvalidArgument,
                fmt::format("implementation '{}' (codec id {}) cannot decode a frame of codec '{}' (id {})",
                            implementation->name, implementation->codec_id, codec->name(), header.codec_id));
  }
  const kvrelay_codec_plugin& decoder = implementation != nullptr ? *implementation : codec->executor();
  KVRELAY_TRY(check_converts_nothing(*codec, header.layout, "decode"));
  KVRELAY_TRY(auto total, header.layout.total_bytes());
  if (output.size() != total) {
    return fail(ErrorCode::kLayoutMismatch, fmt::format("output has {} bytes, frame layout {} needs {}", output.size(),
                                                        header.layout.describe(), total));
  }
  const kvrelay_codec_layout c_layout = to_c(header.layout);
  const std::uint64_t bound = codec->plugin().max_encoded_size(&c_layout, header.params.data(), header.params.size());
  if (bound == 0 && total != 0) {
    return fail(ErrorCode::kLayoutMismatch,
                fmt::format("codec '{}' rejects frame layout {} or params", codec->name(), header.layout.describe()));
  }
  if (header.inner_length > bound) {
    return fail(ErrorCode::kLayoutMismatch, fmt::format("frame payload {} bytes exceeds codec bound {} for its layout",
                                                        header.inner_length, bound));
  }
  const std::uint8_t* payload = frame.data() + kFrameHeaderSize + header.params.size();
  if ((header.flags & kFrameFlagZstdStage) != 0) {
    const unsigned long long content = ZSTD_getFrameContentSize(payload, header.payload_length);
    if (content != header.inner_length)
      return fail(ErrorCode::kCorrupt, "zstd stage: content size disagrees with header");
    thread_local std::vector<std::uint8_t> inner;  // reused: see encode_frame_into
    if (inner.size() < header.inner_length) inner.resize(header.inner_length);
    const std::size_t got = ZSTD_decompress(inner.data(), header.inner_length, payload, header.payload_length);
    if (ZSTD_isError(got) || got != header.inner_length) {
      return fail(ErrorCode::kCorrupt,
                  fmt::format("zstd stage: {}", ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short"));
    }
    payload = inner.data();
  }
  const int code = decoder.decode(&c_layout, header.params.data(), header.params.size(), payload, header.inner_length,
                                  output.data(), output.size());
  if (code != KVRELAY_CODEC_OK) return outcome::failure(codec_error(*codec, decoder, code, "decode"));
  return ok();
}

}  // namespace

Status decode_frame(const CodecRegistry& registry, std::span<const std::uint8_t> frame, std::span<std::uint8_t> output,
                    const kvrelay_codec_plugin* implementation) {
  KVRELAY_TRY(auto header, inspect_frame(frame));
  return decode_inspected(registry, header, frame, output, implementation);
}

Result<DecodedKv> decode_frame_view(const CodecRegistry& registry, std::span<const std::uint8_t> frame,
                                    std::uint64_t max_output_bytes, WarmBufferPool& buffers) {
  DecodedKv decoded;
  KVRELAY_TRY(decoded.header, inspect_frame(frame));
  const FrameHeader& header = decoded.header;
  KVRELAY_TRY(auto total, header.layout.total_bytes());
  if (total > max_output_bytes) {
    return fail(ErrorCode::kResourceExhausted, fmt::format("frame layout {} needs {} bytes, above the {} allowed",
                                                           header.layout.describe(), total, max_output_bytes));
  }
  const Codec* codec = registry.find(header.codec_id);
  if (codec == nullptr) {
    return fail(ErrorCode::kUnknownCodec, fmt::format("frame codec id {} not registered", header.codec_id));
  }
  if (&codec->plugin() == raw_codec() && header.flags == 0) {
    // What raw_decode would check before its memcpy.
    if (header.payload_length != total) {
      return fail(header.payload_length < total ? ErrorCode::kTruncated : ErrorCode::kLayoutMismatch,
                  fmt::format("raw frame payload of {} bytes, layout {} needs {}", header.payload_length,
                              header.layout.describe(), total));
    }
    decoded.kv = frame.subspan(kFrameHeaderSize + header.params.size(), static_cast<std::size_t>(total));
    return decoded;
  }
  decoded.storage = buffers.take(static_cast<std::size_t>(total));
  KVRELAY_TRY(decode_inspected(registry, header, frame, decoded.storage.u8(), nullptr));
  decoded.kv = decoded.storage.u8();
  return decoded;
}

Result<std::vector<std::uint8_t>> decode_frame(const CodecRegistry& registry, std::span<const std::uint8_t> frame,
                                               std::uint64_t max_output_bytes,
                                               const kvrelay_codec_plugin* implementation) {
  KVRELAY_TRY(auto header, inspect_frame(frame));
  KVRELAY_TRY(auto total, header.layout.total_bytes());
  if (total > max_output_bytes) {
    return fail(ErrorCode::kResourceExhausted, fmt::format("frame layout {} needs {} bytes, above the {} allowed",
                                                           header.layout.describe(), total, max_output_bytes));
  }
  if (registry.find(header.codec_id) == nullptr) {
    return fail(ErrorCode::kUnknownCodec, fmt::format("frame codec id {} not registered", header.codec_id));
  }
  std::vector<std::uint8_t> output(total);
  KVRELAY_TRY(decode_inspected(registry, header, frame, output, implementation));
  return output;
}

}  // namespace kvrelay::codec
