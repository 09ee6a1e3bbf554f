from .cache import CacheConfig
from .kv_transfer import KVTransferConfig
from .model import ModelConfig
from .parallel import ParallelConfig
from .scheduler import SchedulerConfig
from .vllm import VllmConfig

__all__ = ["CacheConfig", "KVTransferConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig", "VllmConfig"]
