#!/usr/bin/env bash
# The README's test command: installs dependencies, builds the default preset and runs the whole
# test suite. Usage: scripts/test.sh [extra ctest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
jobs=$(nproc)
cmake --preset default
cmake --build --preset default -j "$jobs"
ctest --preset default -j "$jobs" "$@"
