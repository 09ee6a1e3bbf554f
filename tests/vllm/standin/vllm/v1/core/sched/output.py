"""vllm.v1.core.sched.output: what Scheduler.schedule hands the workers each step."""

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: Optional[list[int]]
    mm_features: list[Any]
    sampling_params: Any
    pooling_params: Any
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: Any
    prompt_embeds: Any = None

    @classmethod
    def from_request(cls, request: Any, block_ids: tuple[list[int], ...]) -> "NewRequestData":
        return cls(req_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids), mm_features=[],
                   sampling_params=request.sampling_params, pooling_params=request.pooling_params,
                   block_ids=block_ids, num_computed_tokens=request.num_computed_tokens,
                   lora_request=request.lora_request)


@dataclass
class CachedRequestData:
    req_ids: list[str]
    # True where the request resumes after preemption: new_block_ids then replaces its blocks.
    resumed_from_preemption: list[bool]
    # Sampled tokens the workers need (pipeline parallelism only; empty otherwise).
    new_token_ids: list[list[int]]
    # None where the request got no new blocks this step.
    new_block_ids: list[Optional[tuple[list[int], ...]]]
    num_computed_tokens: list[int]
    num_output_tokens: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> "CachedRequestData":
        return cls([], [], [], [], [], [])


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    scheduled_encoder_inputs: dict[str, list[int]]
    num_common_prefix_blocks: list[int]
    finished_req_ids: set[str]
    free_encoder_mm_hashes: list[str]
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None
    kv_connector_metadata: Any = None
