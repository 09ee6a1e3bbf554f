#!/usr/bin/env bash
# The CUDA checks for a GPU machine that cannot build kvrelay (no Debian packages, no network),
# such as the lent H200: `pack` here, after building the default preset with nvcc present,
# gathers the binaries that hold the GPU tests (stripped), the shared libraries they load and
# the test model into gpu-bundle/bundle.tar.gz (~21 MiB; a device call carries 64 MiB); `run`
# there unpacks it and checks, with no build tree:
#   - codec_cuda_parity: every kernel's bytes against the CPU codecs;
#   - codec_tests [device] and the `kvrelay codec --device cuda` test: the executor hook,
#     place_codecs and the CLI's GPU frames;
#   - broker_kv_path_tests [cuda]: two sidecars with codecs.device "auto" hand KV over on the GPU;
#   - cuda_codec_bench: throughput next to a device-to-device copy (JSON to $OUT or gpu-out/);
#   - the vLLM connector's GPU path (tests/vllm/test_gpu_path.py with the machine's own torch):
#     CUDA caches handed over bit-exact through a real sidecar, registered and bounced, and
#     bench/connector_bench/gpu_connector_bench.py next to a pinned host <-> device copy;
#   - then, since that machine has 16 cores to itself, the CPU goals of the codec and transport
#     issues away from the 2-vCPU development VM: codec_bench and transport_bench (JSON beside
#     it; each under a time limit so the GPU results always come back).
# Usage: scripts/gpu-check.sh pack [build dir]   |   scripts/gpu-check.sh run
# With the device tool: run(command="bash scripts/gpu-check.sh run", carry=["gpu-bundle"]).
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=gpu-bundle

pack() {
  local build=${1:-build/default}
  local binaries=(proxy/kvrelay refworker/kvrelay-refworker tests/codec_plugins/codec_cuda_parity
                  tests/codec_plugins/codec_tests tests/broker/broker_kv_path_tests
                  bench/codec_bench/cuda_codec_bench bench/codec_bench/codec_bench
                  bench/transport_bench/transport_bench)
  if ! grep -q 'KVRELAY_HAVE_CUDA=1' "$build/build.ninja" 2>/dev/null; then
    echo "gpu-check: $build was not built with CUDA (configure with nvcc on the PATH)" >&2
    exit 2
  fi
  staging=$(mktemp -d)
  trap 'rm -rf "$staging"' EXIT
  mkdir -p "$staging/bin" "$staging/lib" "$staging/model"
  # The connector's C ABI, which Python loads (no binary links it).
  strip -o "$staging/lib/libkvrelay_client.so" "$build/shm_transport/libkvrelay_client.so"
  for binary in "${binaries[@]}"; do
    if [[ ! -x $build/$binary ]]; then
      echo "gpu-check: $build/$binary is missing (build the default preset with the benchmarks)" >&2
      exit 2
    fi
    strip -o "$staging/bin/$(basename "$binary")" "$build/$binary"
    # Every library but the C library and the loader (the machine's own): libstdc++ too, since
    # the GPU machine's may be older than the one these were built with.
    local libraries
    libraries=$(ldd "$build/$binary")
    if grep -q "not found" <<<"$libraries"; then
      echo "gpu-check: $binary needs a library this machine lacks:" >&2
      grep "not found" <<<"$libraries" >&2
      exit 2
    fi
    while read -r library; do
      # Not cp -n: coreutils 9.2 and later fail on a file already there.
      [[ -e $staging/lib/${library##*/} ]] || cp -L "$library" "$staging/lib/"
    done < <(awk '$3 ~ /^\// {print $3}' <<<"$libraries" |
      grep -v -E '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so')
  done
  local model=${KVRELAY_TEST_MODEL:-../shared/models/stories260K.bin}
  if [[ -f $model ]]; then
    cp "$model" "$staging/model/stories260K.bin"
  else
    echo "gpu-check: no stories260K.bin at $model: the end-to-end GPU test will skip" >&2
  fi
  rm -rf "$bundle"
  mkdir -p "$bundle"
  tar czf "$bundle/bundle.tar.gz" -C "$staging" bin lib model
  local bytes
  bytes=$(stat -c %s "$bundle/bundle.tar.gz")
  echo "gpu-check: $bundle/bundle.tar.gz is $((bytes / 1048576)) MiB"
  if ((bytes > 64 * 1048576)); then
    echo "gpu-check: over the 64 MiB a device call carries" >&2
    exit 1
  fi
}

run() {
  local root=${TMPDIR:-/tmp}/kvrelay-gpu-check
  rm -rf "$root"
  mkdir -p "$root/tmp"
  tar xzf "$bundle/bundle.tar.gz" -C "$root"
  local bin=$root/bin
  local out=${OUT:-$PWD/gpu-out}
  mkdir -p "$out"
  export LD_LIBRARY_PATH=$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export KVRELAY_BIN=$bin/kvrelay KVRELAY_REFWORKER_BIN=$bin/kvrelay-refworker KVRELAY_TEST_TMPDIR=$root/tmp
  if [[ -f $root/model/stories260K.bin ]]; then export KVRELAY_TEST_MODEL=$root/model/stories260K.bin; fi
  local failed=0
  step() {
    local name=$1
    shift
    local status=0
    "$@" >"$out/$name.log" 2>&1 || status=$?
    local note=""
    if grep -q "skipped" "$out/$name.log"; then note=" ($(grep -m1 -o 'skipped.*' "$out/$name.log"))"; fi
    echo "$name: exit $status$note" | tee -a "$out/summary.txt"
    tail -n 3 "$out/$name.log"
    # 77: the parity check found no device.
    if ((status != 0 && status != 77)); then failed=1; fi
  }
  : >"$out/summary.txt"
  step devices nvidia-smi -L
  step parity "$bin/codec_cuda_parity"
  # --warn NoTests: a renamed test fails the step instead of passing with nothing run.
  step codec_device "$bin/codec_tests" --warn NoTests "[device]"
  step codec_cli_cuda "$bin/codec_tests" --warn NoTests \
    "kvrelay codec --device cuda writes the CPU's frame\\, or refuses naming why"
  step sidecar_gpu_handoff "$bin/broker_kv_path_tests" --warn NoTests "[cuda]" -s
  step cuda_codec_bench sh -c "'$bin/cuda_codec_bench' > '$out/cuda_codec_bench.json'"
  # The vLLM connector on CUDA tensors, with this machine's python3 and torch (nothing installed).
  local python_env=(env "KVRELAY_CLIENT_LIB=$root/lib/libkvrelay_client.so"
                    "PYTHONPATH=$PWD/connectors/vllm:$PWD/tests/vllm/standin:$PWD/tests/vllm")
  step connector_gpu "${python_env[@]}" sh -c "cd tests/vllm && python3 -m unittest -v test_gpu_path"
  step connector_gpu_bench timeout 120 "${python_env[@]}" sh -c \
    "python3 bench/connector_bench/gpu_connector_bench.py > '$out/gpu_connector_bench.json'"
  # The CPU benchmarks on an otherwise idle many-core machine (`timeout` exits 124 when one
  # runs out of time; its partial output is kept).
  local model_kv=()
  if [[ -n ${KVRELAY_TEST_MODEL:-} ]] &&
    "$bin/kvrelay-refworker" dump-kv --model "$KVRELAY_TEST_MODEL" --tokens 400 --queries 32 \
      --out "$root/tmp/dump400" >"$out/dump_kv.log" 2>&1; then
    model_kv=(--kv "$root/tmp/dump400/kv.bin" --kv-layout 5,4,8,fp32 --kv-tokens 400 --kv-name stories260K-400
              --kv-convert fp16 bf16)
  fi
  step codec_bench timeout 150 sh -c "\"\$0\" \"\$@\" > '$out/codec_bench.json'" "$bin/codec_bench" "${model_kv[@]}"
  step transport_bench timeout 120 sh -c "'$bin/transport_bench' --repeats 5 > '$out/transport_bench.json'"
  nproc >"$out/nproc.txt"
  lscpu >"$out/lscpu.txt" 2>&1 || true
  return $failed
}

case ${1:-} in
  pack) pack "${2:-}" ;;
  run) run ;;
  *)
    echo "usage: scripts/gpu-check.sh pack [build dir] | run" >&2
    exit 2
    ;;
esac
