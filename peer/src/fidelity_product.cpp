#include "kvrelay/peer/fidelity_product.h"

#include <algorithm>
#include <cmath>

namespace kvrelay::peer {

double clamp_product(double value) noexcept {
  if (std::isnan(value)) return kMinFidelityProduct;
  return std::clamp(value, kMinFidelityProduct, 1.0);
}

double codec_factor_of(const CodecFactor& factor, std::string_view codec_spec) {
  return factor ? clamp_product(factor(codec_spec)) : 1.0;
}

double effective_product(const Fidelity& fidelity, const CodecFactor& factor) {
  if (fidelity.is_exact()) return 1.0;
  return std::min(clamp_product(fidelity.product), codec_factor_of(factor, fidelity.lossy_codec));
}

double stamped_product(const Fidelity& source, std::string_view codec_spec, bool lossless_codec,
                       const CodecFactor& factor) {
  const double hop = lossless_codec ? 1.0 : codec_factor_of(factor, codec_spec);
  return clamp_product(effective_product(source, factor) * hop);
}

}  // namespace kvrelay::peer
