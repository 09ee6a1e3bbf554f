"""vllm.v1.request: Request and RequestStatus, the fields a connector reads."""

import enum
from typing import Any, Optional


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


class SamplingParams:
    """vllm.SamplingParams, reduced to what the connector path reads."""

    def __init__(self, max_tokens: int = 16, seed: Optional[int] = None,
                 extra_args: Optional[dict[str, Any]] = None) -> None:
        self.max_tokens = max_tokens
        self.seed = seed
        self.extra_args = extra_args


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: Optional[SamplingParams],
                 pooling_params: Any = None, eos_token_id: Optional[int] = None, client_index: int = 0,
                 arrival_time: float = 0.0, lora_request: Any = None, cache_salt: Optional[str] = None,
                 priority: int = 0, kv_transfer_params: Optional[dict[str, Any]] = None) -> None:
        self.request_id = request_id
        self.client_index = client_index
        self.priority = priority
        self.sampling_params = sampling_params
        self.pooling_params = pooling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.lora_request = lora_request
        self.status = RequestStatus.WAITING
        self.stop_reason: Any = None
        # vLLM copies sampling_params.extra_args["kv_transfer_params"] here.
        if kv_transfer_params is None and sampling_params is not None and sampling_params.extra_args:
            kv_transfer_params = sampling_params.extra_args.get("kv_transfer_params")
        self.kv_transfer_params = kv_transfer_params
        self.max_tokens = sampling_params.max_tokens if sampling_params is not None else 1
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._output_token_ids)  # vLLM hands out a read-only ConstantList

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        return tuple(self._all_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        self._output_token_ids.extend(ids)
        self._all_token_ids.extend(ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)
