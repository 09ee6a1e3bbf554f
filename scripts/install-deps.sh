#!/usr/bin/env bash
# Installs every Debian 12 package that kvrelay's build, tests, benchmarks and demo need.
# Idempotent: does nothing (and touches no network) when everything is already installed.
# Boost 1.81 is used deliberately; libboost1.74-dev conflicts with it and must not be pulled in.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libboost1.81-dev nlohmann-json3-dev libspdlog-dev libfmt-dev libzstd-dev libxxhash-dev
  catch2 libcli11-dev libopenblas-dev libssl-dev openssl
  libucx-dev ucx-utils
  python3 python3-jsonschema python3-torch nginx-light prometheus
  chromium python3-websocket
  clang-14 libclang-rt-14-dev lld-14
)

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if ((${#missing[@]} == 0)); then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if [[ $(id -u) -ne 0 ]]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
