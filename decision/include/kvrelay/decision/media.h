#pragma once

// The candidate media the engine chooses between, and what it must know about each codec.
// Codec figures come in through CodecProfile (expected ratio per dtype, host throughput,
// calibrated quality) so decision/ does not depend on codec_plugins/: whoever owns the codecs
// fills a profile from measurements and the engine refines it online.
//
// This is the one catalogue of media: the built-ins (builtin_media(), one row each, in
// kBuiltinMedia's order) and plugin codecs, named "codec:<codec name>".

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "kvrelay/core/dtype.h"

namespace kvrelay::decision {

// Index into a MediaCatalog; small so decisions stay in fixed-size arrays.
using MediumId = std::uint8_t;
inline constexpr std::size_t kMaxMedia = 16;
inline constexpr MediumId kTokensMedium = 0;

enum class MediumKind : std::uint8_t {
  kTokens,      // send token ids; the receiver prefills what it lacks
  kKvLossless,  // KV, bit exact (kv_raw, kv_lossless, lossless plugins)
  kKvLossy,     // KV through a lossy codec (kv_fp8, kv_int8, kv_int4, lossy plugins)
  kKvSparse,    // a subset of token positions; receiver must declare support
  kSummary,     // a summary of the context in its place (docs/summary.md): no KV, lossy in content
};

// Slots of CodecProfile::ratio: fp32, fp16, bf16, and the 1-byte fp8 dtypes (both e4m3 and e5m2).
inline constexpr std::size_t kDtypeSlots = 4;
[[nodiscard]] std::size_t dtype_slot(DType dtype) noexcept;

struct CodecProfile {
  // Encoded bytes / raw bytes, by dtype (index: dtype_slot()). A lossy medium's fp8 slot is never
  // used: lossy media are excluded for fp8 KV, which moves only as bytes.
  std::array<double, kDtypeSlots> ratio{1.0, 1.0, 1.0, 1.0};
  // Raw bytes per second through encode and decode on this host; 0 means free (kv_raw).
  double encode_bytes_per_s = 0.0;
  double decode_bytes_per_s = 0.0;
  // Calibrated quality: fidelity factor in (0, 1] multiplied along a chain of lossy hops, and
  // extra decode tokens per generated token the quality loss costs (longer or retried answers).
  double fidelity = 1.0;
  double extra_decode_fraction = 0.0;

  [[nodiscard]] double ratio_for(DType dtype) const noexcept;
};

struct MediumSpec {
  std::string name;  // "tokens", "kv_int8", "codec:foo"
  MediumKind kind = MediumKind::kTokens;
  CodecProfile profile;
  // False for a plugin medium the policy names whose codec this process has not loaded: the
  // engine lists it and never chooses it.
  bool available = true;

  // A summary moves token ids (or text) the receiver prefills: no KV, so any pair of models.
  [[nodiscard]] bool needs_kv() const noexcept { return kind != MediumKind::kTokens && kind != MediumKind::kSummary; }
  [[nodiscard]] bool lossless() const noexcept {
    return kind == MediumKind::kTokens || kind == MediumKind::kKvLossless;
  }
};

// One built-in medium: its kind, the codec that fills a prefix cache with it ("" for tokens,
// kv_sparse, which drops positions, and summary) and default figures typical of the CPU codecs, meant to be
// refined by measurements (codec_bench, audit calibration, the running sidecar's own codecs).
struct BuiltinMedium {
  std::string_view name;
  MediumKind kind;
  std::string_view prefix_codec;
  CodecProfile profile;
};
[[nodiscard]] std::span<const BuiltinMedium> builtin_media() noexcept;
[[nodiscard]] const BuiltinMedium* find_builtin_medium(std::string_view name) noexcept;

inline constexpr std::string_view kPluginMediumPrefix = "codec:";
// "codec:xor" -> "xor"; nullopt for a built-in name or a bare prefix.
[[nodiscard]] std::optional<std::string_view> plugin_codec_of(std::string_view medium) noexcept;
[[nodiscard]] std::string plugin_medium_name(std::string_view codec);
// A plugin codec as a medium. Until its codec is measured the engine assumes no compression and
// a slow host path, so a plugin is chosen on its measured merits, not on hope.
[[nodiscard]] MediumSpec plugin_medium(std::string_view codec, bool lossless);

// Codec spec that fills a prefix cache with `medium` (kv_int8 -> int8, codec:xor -> xor);
// nullopt for tokens, kv_sparse, summary and names outside the catalogue.
[[nodiscard]] std::optional<std::string> prefix_codec_for(std::string_view medium);
// The medium a codec spec carries: the built-in whose codec it is, else the plugin medium.
[[nodiscard]] std::string medium_for_codec_spec(std::string_view codec);

// The spec of a built-in medium; a name outside builtin_media() is taken as a lossy plugin.
[[nodiscard]] MediumSpec builtin_medium(std::string_view name);

}  // namespace kvrelay::decision
