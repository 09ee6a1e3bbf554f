"""The vLLM connector's GPU path: 2048 tokens of a Llama-3-8B-shaped KV (32 layers, 8 KV heads,
head size 128, bf16: 256 MiB) exported from and imported into paged CUDA caches (FlashAttention
layout) through a real sidecar's shared-memory arena, registered with CUDA and through the
pinned bounce buffer, each next to a plain pinned host <-> device copy of the same bytes in the
same run (the link's limit). Paired medians of 7. Prints one JSON object.

  python3 bench/connector_bench/gpu_connector_bench.py   (KVRELAY_BIN, KVRELAY_CLIENT_LIB set;
  PYTHONPATH with connectors/vllm and tests/vllm; run by scripts/gpu-check.sh)
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

LAYERS, HEADS, HEAD_DIM, TOKENS, BLOCK = 32, 8, 128, 2048, 16
REPEATS = 7


def timed(action) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    action()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "no CUDA device"}))
        return 0
    from kvrelay_sidecar import Sidecar as SidecarProcess
    from kvrelay_vllm import _native as native
    from kvrelay_vllm.sidecar import Sidecar
    from kvrelay_vllm.torch_copy import TorchCopier

    process = SidecarProcess("bench", limits={"shm_arena_bytes": 512 << 20}).start()
    client = Sidecar(process.socket)
    try:
        row = HEADS * HEAD_DIM * 2
        stride = TOKENS * row
        total = LAYERS * 2 * stride
        region, address = client.allocate(total)
        blocks = TOKENS // BLOCK
        ids = list(torch.randperm(blocks * 2)[:blocks].tolist())
        caches = [torch.randn((2, blocks * 2, BLOCK, HEADS, HEAD_DIM), device="cuda").to(torch.bfloat16)
                  for _ in range(LAYERS)]
        copiers = {"registered": TorchCopier(register=True), "bounce": TorchCopier(register=False)}
        device_bytes = torch.empty(total, dtype=torch.uint8, device="cuda")
        pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)

        def run(copier: TorchCopier, scatter: bool):
            def action() -> None:
                for layer, cache in enumerate(caches):
                    k = address + 2 * layer * stride
                    copier.copy(scatter, cache, native.PAGED_FLASH_ATTN, BLOCK, ids, 0, TOKENS, k, k + stride)
            return action

        samples: dict[str, list[float]] = {}
        for _ in range(REPEATS):
            samples.setdefault("d2h_pinned", []).append(timed(lambda: pinned.copy_(device_bytes)))
            samples.setdefault("h2d_pinned", []).append(timed(lambda: device_bytes.copy_(pinned, non_blocking=True)))
            for name, copier in copiers.items():
                samples.setdefault(f"export_{name}", []).append(timed(run(copier, False)))
                samples.setdefault(f"import_{name}", []).append(timed(run(copier, True)))
        modes = {name: copier.mode for name, copier in copiers.items()}
        client.abort(region)
        med = {name: statistics.median(values) for name, values in samples.items()}
        ratios = {}
        for name in copiers:
            ratios[f"export_{name}_vs_pinned_copy"] = statistics.median(
                d / e for d, e in zip(samples["d2h_pinned"], samples[f"export_{name}"]))
            ratios[f"import_{name}_vs_pinned_copy"] = statistics.median(
                h / i for h, i in zip(samples["h2d_pinned"], samples[f"import_{name}"]))
        print(json.dumps({
            "bench": "gpu_connector_bench", "bytes": total, "repeats": REPEATS, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "modes": modes,
            "gib_per_s": {name: total / seconds / (1 << 30) for name, seconds in med.items()},
            "median_ms": {name: seconds * 1e3 for name, seconds in med.items()}, **ratios}, indent=1))
    finally:
        client.close()
        process.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
