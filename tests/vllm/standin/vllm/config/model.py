"""vllm.config.model.ModelConfig: the fields and getters a connector reads."""

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch


@dataclass
class ModelConfig:
    model: str = "standin/tiny-llama"
    dtype: torch.dtype = torch.float16
    num_hidden_layers: int = 4
    num_key_value_heads: int = 4
    num_attention_heads: int = 8
    head_dim: int = 32
    model_type: str = "llama"
    hf_config: Any = field(default=None)

    def __post_init__(self) -> None:
        if self.hf_config is None:
            self.hf_config = SimpleNamespace(model_type=self.model_type, num_hidden_layers=self.num_hidden_layers,
                                             num_key_value_heads=self.num_key_value_heads,
                                             num_attention_heads=self.num_attention_heads,
                                             head_dim=self.head_dim)

    def get_total_num_kv_heads(self) -> int:
        return self.num_key_value_heads

    def get_num_kv_heads(self, parallel_config: Any) -> int:
        # KV heads per tensor-parallel rank; replicated when there are fewer heads than ranks.
        return max(1, self.get_total_num_kv_heads() // parallel_config.tensor_parallel_size)

    def get_head_size(self) -> int:
        return self.head_dim

    def get_num_layers(self, parallel_config: Any) -> int:
        # Layers of this pipeline stage (the stand-in splits them evenly).
        return self.num_hidden_layers // max(1, parallel_config.pipeline_parallel_size)
