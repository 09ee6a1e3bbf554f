"""vllm.forward_context: what start_load_kv gets (the model runner sets it around each forward)."""

import contextlib
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ForwardContext:
    # Layer name -> the Attention module; a connector reads .kv_cache[virtual_engine] from it.
    no_compile_layers: dict[str, Any]
    # Layer name -> that layer's attention metadata (a dict in V1), or None in a dummy run.
    attn_metadata: Any
    virtual_engine: int = 0
    dp_metadata: Any = None
    cudagraph_runtime_mode: Any = None
    batch_descriptor: Any = None
    ubatch_slices: Any = None


_forward_context: Optional[ForwardContext] = None


def get_forward_context() -> ForwardContext:
    assert _forward_context is not None, "Forward context is not set."
    return _forward_context


@contextlib.contextmanager
def set_forward_context(context: ForwardContext):
    global _forward_context
    previous, _forward_context = _forward_context, context
    try:
        yield
    finally:
        _forward_context = previous
