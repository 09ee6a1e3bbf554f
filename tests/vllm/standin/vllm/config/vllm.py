"""vllm.config.vllm.VllmConfig: the aggregate every connector is constructed with."""

from dataclasses import dataclass, field
from typing import Optional

from .cache import CacheConfig
from .kv_transfer import KVTransferConfig
from .model import ModelConfig
from .parallel import ParallelConfig
from .scheduler import SchedulerConfig


@dataclass
class VllmConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    kv_transfer_config: Optional[KVTransferConfig] = None
