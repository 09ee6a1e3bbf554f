// Test cases for the skip check (support/skip_check.cmake), hidden ("[.]") so that no suite run
// picks them up: each one skips, passes or fails on purpose.

#include <catch2/catch.hpp>

#include "support/skip.h"

TEST_CASE("skip selftest: a missing dependency", "[.][skip_selftest]") {
  KVRELAY_SKIP("the selftest's dependency is missing on purpose");
}

TEST_CASE("skip selftest: no GPU", "[.][skip_selftest]") {
  KVRELAY_SKIP_NO_GPU("the selftest has no GPU on purpose");
}

TEST_CASE("skip selftest: passes", "[.][skip_selftest]") {
  CHECK(1 + 1 == 2);
}

TEST_CASE("skip selftest: fails", "[.][skip_selftest]") {
  CHECK(1 + 1 == 3);
}
