"""vllm.config.parallel.ParallelConfig: the fields a connector reads."""

from dataclasses import dataclass


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    rank: int = 0  # the global rank of this worker

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size
