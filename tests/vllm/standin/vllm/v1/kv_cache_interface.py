"""vllm.v1.kv_cache_interface: KVCacheConfig and the spec of one attention group."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def page_size_bytes(self) -> int:
        # K and V of one block.
        return 2 * self.block_size * self.num_kv_heads * self.head_size * torch.tensor([], dtype=self.dtype).element_size()


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: int | None = None


@dataclass
class KVCacheTensor:
    size: int  # bytes
    shared_by: list[str]


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[KVCacheTensor]
    kv_cache_groups: list[KVCacheGroupSpec]
