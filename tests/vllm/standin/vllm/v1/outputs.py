"""vllm.v1.outputs.KVConnectorOutput: what the worker's connector reports back each step."""

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class KVConnectorOutput:
    finished_sending: Optional[set[str]] = None
    finished_recving: Optional[set[str]] = None
    kv_connector_stats: Any = None
    invalid_block_ids: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return (not self.finished_sending and not self.finished_recving and not self.kv_connector_stats
                and not self.invalid_block_ids)
