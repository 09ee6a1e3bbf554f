"""The connector's two copy paths (native kvrelay_paged_* and torch indexing) agree bit for bit,
in every paged layout, on real torch tensors, including strided views."""

from __future__ import annotations

import ctypes
import random
import unittest

import torch

from kvrelay_vllm import _native as native
from kvrelay_vllm.layouts import describe
from kvrelay_vllm.torch_copy import TorchCopier

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


if __name__ == "__main__":
    unittest.main()
