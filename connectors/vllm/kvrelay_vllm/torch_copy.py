"""Paged KV <-> kvrelay region copies with torch indexing, for caches on a GPU.

The region is host shared memory. A CUDA cache copies straight to and from it where CUDA
accepts the sidecar's arena mapping with cudaHostRegister (registered once per mapping), and
through a pinned bounce buffer (one per connector, grown as needed) where it does not. The
gather/scatter runs on the device as one indexed copy per tensor, so no Python loop touches KV
bytes. With CPU tensors the same code runs without the device hop (how its host side is tested
without a GPU).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

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


# The sidecar names its arena memfd so (kv_store/src/arena.cpp). Only the arena is mapped once
# per connection and reused; other regions and entries are mapped per use, too briefly to pin.
ARENA_MAPPING = "/memfd:kvrelay-arena"


def arena_mapping_of(address: int, maps_path: str = "/proc/self/maps") -> tuple[int, int] | None:
    """[start, end) of the sidecar arena mapping that holds `address`, or None."""
    try:
        with open(maps_path, "r", encoding="ascii", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                start_text, _, end_text = fields[0].partition("-")
                start, end = int(start_text, 16), int(end_text, 16)
                if start <= address < end:
                    path = fields[5].strip() if len(fields) > 5 else ""
                    return (start, end) if path.startswith(ARENA_MAPPING) else None
    except (OSError, ValueError, IndexError):
        return None
    return None


# cudaHostRegisterDefault, then cudaHostRegisterReadOnly (CUDA 11.1+) for read-only mappings.
_REGISTER_FLAGS = (0, 8)


def cuda_host_register(start: int, size: int) -> bool:
    """Pins [start, start + size) for the GPU's DMA engines; False where CUDA refuses it."""
    try:
        cudart = torch.cuda.cudart()
    except (AttributeError, RuntimeError, AssertionError):
        return False
    for flags in _REGISTER_FLAGS:
        try:
            if int(cudart.cudaHostRegister(start, size, flags)) == 0:
                return True
        except (RuntimeError, TypeError):
            return False
    return False


def cuda_host_unregister(start: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(start)
    except (AttributeError, RuntimeError, AssertionError, TypeError):
        pass


class HostRegistry:
    """The sidecar's shared mappings this process registered with CUDA: each one once, so an
    import or export copies between the device and shared memory with no bounce."""

    def __init__(self, register: Callable[[int, int], bool] = cuda_host_register,
                 unregister: Callable[[int], None] = cuda_host_unregister,
                 find: Callable[[int], tuple[int, int] | None] = arena_mapping_of) -> None:
        self._register = register
        self._unregister = unregister
        self._find = find
        self._registered: list[tuple[int, int]] = []
        self._refused: set[tuple[int, int]] = set()

    def covers(self, address: int, size: int) -> bool:
        for start, end in self._registered:
            if start <= address and address + size <= end:
                return True
        mapping = self._find(address)
        if mapping is None or mapping in self._refused or address + size > mapping[1]:
            return False
        if not self._register(mapping[0], mapping[1] - mapping[0]):
            self._refused.add(mapping)
            return False
        self._registered.append(mapping)
        return True

    def forget(self) -> None:
        """Unregisters everything: called before the connection (and so its arena) is closed."""
        for start, _ in self._registered:
            self._unregister(start)
        self._registered.clear()
        self._refused.clear()


class TorchCopier:
    """Moves one sequence's KV between a region and a cache tensor of any device."""

    def __init__(self, register: bool = True, registry: HostRegistry | None = None) -> None:
        self._staging: torch.Tensor | None = None
        self.registry = (registry or HostRegistry()) if register else None
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
            nbytes = host.numel() * host.element_size()
            if cache.is_cuda and self.registry is not None and self.registry.covers(address, nbytes):
                self.mode = "cuda-registered"
                if scatter:
                    cache[index] = host.to(cache.device, non_blocking=True)
                else:
                    host.copy_(cache[index])  # device -> registered host memory, synchronous
            elif cache.is_cuda:
                self.mode = "cuda-bounce"
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
            # The staging buffer is reused, and the entry's memory is released after this call.
            torch.cuda.current_stream(cache.device).synchronize()


def describe_mode(caches: dict[str, Any], copy: str) -> str:
    """"native" (host caches, kvrelay_paged_*), "torch-host", or for CUDA caches "cuda" until the
    first copy finds out whether it goes "cuda-registered" or "cuda-bounce"."""
    if any(getattr(t, "is_cuda", False) for t in caches.values()):
        return "cuda-bounce" if copy == "bounce" else "cuda"
    return "torch-host" if copy == "torch" else "native"
