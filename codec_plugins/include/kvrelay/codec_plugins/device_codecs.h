#pragma once

// GPU implementations of built-in codecs behind the plugin ABI: the same codec id, name and
// payload bytes as the CPU codec, with encode and decode run by the CUDA kernels
// (cuda_codecs.h). Buffers stay in host memory: each call copies its input to the device and
// its output back. Hand one to EncodeOptions::implementation or decode_frame to have a frame
// encoded or decoded on the GPU; the frame is the one the CPU codec writes.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvrelay/codec_plugins/codec_abi.h"
#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/result.h"

namespace kvrelay::codec {

// The CUDA implementation of built-in codec `codec_id` (fp8, int8, int4). Fails with kUnsupported,
// naming the reason, when the build has no CUDA, the machine no device, or the codec no kernels.
[[nodiscard]] Result<const kvrelay_codec_plugin*> cuda_implementation(std::uint32_t codec_id);

// Encodes and decodes a small synthetic KV with `implementation` and with `codec`'s own code
// (`registry` holds it); fails, naming the codec, unless both give the same frame and the same
// KV: a device can be present and still not run the kernels (another architecture, no memory).
[[nodiscard]] Status verify_implementation(const Codec& codec, const kvrelay_codec_plugin& implementation,
                                           const CodecRegistry& registry);

// Where a registry's fp8, int8 and int4 run (the policy's codecs.device).
struct CodecPlacement {
  std::vector<std::string> on_gpu;  // codec names now run by the CUDA kernels
  std::string cpu_reason;           // why they stay on the CPU ("" when on the GPU)
};
// `device`: "cpu" leaves every codec on the CPU; "cuda" moves fp8, int8 and int4 to the GPU and
// fails, naming why, when it cannot (no CUDA build, no device, or verify_implementation fails);
// "auto" moves them when it can and otherwise keeps them on the CPU, saying why in cpu_reason.
[[nodiscard]] Result<CodecPlacement> place_codecs(CodecRegistry& registry, std::string_view device);

}  // namespace kvrelay::codec
