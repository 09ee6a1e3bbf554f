"""vllm.config.cache.CacheConfig: the fields a connector reads."""

from dataclasses import dataclass


@dataclass
class CacheConfig:
    block_size: int = 16
    cache_dtype: str = "auto"  # "auto" (the model's dtype), "fp8", "fp8_e4m3", "fp8_e5m2", ...
    enable_prefix_caching: bool = True
    num_gpu_blocks: int | None = None
