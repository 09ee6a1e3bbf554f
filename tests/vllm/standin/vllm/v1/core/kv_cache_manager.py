"""vllm.v1.core.kv_cache_manager.KVCacheBlocks: the blocks allocated to a request, per group."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[bytes] = None
    is_null: bool = False


@dataclass
class KVCacheBlocks:
    blocks: tuple[list[KVCacheBlock], ...]  # one list per KV cache group

    def __add__(self, other: "KVCacheBlocks") -> "KVCacheBlocks":
        return KVCacheBlocks(tuple(a + b for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none: bool = False) -> Optional[tuple[list[int], ...]]:
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([block.block_id for block in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        assert len(self.blocks) == 1, "Only one group is supported"
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def new_empty(self) -> "KVCacheBlocks":
        return KVCacheBlocks(tuple([] for _ in range(len(self.blocks))))
