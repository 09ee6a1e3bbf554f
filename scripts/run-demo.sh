#!/usr/bin/env bash
# The README's main command: installs dependencies, builds kvrelay and the reference worker, and
# runs the demo (three reference workers, two peered kvrelay sidecars; see scripts/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake --preset default >/dev/null
cmake --build --preset default -j "$(nproc)" --target kvrelay kvrelay-refworker
exec python3 scripts/demo.py build/default
