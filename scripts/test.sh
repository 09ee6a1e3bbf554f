#!/usr/bin/env bash
# The README's test command: installs dependencies, builds the default preset and runs the whole
# test suite. Usage: scripts/test.sh [extra ctest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
jobs=$(nproc)
# KVRELAY_CMAKE_ARGS: configure arguments (CI passes -DKVRELAY_BUILD_BENCH=OFF, see .ci/run); the
# default turns the benchmarks back on in a build directory a CI run configured.
read -r -a extra_args <<<"${KVRELAY_CMAKE_ARGS:--DKVRELAY_BUILD_BENCH=ON}"
cmake --preset default "${extra_args[@]}"
cmake --build --preset default -j "$jobs"
ctest --preset default -j "$jobs" "$@"
