"""The connector's two copy paths (native kvrelay_paged_* and torch indexing) agree bit for bit,
in every paged layout, on real torch tensors, including strided views."""

from __future__ import annotations

import ctypes
import random
import unittest

import torch

from kvrelay_sidecar import Sidecar as SidecarProcess
from kvrelay_vllm import _native as native
from kvrelay_vllm.layouts import describe
from kvrelay_vllm.sidecar import Sidecar
from kvrelay_vllm.torch_copy import HostRegistry, TorchCopier, arena_mapping_of

BLOCK = 16
HEADS = 4
HEAD_DIM = 32
BLOCKS = 12


def cache_tensor(layout: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    shape = {native.PAGED_FLASH_ATTN: (2, BLOCKS, BLOCK, HEADS, HEAD_DIM),
             native.PAGED_FLASHINFER: (BLOCKS, 2, BLOCK, HEADS, HEAD_DIM),
             native.PAGED_CPU: (2, BLOCKS, HEADS, BLOCK, HEAD_DIM)}[layout]
    return torch.randn(shape, generator=generator).to(dtype)


class CopyPathsAgree(unittest.TestCase):
    def setUp(self) -> None:
        self.lib = native.library()

    def round_trip(self, layout: int, dtype: torch.dtype, make_view) -> None:
        generator = torch.Generator().manual_seed(layout * 10 + torch.empty((), dtype=dtype).element_size())
        cache = make_view(cache_tensor(layout, dtype, generator))
        block_ids = random.Random(layout).sample(range(BLOCKS), 5)
        first, tokens = 7, 61  # not block-aligned at either end
        row = HEADS * HEAD_DIM * cache.element_size()
        native_out = torch.zeros(2 * tokens * row, dtype=torch.uint8)
        torch_out = torch.zeros(2 * tokens * row, dtype=torch.uint8)
        ids = (ctypes.c_int32 * len(block_ids))(*block_ids)
        view = describe(cache, BLOCK, HEADS, HEAD_DIM, layout).native_view
        self.lib.paged_copy(False, view, ids, first, tokens, native_out.data_ptr(),
                            native_out.data_ptr() + tokens * row)
        TorchCopier().copy(False, cache, layout, BLOCK, block_ids, first, tokens, torch_out.data_ptr(),
                           torch_out.data_ptr() + tokens * row)
        self.assertTrue(torch.equal(native_out, torch_out))
        self.assertGreater(int(native_out.count_nonzero()), 0)

        # Scatter the gathered bytes into two zeroed caches: both paths fill the same slots.
        for scatter_path in ("native", "torch"):
            target = torch.zeros_like(cache)
            if scatter_path == "native":
                tview = describe(target, BLOCK, HEADS, HEAD_DIM, layout).native_view
                self.lib.paged_copy(True, tview, ids, first, tokens, native_out.data_ptr(),
                                    native_out.data_ptr() + tokens * row)
            else:
                TorchCopier().copy(True, target, layout, BLOCK, block_ids, first, tokens, native_out.data_ptr(),
                                   native_out.data_ptr() + tokens * row)
            back = torch.zeros_like(native_out)
            tview = describe(target, BLOCK, HEADS, HEAD_DIM, layout).native_view
            self.lib.paged_copy(False, tview, ids, first, tokens, back.data_ptr(), back.data_ptr() + tokens * row)
            self.assertTrue(torch.equal(back, native_out), scatter_path)
            # Only those slots changed: as many nonzero elements as were gathered.
            self.assertEqual(int((target != 0).sum()), int((native_out.view(cache.dtype) != 0).sum()))

    def test_every_layout_and_dtype(self) -> None:
        for layout in (native.PAGED_FLASH_ATTN, native.PAGED_FLASHINFER, native.PAGED_CPU):
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                with self.subTest(layout=layout, dtype=dtype):
                    self.round_trip(layout, dtype, lambda t: t)

    def test_a_strided_view(self) -> None:
        # A cache that is a slice of a bigger allocation (vLLM's layers can share one buffer).
        def sliced(tensor: torch.Tensor) -> torch.Tensor:
            big = torch.zeros((2,) + tuple(tensor.shape), dtype=tensor.dtype)
            big[1].copy_(tensor)
            return big[1]
        self.round_trip(native.PAGED_FLASH_ATTN, torch.float16, sliced)

        def heads_view(tensor: torch.Tensor) -> torch.Tensor:
            # KV heads interleaved with another rank's: a non-contiguous head stride.
            shape = list(tensor.shape)
            shape[3] *= 2
            big = torch.zeros(shape, dtype=tensor.dtype)
            big[:, :, :, ::2].copy_(tensor)
            return big[:, :, :, ::2]
        self.round_trip(native.PAGED_FLASH_ATTN, torch.bfloat16, heads_view)


class ArenaRegistration(unittest.TestCase):
    """What the CUDA copy path registers: the sidecar's arena mapping, found for a real region of
    a real sidecar, once, and unregistered before the connection closes. (cudaHostRegister itself
    runs where a GPU is: scripts/gpu-check.sh.)"""

    def setUp(self) -> None:
        self.process = SidecarProcess("node-a").start()
        self.client = Sidecar(self.process.socket)

    def tearDown(self) -> None:
        self.client.close()
        self.process.close()

    def test_the_arena_mapping_is_registered_once_and_forgotten_before_close(self) -> None:
        region, address = self.client.allocate(1 << 20)
        try:
            mapping = arena_mapping_of(address)
            self.assertIsNotNone(mapping, "a region of the arena is not in a kvrelay-arena mapping")
            start, end = mapping
            self.assertTrue(start <= address and address + (1 << 20) <= end)
            self.assertGreaterEqual(end - start, 1 << 20)
            # Memory that is not the sidecar's arena is never registered.
            self.assertIsNone(arena_mapping_of(torch.zeros(1 << 16, dtype=torch.uint8).data_ptr()))
            registered: list = []
            unregistered: list = []
            registry = HostRegistry(register=lambda s, n: registered.append((s, n)) or True,
                                    unregister=unregistered.append)
            self.client.before_close.append(registry.forget)
            self.assertTrue(registry.covers(address, 1 << 20))
            self.assertTrue(registry.covers(address + 4096, 4096))
            self.assertEqual(registered, [(start, end - start)])
            self.assertFalse(registry.covers(torch.zeros(16).data_ptr(), 64))
            # A mapping CUDA refused is not asked again: the bounce buffer serves it.
            refusing_calls: list = []
            refusing = HostRegistry(register=lambda s, n: refusing_calls.append(s) and False)
            self.assertFalse(refusing.covers(address, 4096))
            self.assertFalse(refusing.covers(address, 4096))
            self.assertEqual(len(refusing_calls), 1)
        finally:
            self.client.abort(region)
        self.client.close()
        self.assertEqual(unregistered, [start])


if __name__ == "__main__":
    unittest.main()
