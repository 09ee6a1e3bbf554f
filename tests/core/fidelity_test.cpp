// Fidelity's product (issue #27, precision refresh): 1 for exact KV and for KV nobody stamped,
// kept by a lossy prefix, carried from a lossy tail into a join, and never a reason to call KV
// more exact than it is.

#include "kvrelay/core/fidelity.h"

#include <catch2/catch.hpp>

using kvrelay::Fidelity;

TEST_CASE("fidelity product: exact KV and unstamped lossy KV carry 1", "[core][fidelity]") {
  CHECK(Fidelity::exact().product == 1.0);
  CHECK(Fidelity::lossy("int8").product == 1.0);
  CHECK(Fidelity::lossy("int8", 16, 0.81).product == 0.81);
  // The product is part of what a fidelity is: the same codec with another product differs.
  CHECK_FALSE(Fidelity::lossy("int8", 0, 0.9) == Fidelity::lossy("int8", 0, 0.81));
}

TEST_CASE("fidelity product: a prefix keeps it while lossy, and is exact (1) when its tokens are", "[core][fidelity]") {
  const Fidelity lossy = Fidelity::lossy("int8", 32, 0.729);
  CHECK(lossy.prefix(32) == Fidelity::exact());
  CHECK(lossy.prefix(32).product == 1.0);
  CHECK(lossy.prefix(48).product == 0.729);
  CHECK(lossy.prefix(48).lossy_codec == "int8");
}

TEST_CASE("fidelity product: a join carries the lossy part's product", "[core][fidelity]") {
  // Exact head, lossy tail: the tail's product, exactness shifted by the head's tokens.
  const Fidelity joined = Fidelity::exact().then(Fidelity::lossy("int4", 0, 0.9), 64);
  CHECK(joined.exact_tokens == 64);
  CHECK(joined.product == 0.9);
  // A lossy head followed by exact KV stays what it was; by lossy KV, the smaller product, and
  // its codec only when both share it (a join of int8 and int4 KV is neither).
  const Fidelity head = Fidelity::lossy("int8", 0, 0.81);
  CHECK(head.then(Fidelity::exact(), 64) == head);
  const Fidelity mixed = head.then(Fidelity::lossy("int4", 0, 0.5), 64);
  CHECK(mixed.product == 0.5);
  CHECK(mixed.lossy_codec == Fidelity::kMixedCodec);
  CHECK(mixed.exact_tokens == 0);
  CHECK(head.then(Fidelity::lossy("int8", 0, 0.9), 64) == head);
  CHECK(head.then(Fidelity::lossy("int8", 0, 0.7), 64).product == 0.7);
  // Both exact: exact.
  CHECK(Fidelity::exact().then(Fidelity::exact(), 64).product == 1.0);
}

TEST_CASE("fidelity product: a smaller product never makes KV more exact", "[core][fidelity]") {
  // Exactness is leading exact tokens; the product only ranks lossy KV on a chain.
  CHECK(Fidelity::lossy("int8", 0, 0.5).at_least_as_exact_as(Fidelity::lossy("int8", 0, 0.9)));
  CHECK_FALSE(Fidelity::lossy("int8", 0, 1.0).at_least_as_exact_as(Fidelity::exact()));
  CHECK(Fidelity::exact().at_least_as_exact_as(Fidelity::lossy("int8", 0, 0.9)));
}
