#!/usr/bin/env bash
# Starts the daemon on the example single-node policy (on free ports), shows it answering
# /healthz and /readyz, then stops it with SIGTERM and reports its exit status.
set -euo pipefail
kvrelay=${1:-build/default/proxy/kvrelay}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Same policy as config/single-node.json, but on ports the kernel picks so nothing collides.
python3 - "$work/policy.json" <<'PY'
import json, sys
policy = json.load(open("config/single-node.json"))
policy["listen"]["http"] = "127.0.0.1:0"
policy["listen"]["admin"] = "127.0.0.1:0"
json.dump(policy, open(sys.argv[1], "w"), indent=2)
PY
"$kvrelay" check-config "$work/policy.json"
"$kvrelay" serve --config "$work/policy.json" --ready-file "$work/ready.json" &
pid=$!
for _ in $(seq 100); do [[ -s $work/ready.json ]] && break; sleep 0.05; done
http_port=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["http"])' "$work/ready.json")
echo "GET http://127.0.0.1:$http_port/healthz -> $(python3 - "$http_port" <<'PY'
import sys, urllib.request
with urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthz", timeout=5) as r:
    print(r.status, r.read().decode().strip())
PY
)"
kill -TERM "$pid"
wait "$pid" && echo "kvrelay drained and exited 0"
