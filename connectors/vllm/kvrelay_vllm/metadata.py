"""What the scheduler-side connector tells the worker-side ones for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class LoadSpec:
    """Import tokens [first_token, first_token + tokens) of a reserved prefix into block_ids."""

    request_id: str
    reservations: tuple[int, ...]  # one per TP rank: each claims its own shard's
    block_ids: tuple[int, ...]
    first_token: int
    tokens: int
    asynchronous: bool             # reported through get_finished, not before the forward pass


@dataclass(frozen=True)
class SaveSpec:
    """Publish the KV of `tokens` (the prompt's whole kvrelay blocks) from block_ids."""

    request_id: str
    tokens: tuple[int, ...]
    prompt_tokens: int
    block_ids: tuple[int, ...]
    params: Any
    root: int
    lossy_from: int | None       # provenance: a lossy imported prefix makes the KV lossy from here
    lossy_codec: str


@dataclass(frozen=True)
class PrefillSpec:
    """A prompt whose prefill ends this step, for the sidecar's cost model: computed_tokens of its
    context_tokens (the prompt) were computed, the rest came from a cache or an import."""

    request_id: str
    computed_tokens: int
    context_tokens: int
    params: Any


@dataclass
class KvRelayMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    prefills: list[PrefillSpec] = field(default_factory=list)
    # Requests vLLM finished while their asynchronous load ran: their blocks are freed once the
    # workers report them in finished_sending.
    delayed_frees: list[str] = field(default_factory=list)
