"""vllm.config.scheduler.SchedulerConfig: the fields the connector path reads."""

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    # The factory refuses a connector without HMA support unless this is set (vLLM sets it
    # when a connector is configured and the model has one KV cache group).
    disable_hybrid_kv_cache_manager: bool = True
