#pragma once

// How faithful a run of KV is to what its source worker computed. Every writer of the KV store
// says so (a worker's publish, a peer's push, a fetch, a join), and the store enforces the rule
// that nothing lossy is filed over, or served for, exact KV (docs/architecture.md, "Fidelity").

#include <algorithm>
#include <cstdint>
#include <string>

namespace kvrelay {

struct Fidelity {
  // Leading tokens whose KV is bit-exact to the source's. Past them the KV went through a lossy
  // codec, or was computed by attending over KV that did.
  std::uint64_t exact_tokens = 0;
  // The lossy codec's spec ("int4", "int8+zstd"); empty when every token is exact.
  std::string lossy_codec;
  // The product of the fidelity factors of the lossy hops this KV went through (issue #27,
  // precision refresh); 1 when exact. A writer that does not know it leaves 1: readers take the
  // smaller of it and the factor of `lossy_codec`, so an unknown product is never optimistic.
  double product = 1.0;

  [[nodiscard]] static Fidelity exact() { return {}; }
  // KV whose tokens from `exact_tokens` on came through (or from) `codec`.
  [[nodiscard]] static Fidelity lossy(std::string codec, std::uint64_t exact_tokens = 0, double product = 1.0) {
    return {exact_tokens, std::move(codec), product};
  }
  [[nodiscard]] bool is_exact() const { return lossy_codec.empty(); }
  // Whether the first `tokens` tokens are all exact.
  [[nodiscard]] bool exact_through(std::uint64_t tokens) const { return is_exact() || tokens <= exact_tokens; }
  // The fidelity of the first `tokens` tokens alone.
  [[nodiscard]] Fidelity prefix(std::uint64_t tokens) const { return exact_through(tokens) ? exact() : *this; }
  // This run followed by one of `tail` fidelity starting at token `offset`: exactness ends at the
  // first lossy token of either. Two lossy runs keep the smaller product, and their codec when
  // they share it; else kMixedCodec, which no lookup's codec matches (only "any fidelity" reads it).
  [[nodiscard]] Fidelity then(const Fidelity& tail, std::uint64_t offset) const {
    if (!is_exact()) {
      if (tail.is_exact()) return *this;
      const bool same = tail.lossy_codec == lossy_codec;
      return lossy(same ? lossy_codec : std::string(kMixedCodec), exact_tokens, std::min(product, tail.product));
    }
    if (tail.is_exact()) return exact();
    return lossy(tail.lossy_codec, offset + std::min(tail.exact_tokens, UINT64_MAX - offset), tail.product);
  }
  static constexpr const char* kMixedCodec = "mixed";
  // Never less faithful than `other`: at least as many exact leading tokens.
  [[nodiscard]] bool at_least_as_exact_as(const Fidelity& other) const {
    if (is_exact()) return true;
    return !other.is_exact() && exact_tokens >= other.exact_tokens;
  }
  friend bool operator==(const Fidelity&, const Fidelity&) = default;
};

}  // namespace kvrelay
