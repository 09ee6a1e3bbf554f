#pragma once

// Precision refresh (issue #27; docs/architecture.md, "Precision refresh"). Every entry carries
// the product of the fidelity factors of the lossy hops its KV went through (Fidelity.product);
// a hop whose factor would take that product below the route's quality_floor serves exact KV
// instead, or tokens where no exact source exists. Pure functions of the policy and the codecs.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "kvrelay/codec_plugins/registry.h"
#include "kvrelay/core/fidelity.h"
#include "kvrelay/core/policy.h"

namespace kvrelay::broker {

// The fidelity factor of one hop through `medium` (a catalogue name: "kv_int8", "codec:foo"): 1
// for tokens and lossless media (a lossless plugin codec too); else the policy's
// cost_model.media[medium].fidelity (what `kvrelay codec eval --policy-snippet` measures), else
// the media catalogue's default (decision/src/media.cpp: fp8 0.995, int8 0.99, int4 0.95,
// plugins 0.99), the figure the decision engine prices the medium with.
[[nodiscard]] double medium_factor(const Policy& policy, const codec::CodecRegistry& codecs, std::string_view medium);
// The same for a codec spec ("int8", "int4+zstd": the zstd stage is lossless, the quantizer's
// medium decides); 1 for lossless codecs.
[[nodiscard]] double codec_factor(const Policy& policy, const codec::CodecRegistry& codecs, std::string_view codec);

// What KV of `fidelity` is worth on a chain: 1 when exact; else the smaller of its product and
// the factor of its lossy codec, so that a product nobody stamped (1) is never optimistic.
[[nodiscard]] double effective_product(const Fidelity& fidelity, const Policy& policy,
                                       const codec::CodecRegistry& codecs);

// What a hop would do to the chain, and whether it crosses the floor.
struct ChainHop {
  double chain_product = 1.0;  // the source's effective product
  double factor = 1.0;         // the hop's medium
  double floor = 0.0;          // the route's quality_floor
  // The product the receiver's KV would carry.
  [[nodiscard]] double after() const { return chain_product * factor; }
};

// The hop through a medium of `factor` when it takes `chain_product` below the route's
// quality_floor; nullopt when it stays at or above it (a lossless hop never refreshes). Products
// equal to the floor up to rounding pass.
[[nodiscard]] std::optional<ChainHop> needs_refresh(const RoutePolicy& route, double chain_product, double factor);

// What a refresh forced in place of the lossy medium.
enum class RefreshForced : std::uint8_t {
  kLossless,  // a lossless medium from an exact source (this node's, or a peer's lossless fetch)
  kTokens,    // no exact source and no lossless medium: the receiver prefills
};
[[nodiscard]] std::string_view refresh_forced_name(RefreshForced forced) noexcept;

// A lossy medium overridden because of the floor, for the decision record.
struct PrecisionRefresh {
  ChainHop hop;
  std::string replaced_medium;
  RefreshForced forced = RefreshForced::kLossless;
  bool exact_source = false;  // this node holds an exact prefix to serve
};

// The least product a peer's lossy answer may carry for the route's floor to hold: the floor
// itself (0 without one), since a peer stamps its answer with the hop's factor already
// (source x factor). What a fetch asks peers for (FetchRequest.min_fidelity_product).
[[nodiscard]] double min_reply_product(const RoutePolicy& route);

}  // namespace kvrelay::broker
