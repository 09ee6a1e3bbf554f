"""The connector's GPU path on CUDA tensors: KV published from and loaded into paged caches on
the device, through a real sidecar's shared memory, bit-exact, straight through the registered
arena mapping and through the pinned bounce buffer. Skips without a GPU (scripts/gpu-check.sh
runs it where one is lent)."""

from __future__ import annotations

import unittest

import torch

from engine_proc import build_engine, counters, run_requests
from kvrelay_sidecar import Sidecar


def prompt(seed: int, length: int) -> list[int]:
    return [1] + [3 + (index * 41 + seed * 103) % 500 for index in range(1, length)]


@unittest.skipUnless(torch.cuda.is_available(), "no CUDA device")
class GpuPath(unittest.TestCase):
    def setUp(self) -> None:
        self.sidecar = Sidecar("node-a").start()

    def tearDown(self) -> None:
        self.sidecar.close()

    def handoff(self, copy: str, seed: int, layout: str = "flash_attn") -> tuple[dict, dict, str]:
        spec = {"socket": self.sidecar.socket, "device": "cuda", "layout": layout,
                "block_size": 16 if layout != "cpu" else 32, "extra": {"copy": copy}}
        a_prompt = prompt(seed, 70)
        writer = build_engine(spec)
        a = run_requests(writer, [{"id": "a", "prompt": a_prompt}])["a"]
        published = counters(writer)["worker"]["publishes"]
        writer.shutdown()
        self.assertEqual(published, 1)
        reader = build_engine(spec)
        b = run_requests(reader, [{"id": "b", "prompt": a_prompt + [5, 5]}])["b"]
        mode = reader.worker_connector.copy_mode
        reader.shutdown()
        print(f"copy {copy} layout {layout}: {mode}")
        return a, b, mode

    def test_auto_copies_are_bit_exact_and_say_which_path_they_took(self) -> None:
        for layout in ("flash_attn", "flashinfer"):
            with self.subTest(layout=layout):
                a, b, mode = self.handoff("auto", 20 + len(layout), layout)
                self.assertTrue(a["kv_ok"])
                self.assertEqual(b["loaded_tokens"], 64)
                self.assertTrue(b["kv_ok"], b["mismatched_tokens"])
                self.assertIn(mode, ("cuda-registered", "cuda-bounce"))

    def test_the_bounce_buffer_path_is_bit_exact(self) -> None:
        a, b, mode = self.handoff("bounce", 30)
        self.assertEqual(mode, "cuda-bounce")
        self.assertEqual(b["loaded_tokens"], 64)
        self.assertTrue(b["kv_ok"], b["mismatched_tokens"])


if __name__ == "__main__":
    unittest.main()
