"""vllm.distributed.kv_transfer.kv_connector.v1.base: KVConnectorBase_V1 as v0.11.2 declares it.

Scheduler side: get_num_new_matched_tokens (side-effect free, may be asked again),
update_state_after_alloc, build_connector_meta, update_connector_output, request_finished,
take_events. Worker side: bind/clear metadata, register_kv_caches, start_load_kv,
wait_for_layer_load, save_kv_layer, wait_for_save, get_finished, get_block_ids_with_load_errors.
"""

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional

import torch

from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

# (src tensors, dst tensors, src block ids, dst block ids, direction)
CopyBlocksOp = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], list[int], list[int],
                         Literal["h2d", "d2h"]], None]

logger = init_logger(__name__)


class SupportsHMA(ABC):
    """Marks a connector that works with the hybrid memory allocator (several KV cache groups)."""

    @abstractmethod
    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict[str, Any]]]:
        raise NotImplementedError


def supports_hma(connector: Any) -> bool:
    if isinstance(connector, type):
        return issubclass(connector, SupportsHMA)
    return isinstance(connector, SupportsHMA)


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0  # in the scheduler (engine core) process
    WORKER = 1     # in each worker process


class KVConnectorHandshakeMetadata(ABC):  # noqa: B024
    """Out-of-band handshake data between engines (serializable)."""


class KVConnectorMetadata(ABC):  # noqa: B024
    """What the scheduler-side connector passes to the worker-side one each step."""


class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: Optional["KVCacheConfig"] = None):
        logger.warning("Initializing KVConnectorBase_V1. This API is experimental and "
                       "subject to change in the future as we iterate the design.")
        self._connector_metadata: Optional[KVConnectorMetadata] = None
        self._vllm_config = vllm_config
        if vllm_config.kv_transfer_config is not None:
            self._kv_transfer_config = vllm_config.kv_transfer_config
        else:
            raise ValueError("kv_transfer_config must be set for KVConnectorBase_V1")
        self._kv_cache_config = kv_cache_config
        if self._kv_cache_config is None:
            logger.warning("KVConnectorBase_V1 initialized without kv_cache_config. "
                           "This is deprecated - please update your connector to pass kv_cache_config.")
        self._role = role

    @property
    def role(self) -> KVConnectorRole:
        return self._role

    # ---- worker side ----
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """The model runner calls this before each forward pass."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self) -> None:
        """The model runner calls this after each forward pass."""
        self._connector_metadata = None

    def _get_connector_metadata(self) -> KVConnectorMetadata:
        assert self._connector_metadata is not None
        return self._connector_metadata

    def has_connector_metadata(self) -> bool:
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        """Layer name -> that layer's paged KV cache tensor, once, before the first step."""
        return

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp):
        return

    @abstractmethod
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        """Start loading KV into the paged buffers (may be async) before the forward pass."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this layer's load is done (each attention layer calls it)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Start saving this layer's paged KV (each attention layer calls it after writing its KV)."""

    @abstractmethod
    def wait_for_save(self):
        """Block until every save of this step is done (the forward context's exit calls it)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """(ids whose async save/send finished, ids whose async load finished); None: none."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Block ids whose load failed; vLLM recomputes from the first of them."""
        return set()

    def shutdown(self):
        return None

    def get_kv_connector_stats(self) -> Any:
        return None

    def get_handshake_metadata(self) -> Optional[KVConnectorHandshakeMetadata]:
        return None

    # ---- scheduler side ----
    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """(external tokens beyond num_computed_tokens, load asynchronously?); (None, False): ask again later."""

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        """Called after the scheduler allocated blocks for a request it will schedule."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's metadata; the connector resets its per-step state here."""

    def update_connector_output(self, connector_output: KVConnectorOutput):
        return

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """(free the blocks later, after get_finished names the request?, kv_transfer_params for the output)."""
        return False, None

    def take_events(self) -> Iterable[Any]:
        return ()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        """"NHD" or "HND" when the connector needs one; None: the backend's own."""
        if cls is KVConnectorBase_V1:
            raise TypeError("get_required_kvcache_layout should not be called on the abstract base class")
        return None

    def get_finished_count(self) -> Optional[int]:
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None) -> Any:
        return None

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        return None
