"""vLLM's paged KV cache tensors as the native gather/scatter sees them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import _native as native

LAYOUT_NAMES = {native.PAGED_FLASH_ATTN: "flash_attn", native.PAGED_FLASHINFER: "flashinfer",
                native.PAGED_CPU: "cpu"}


def _matches(layout: int, shape: tuple, block_size: int, heads: int, head_dim: int) -> bool:
    if len(shape) != 5 or shape[4] != head_dim:
        return False
    if layout == native.PAGED_FLASH_ATTN:
        return shape[0] == 2 and shape[2] == block_size and shape[3] == heads
    if layout == native.PAGED_FLASHINFER:
        return shape[1] == 2 and shape[2] == block_size and shape[3] == heads
    return shape[0] == 2 and shape[2] == heads and shape[3] == block_size


def detect_layout(shape: tuple, block_size: int, heads: int, head_dim: int, forced: int | None) -> int:
    """The layout a cache tensor's shape names; ValueError when it names none or several."""
    if forced is not None:
        if not _matches(forced, shape, block_size, heads, head_dim):
            raise ValueError(f"KV cache shape {shape} is not the {LAYOUT_NAMES[forced]} layout for "
                             f"block_size {block_size}, {heads} KV heads, head size {head_dim}")
        return forced
    found = [layout for layout in LAYOUT_NAMES if _matches(layout, shape, block_size, heads, head_dim)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(f"KV cache shape {shape} is none of the flash_attn (2, blocks, {block_size}, {heads}, "
                         f"{head_dim}), flashinfer (blocks, 2, {block_size}, {heads}, {head_dim}) or cpu "
                         f"(2, blocks, {heads}, {block_size}, {head_dim}) layouts")
    names = [LAYOUT_NAMES[layout] for layout in found]
    raise ValueError(f"KV cache shape {shape} fits the layouts {names}: set kv_connector_extra_config.paged_layout")


@dataclass
class PagedCache:
    """One layer's cache tensor, described once at register_kv_caches."""

    tensor: Any
    layout: int
    native_view: native.PagedTensor
    elem_size: int

    @property
    def is_cuda(self) -> bool:
        return bool(getattr(self.tensor, "is_cuda", False))


def describe(tensor: Any, block_size: int, heads: int, head_dim: int, forced: int | None) -> PagedCache:
    shape = tuple(int(dim) for dim in tensor.shape)
    layout = detect_layout(shape, block_size, heads, head_dim, forced)
    view = native.sized(native.PagedTensor)
    view.layout = layout
    view.elem_size = int(tensor.element_size())
    view.data = int(tensor.data_ptr())
    for index in range(5):
        view.shape[index] = shape[index]
        view.strides[index] = int(tensor.stride(index))
    return PagedCache(tensor=tensor, layout=layout, native_view=view, elem_size=view.elem_size)
