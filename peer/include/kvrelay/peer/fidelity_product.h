#pragma once

// The fidelity product a peer transfer carries (issue #27, precision refresh): what the sender
// stamps on a fetch reply or a push, and what the receiver files. docs/architecture.md, "Fidelity".

#include <functional>
#include <string_view>

#include "kvrelay/core/fidelity.h"

namespace kvrelay::peer {

// A codec's fidelity factor in (0, 1]: 1 for lossless codecs. The daemon passes the policy's
// (cost_model.media[].fidelity, else the media catalogue's defaults); unset, every factor is 1,
// so a hop adds nothing and a lossy entry keeps its own product (readers still take the smaller
// of a product and its codec's factor, so that is never optimistic).
using CodecFactor = std::function<double(std::string_view codec_spec)>;

// The smallest product a transfer may carry: a product is in (0, 1] on the wire.
inline constexpr double kMinFidelityProduct = 2.2250738585072014e-308;  // DBL_MIN

// `value` within [kMinFidelityProduct, 1]; NaN is taken as the least faithful.
[[nodiscard]] double clamp_product(double value) noexcept;
// factor(codec_spec) clamped, or 1 when `factor` is unset.
[[nodiscard]] double codec_factor_of(const CodecFactor& factor, std::string_view codec_spec);
// What KV of fidelity `fidelity` is worth: 1 when exact, else the smaller of its product and
// its lossy codec's factor.
[[nodiscard]] double effective_product(const Fidelity& fidelity, const CodecFactor& factor);
// The product KV of `source` fidelity carries once encoded with `codec_spec`:
// effective(source) x factor(codec_spec), 1 x 1 for exact KV under a lossless codec.
[[nodiscard]] double stamped_product(const Fidelity& source, std::string_view codec_spec, bool lossless_codec,
                                     const CodecFactor& factor);

}  // namespace kvrelay::peer
