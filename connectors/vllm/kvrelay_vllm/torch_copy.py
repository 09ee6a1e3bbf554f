"""Paged KV <-> kvrelay region copies with torch indexing, for caches on a GPU.

The region is host shared memory; a CUDA cache is reached through a pinned bounce buffer (one
per connector, grown as needed), and the gather/scatter runs on the device as one indexed copy
per tensor, so no Python loop touches KV bytes. With CPU tensors the same code runs without the
device hop (how its host side is tested without a GPU).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from . import _native as native


def host_view(address: int, tokens: int, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """[tokens, heads, head_dim] over `address` (no copy)."""
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = tokens * heads * head_dim * elem
    if nbytes == 0:
        return torch.empty((tokens, heads, head_dim), dtype=dtype)
    buffer = (ctypes.c_uint8 * nbytes).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(tokens, heads, head_dim)


def _slots(block_ids: torch.Tensor, block_size: int, first_token: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(first_token, first_token + tokens, device=block_ids.device)
    return block_ids[positions // block_size], positions % block_size


def _index(cache: torch.Tensor, layout: int, kv: int, blocks: torch.Tensor, slots: torch.Tensor):
    if layout == native.PAGED_FLASH_ATTN:
        return (kv, blocks, slots)
    if layout == native.PAGED_FLASHINFER:
        return (blocks, kv, slots)
    return (kv, blocks, slice(None), slots)  # cpu: heads before tokens; advanced dims come first


class TorchCopier:
    """Moves one sequence's KV between a region and a cache tensor of any device."""

    def __init__(self) -> None:
        self._staging: torch.Tensor | None = None
        self.mode = "torch-host"

    def _bounce(self, like: torch.Tensor) -> torch.Tensor:
        count = like.numel()
        if self._staging is None or self._staging.numel() < count or self._staging.dtype != like.dtype:
            self._staging = torch.empty(count, dtype=like.dtype, pin_memory=True)
        return self._staging[:count].view(like.shape)

    def copy(self, scatter: bool, cache: torch.Tensor, layout: int, block_size: int, block_ids: list[int],
             first_token: int, tokens: int, k_address: int, v_address: int) -> None:
        ids = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
        if int(ids.min()) < 0 or int(ids.max()) >= cache.shape[1 if layout != native.PAGED_FLASHINFER else 0]:
            raise native.KvrelayError("torch copy", native.E_OUT_OF_RANGE, "block id out of the cache's range")
        if (first_token + tokens + block_size - 1) // block_size > len(block_ids):
            raise native.KvrelayError("torch copy", native.E_OUT_OF_RANGE, "block list too short for the tokens")
        heads, head_dim = (cache.shape[2], cache.shape[4]) if layout == native.PAGED_CPU else \
            (cache.shape[3], cache.shape[4])
        blocks, slots = _slots(ids, block_size, first_token, tokens)
        for kv, address in ((0, k_address), (1, v_address)):
            host = host_view(address, tokens, heads, head_dim, cache.dtype)
            index = _index(cache, layout, kv, blocks, slots)
            if cache.is_cuda:
                self.mode = "torch-bounce"
                staging = self._bounce(host)
                if scatter:
                    staging.copy_(host)
                    cache[index] = staging.to(cache.device, non_blocking=True)
                else:
                    staging.copy_(cache[index])  # device -> pinned, synchronous
                    host.copy_(staging)
            elif scatter:
                cache[index] = host
            else:
                host.copy_(cache[index])
        if cache.is_cuda and scatter:
            torch.cuda.current_stream(cache.device).synchronize()  # the staging buffer is reused


def describe_mode(caches: dict[str, Any], forced_torch: bool) -> str:
    if any(getattr(t, "is_cuda", False) for t in caches.values()):
        return "torch-bounce"
    return "torch-host" if forced_torch else "native"
