"""One test engine process: a MiniEngine with KvRelayConnector, run over requests from a JSON spec.

  python3 engine_proc.py SPEC.json   ->  one JSON object on stdout: results per request and the
                                          connectors' counters
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from mini_engine import MiniEngine

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def build_engine(spec: dict) -> MiniEngine:
    extra = {"socket": spec["socket"], "weights": spec.get("weights", "standin-tiny"), "retry_seconds": 0.05,
             **spec.get("extra", {})}
    from kvrelay_vllm import KvRelayConnector
    return MiniEngine(spec.get("connector", KvRelayConnector), extra_config=extra,
                      layout=spec.get("layout", "flash_attn"), block_size=spec.get("block_size", 16),
                      num_blocks=spec.get("num_blocks", 64), tp_size=spec.get("tp_size", 1),
                      tp_rank=spec.get("tp_rank", 0), dtype=DTYPES[spec.get("dtype", "float16")],
                      layers=spec.get("layers", 4), kv_heads=spec.get("kv_heads", 4),
                      head_size=spec.get("head_size", 32), device=spec.get("device", "cpu"),
                      cache_dtype=spec.get("cache_dtype", "auto"))


def run_requests(engine: MiniEngine, requests: list[dict]) -> dict:
    """Runs each request to completion, one after another, as separate handoff steps."""
    results = {}
    for request in requests:
        engine.add_request(request["id"], request["prompt"], request.get("max_new_tokens", 2),
                           kv_transfer_params=request.get("kv_transfer_params"))
        engine.run()
        results[request["id"]] = dataclasses.asdict(engine.results[request["id"]])
    return results


def counters(engine: MiniEngine) -> dict:
    return {"scheduler": dataclasses.asdict(engine.scheduler_connector.sidecar.counters),
            "worker": dataclasses.asdict(engine.worker_connector.sidecar.counters),
            "copy_mode": engine.worker_connector.copy_mode}


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    engine = build_engine(spec)
    results = run_requests(engine, spec["requests"])
    out = {"results": results, "counters": counters(engine)}
    engine.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
