#pragma once

// Catch2 v2 has no SKIP. These macros leave the test case, print the reason on stdout and count
// the skip; the test main (support/catch_main.cpp) then exits kSkipExitCode, which ctest reports
// as skipped (SKIP_RETURN_CODE in kvrelay_add_test), not passed.
//
// KVRELAY_SKIP: something scripts/install-deps.sh installs, or ../shared/models provides, is
// missing. Under CI=true that is a failure: CI has every dependency, so a skip there hides a test.
// KVRELAY_SKIP_NO_GPU: no CUDA device or no CUDA build, the one skip CI expects.

#include <catch2/catch.hpp>

#include <string>

namespace kvrelay::test {

// ctest's conventional "skipped" status (the autotools value), also used by codec_cuda_parity.
inline constexpr int kSkipExitCode = 77;

enum class SkipKind { kMissingDependency, kNoGpu };

// Prints "skipped: <reason>" on stdout and counts it; false when CI=true (or CI=1) forbids this
// kind of skip, and the caller must fail the test case instead.
[[nodiscard]] bool record_skip(SkipKind kind, const std::string& reason);

// Test cases that skipped in this process (read by the test main).
[[nodiscard]] int skipped_test_cases();

}  // namespace kvrelay::test

#define KVRELAY_SKIP_AS(kind, reason)                                                                   \
  do {                                                                                                  \
    const std::string kvrelay_skip_reason_(reason);                                                     \
    if (!::kvrelay::test::record_skip(kind, kvrelay_skip_reason_)) {                                    \
      FAIL("cannot skip under CI=true: " << kvrelay_skip_reason_                                        \
                                         << " (CI installs every dependency: scripts/install-deps.sh, " \
                                            "../shared/models)");                                       \
    }                                                                                                   \
    WARN("skipped: " << kvrelay_skip_reason_);                                                          \
    return;                                                                                             \
  } while (false)

#define KVRELAY_SKIP(reason) KVRELAY_SKIP_AS(::kvrelay::test::SkipKind::kMissingDependency, reason)
#define KVRELAY_SKIP_NO_GPU(reason) KVRELAY_SKIP_AS(::kvrelay::test::SkipKind::kNoGpu, reason)
