#include "kvrelay/codec_plugins/device_codecs.h"

#include <fmt/format.h>

#include "kvrelay/codec_plugins/builtin_codecs.h"
#include "kvrelay/codec_plugins/frame.h"
#include "kvrelay/codec_plugins/metrics.h"

#if defined(KVRELAY_HAVE_CUDA)
#include "cuda_staged.h"
#endif

namespace kvrelay::codec {

Result<const kvrelay_codec_plugin*> cuda_implementation(std::uint32_t codec_id) {
  if (codec_id != kFp8CodecId && codec_id != kInt8CodecId && codec_id != kInt4CodecId) {
    return fail(ErrorCode::kUnsupported,
                fmt::format("codec id {} has no CUDA implementation (fp8, int8 and int4 have)", codec_id));
  }
#if defined(KVRELAY_HAVE_CUDA)
  return detail::staged_cuda_codec(codec_id);
#else
  return fail(ErrorCode::kUnsupported, "this kvrelay was built without CUDA (nvcc was not found)");
#endif
}

Status verify_implementation(const Codec& codec, const kvrelay_codec_plugin& implementation,
                             const CodecRegistry& registry) {
  const KvLayout layout{2, 2, 64, DType::kFloat16, 160};
  KVRELAY_TRY(const auto kv, synthetic_kv(layout, 17));
  KVRELAY_TRY(const auto expected, encode_frame(codec, layout, kv));
  EncodeOptions on_device;
  on_device.implementation = &implementation;
  const auto frame = encode_frame(codec, layout, kv, on_device);
  if (!frame) {
    return fail(frame.error().code,
                fmt::format("self-check encode of '{}' failed: {}", codec.name(), frame.error().message));
  }
  if (frame.value() != expected) {
    return fail(ErrorCode::kInternal,
                fmt::format("self-check: the GPU's '{}' frame differs from the CPU's", codec.name()));
  }
  std::vector<std::uint8_t> cpu_kv(kv.size());
  std::vector<std::uint8_t> device_kv(kv.size());
  KVRELAY_TRY(decode_frame(registry, expected, cpu_kv, &codec.plugin()));
  if (auto decoded = decode_frame(registry, expected, device_kv, &implementation); !decoded) {
    return fail(decoded.error().code,
                fmt::format("self-check decode of '{}' failed: {}", codec.name(), decoded.error().message));
  }
  if (device_kv != cpu_kv) {
    return fail(ErrorCode::kInternal,
                fmt::format("self-check: the GPU's '{}' decode differs from the CPU's", codec.name()));
  }
  return ok();
}

Result<CodecPlacement> place_codecs(CodecRegistry& registry, std::string_view device) {
  CodecPlacement placement;
  if (device == "cpu") {
    placement.cpu_reason = "codecs.device is \"cpu\"";
    return placement;
  }
  if (device != "cuda" && device != "auto") {
    return fail(ErrorCode::kInvalidArgument, fmt::format("codec device '{}' is not cpu, cuda or auto", device));
  }
  // Under "cuda" a codec that cannot move stops the start; under "auto" all stay on the CPU.
  const auto cannot_move = [&](const Error& why) -> Result<CodecPlacement> {
    if (device == "cuda") return fail(why.code, fmt::format("codecs.device \"cuda\": {}", why.message));
    placement.cpu_reason = why.message;
    return placement;
  };
  // Every implementation first, then the switch: a registry is never left half on the GPU.
  std::vector<std::pair<std::uint32_t, const kvrelay_codec_plugin*>> moves;
  for (const std::uint32_t codec_id : {kFp8CodecId, kInt8CodecId, kInt4CodecId}) {
    const Codec* codec = registry.find(codec_id);
    if (codec == nullptr) continue;
    auto implementation = cuda_implementation(codec_id);
    if (!implementation) return cannot_move(implementation.error());
    // A device that is present may still not run these kernels (built for sm_90; short of
    // memory beside an engine): check one small frame each way against the CPU before moving.
    if (auto checked = verify_implementation(*codec, *implementation.value(), registry); !checked) {
      return cannot_move(checked.error());
    }
    moves.emplace_back(codec_id, implementation.value());
  }
  for (const auto& [codec_id, implementation] : moves) {
    KVRELAY_TRY(registry.set_executor(codec_id, implementation, "cuda"));
    placement.on_gpu.emplace_back(registry.find(codec_id)->name());
  }
  return placement;
}

}  // namespace kvrelay::codec
