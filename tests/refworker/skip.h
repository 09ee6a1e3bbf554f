#pragma once

#include <catch2/catch.hpp>

// Catch2 v2 has no SKIP: warn (visible with -s and in failure reports) and leave the test case.
#define KVRELAY_SKIP(reason)        \
  do {                              \
    WARN("skipped: " << (reason));  \
    return;                         \
  } while (false)
