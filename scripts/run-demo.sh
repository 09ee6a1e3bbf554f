#!/usr/bin/env bash
# The README's main command: installs dependencies, builds kvrelay and runs the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)" --target kvrelay
exec bash scripts/demo-healthz.sh build/default/proxy/kvrelay
