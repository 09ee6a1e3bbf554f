#include "kvrelay/decision/media.h"

#include <algorithm>

namespace kvrelay::decision {

namespace {

// Ratios: quantised size over raw size for fp32 / fp16 / bf16 / fp8 inputs (scales add ~3%). fp8
// KV has one byte plane, which zstd squeezes less than a 16-bit exponent plane.
// Throughputs: single-core CPU codec speeds; extra decode from calibration runs. Fidelity is
// 1 - the attention-output error measured on the trained checkpoint (docs/codecs.md, "Quality on
// the trained model": int8 0.43%, fp8 3.7%, int4 7.9%, kv_sparse's keep rule 53%), what `kvrelay
// codec eval --policy-snippet` proposes; a route's own measurement (cost_model.media) replaces it.
// kv_sparse keeps ~half the positions of a long context (sinks, 128 recent, a quarter of the rest).
constexpr BuiltinMedium kCatalogue[] = {
    {"tokens", MediumKind::kTokens, "", CodecProfile{}},
    {"kv_raw", MediumKind::kKvLossless, "raw", CodecProfile{}},
    {"kv_lossless", MediumKind::kKvLossless, "lossless",
     CodecProfile{{0.80, 0.85, 0.85, 0.90}, 600e6, 1.2e9, 1.0, 0.0}},
    {"kv_fp8", MediumKind::kKvLossy, "fp8", CodecProfile{{0.26, 0.52, 0.52, 1.0}, 2.0e9, 3.0e9, 0.963, 0.005}},
    {"kv_int8", MediumKind::kKvLossy, "int8", CodecProfile{{0.26, 0.52, 0.52, 1.0}, 1.5e9, 2.5e9, 0.996, 0.01}},
    {"kv_int4", MediumKind::kKvLossy, "int4", CodecProfile{{0.14, 0.27, 0.27, 1.0}, 1.2e9, 2.0e9, 0.921, 0.06}},
    {"kv_sparse", MediumKind::kKvSparse, "", CodecProfile{{0.50, 0.50, 0.50, 1.0}, 3.0e9, 3.0e9, 0.47, 0.04}},
    // No codec: priced from its token budget and the summariser's time (decision_engine.cpp).
    // Conservative until an audit measures it (docs/summary.md): half the information kept, and
    // a quarter more decode for the answers that need to recover what the summary left out.
    {"summary", MediumKind::kSummary, "", CodecProfile{{1.0, 1.0, 1.0, 1.0}, 0.0, 0.0, 0.5, 0.25}},
};

}  // namespace

std::size_t dtype_slot(DType dtype) noexcept {
  switch (dtype) {
    case DType::kFloat32:
      return 0;
    case DType::kFloat16:
      return 1;
    case DType::kBFloat16:
      return 2;
    case DType::kFp8E4M3:
    case DType::kFp8E5M2:
      return 3;
  }
  return 0;
}

double CodecProfile::ratio_for(DType dtype) const noexcept {
  return ratio[dtype_slot(dtype)];
}

std::span<const BuiltinMedium> builtin_media() noexcept {
  return kCatalogue;
}

const BuiltinMedium* find_builtin_medium(std::string_view name) noexcept {
  const auto* found = std::find_if(std::begin(kCatalogue), std::end(kCatalogue),
                                   [&](const BuiltinMedium& medium) { return medium.name == name; });
  return found == std::end(kCatalogue) ? nullptr : found;
}

std::optional<std::string_view> plugin_codec_of(std::string_view medium) noexcept {
  if (!medium.starts_with(kPluginMediumPrefix) || medium.size() == kPluginMediumPrefix.size()) return std::nullopt;
  return medium.substr(kPluginMediumPrefix.size());
}

std::string plugin_medium_name(std::string_view codec) {
  return std::string(kPluginMediumPrefix) + std::string(codec);
}

MediumSpec plugin_medium(std::string_view codec, bool lossless) {
  MediumSpec spec;
  spec.name = plugin_medium_name(codec);
  spec.kind = lossless ? MediumKind::kKvLossless : MediumKind::kKvLossy;
  spec.profile = CodecProfile{{1.0, 1.0, 1.0, 1.0}, 1.0e9, 1.0e9, lossless ? 1.0 : 0.99, lossless ? 0.0 : 0.01};
  return spec;
}

std::optional<std::string> prefix_codec_for(std::string_view medium) {
  if (const BuiltinMedium* builtin = find_builtin_medium(medium)) {
    if (builtin->prefix_codec.empty()) return std::nullopt;
    return std::string(builtin->prefix_codec);
  }
  if (const auto codec = plugin_codec_of(medium)) return std::string(*codec);
  return std::nullopt;
}

std::string medium_for_codec_spec(std::string_view codec) {
  for (const BuiltinMedium& medium : kCatalogue) {
    if (!medium.prefix_codec.empty() && medium.prefix_codec == codec) return std::string(medium.name);
  }
  return plugin_medium_name(codec);
}

MediumSpec builtin_medium(std::string_view name) {
  const BuiltinMedium* builtin = find_builtin_medium(name);
  if (builtin == nullptr) {
    // Plugin codecs start pessimistic (no compression, lossy) until measured.
    MediumSpec spec = plugin_medium(plugin_codec_of(name).value_or(name), false);
    spec.name = std::string(name);
    return spec;
  }
  return MediumSpec{std::string(builtin->name), builtin->kind, builtin->profile};
}

}  // namespace kvrelay::decision
