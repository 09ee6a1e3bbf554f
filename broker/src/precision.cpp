#include "precision.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "kvrelay/decision/media.h"

namespace kvrelay::broker {

namespace {

// Products are multiplied hop by hop: one at the floor up to rounding has not crossed it.
constexpr double kFloorTolerance = 1e-9;

double calibrated_fidelity(const Policy& policy, std::string_view medium, double fallback) {
  const MediumCostModel* model = policy.cost_model.medium(medium);
  return model != nullptr && model->fidelity ? *model->fidelity : fallback;
}

}  // namespace

double medium_factor(const Policy& policy, const codec::CodecRegistry& codecs, std::string_view medium) {
  const decision::MediumSpec spec = decision::builtin_medium(medium);
  if (spec.lossless()) return 1.0;
  // A plugin medium starts as lossy in the catalogue; its loaded codec knows better.
  if (const auto codec = decision::prefix_codec_for(medium); codec && codec::fidelity_of(codecs, *codec).is_exact()) {
    return 1.0;
  }
  return std::clamp(calibrated_fidelity(policy, spec.name, spec.profile.fidelity), 0.0, 1.0);
}

double codec_factor(const Policy& policy, const codec::CodecRegistry& codecs, std::string_view codec) {
  if (codec::fidelity_of(codecs, codec).is_exact()) return 1.0;
  // "int8+zstd" is int8's medium: the registry names the quantizer without its zstd stage.
  const auto resolved = codec::resolve_codec(codecs, codec);
  const std::string base = resolved ? std::string(resolved.value().codec->name()) : std::string(codec);
  return medium_factor(policy, codecs, decision::medium_for_codec_spec(base));
}

double effective_product(const Fidelity& fidelity, const Policy& policy, const codec::CodecRegistry& codecs) {
  if (fidelity.is_exact()) return 1.0;
  // A product outside [0, 1] (a bad stamp) counts as none: the codec's factor decides.
  const double stamped = std::isfinite(fidelity.product) ? std::clamp(fidelity.product, 0.0, 1.0) : 1.0;
  return std::min(stamped, codec_factor(policy, codecs, fidelity.lossy_codec));
}

std::optional<ChainHop> needs_refresh(const RoutePolicy& route, double chain_product, double factor) {
  const ChainHop hop{chain_product, factor, route.quality_floor};
  if (factor >= 1.0 || route.quality_floor <= 0.0) return std::nullopt;
  if (hop.after() >= route.quality_floor - kFloorTolerance) return std::nullopt;
  return hop;
}

std::string_view refresh_forced_name(RefreshForced forced) noexcept {
  switch (forced) {
    case RefreshForced::kLossless:
      return "lossless";
    case RefreshForced::kTokens:
      return "tokens";
  }
  return "lossless";
}

double min_reply_product(const RoutePolicy& route) {
  // The tolerance needs_refresh allows: an answer exactly at the floor passes there too.
  if (route.quality_floor <= 0.0) return 0.0;
  return std::clamp(route.quality_floor - kFloorTolerance, 0.0, 1.0);
}

}  // namespace kvrelay::broker
