#pragma once

// The candidate media the engine chooses between, and what it must know about each codec.
// Codec figures come in through CodecProfile (expected ratio per dtype, host throughput,
// calibrated quality) so decision/ does not depend on codec_plugins/: whoever owns the codecs
// fills a profile from measurements and the engine refines it online.

#include <array>
#include <cstddef>
#include <cstdint>
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
  kKvLossless,  // KV, bit exact (kv_raw, kv_lossless)
  kKvLossy,     // KV through a lossy codec (kv_fp8, kv_int8, kv_int4, plugins)
  kKvSparse,    // a subset of token positions; receiver must declare support
};

struct CodecProfile {
  // Encoded bytes / raw bytes, by dtype (index: fp32, fp16, bf16).
  std::array<double, 3> ratio{1.0, 1.0, 1.0};
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

  [[nodiscard]] bool needs_kv() const noexcept { return kind != MediumKind::kTokens; }
  [[nodiscard]] bool lossless() const noexcept {
    return kind == MediumKind::kTokens || kind == MediumKind::kKvLossless;
  }
};

// Default profiles for the built-in media: ratios and throughputs typical of the CPU codecs,
// meant to be overwritten by measured values (codec_bench, audit calibration).
[[nodiscard]] MediumSpec builtin_medium(std::string_view name);

}  // namespace kvrelay::decision
