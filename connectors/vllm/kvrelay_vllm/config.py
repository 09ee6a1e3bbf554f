"""The connector's settings: vLLM's config plus kv_connector_extra_config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import _native as native

DEFAULT_SOCKET = "/run/kvrelay/kvrelay.sock"

_DTYPES = {"float32": native.DTYPE_FP32, "float16": native.DTYPE_FP16, "half": native.DTYPE_FP16,
           "bfloat16": native.DTYPE_BF16}
# vLLM's fp8 kv_cache_dtype names ("fp8" is e4m3, as on CUDA) and kvrelay's dtypes.
_FP8_CACHE_DTYPES = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
_FP8_DTYPES = {"fp8_e4m3": native.DTYPE_FP8_E4M3, "fp8_e5m2": native.DTYPE_FP8_E5M2}
_LAYOUTS = {"flash_attn": native.PAGED_FLASH_ATTN, "flashinfer": native.PAGED_FLASHINFER, "cpu": native.PAGED_CPU}
_KNOWN_KEYS = {"socket", "block_tokens", "weights", "architecture", "lookup_timeout_ms", "load_timeout_ms",
               "paged_layout", "publish", "retry_seconds", "copy", "async_lookup", "async_load",
               "reply_timeout_ms"}


class ConnectorConfigError(ValueError):
    """The connector cannot start with this configuration (the message says why)."""


def _dtype_name(dtype: Any) -> str:
    text = str(dtype)
    return text.removeprefix("torch.")


@dataclass(frozen=True)
class ConnectorConfig:
    socket: str
    block_tokens: int          # kvrelay block size; divides vLLM's block_size
    vllm_block_size: int
    layers: int
    kv_heads: int              # the whole model's
    head_dim: int
    dtype: int                 # native.DTYPE_*
    dtype_name: str
    architecture: str
    weights: str
    tp_rank: int
    tp_size: int
    lookup_timeout_ms: int
    load_timeout_ms: int
    reply_timeout_ms: int      # every other call's wait for the sidecar (connect, alloc, commit, reports)
    paged_layout: int | None   # forced native.PAGED_*; None: read from the tensors' shapes
    publish: bool
    retry_seconds: float
    copy: str                  # "auto", "torch" (torch indexing on host caches too), "bounce" (CUDA: never register)
    async_lookup: bool         # lookups on a background thread: vLLM is answered None until the sidecar decides
    async_load: bool           # loads on a background thread while vLLM runs other requests

    def model(self) -> native.Model:
        model = native.sized(native.Model)
        model.layers = self.layers
        model.kv_heads = self.kv_heads
        model.head_dim = self.head_dim
        model.dtype = self.dtype
        model.tp_rank = self.tp_rank
        model.tp_size = self.tp_size
        model.architecture = self.architecture.encode()
        model.weights = self.weights.encode()
        return model


def _positive_int(extra: dict, key: str, default: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConnectorConfigError(f"kv_connector_extra_config.{key} must be a positive integer, not {value!r}")
    return value


def from_vllm(vllm_config: Any) -> ConnectorConfig:
    """Reads vLLM's config; raises ConnectorConfigError naming what is wrong."""
    transfer = vllm_config.kv_transfer_config
    extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    unknown = sorted(set(extra) - _KNOWN_KEYS)
    if unknown:
        raise ConnectorConfigError(f"kv_connector_extra_config has unknown keys {unknown}; known: {sorted(_KNOWN_KEYS)}")
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    block_tokens = _positive_int(extra, "block_tokens", 16)
    vllm_block = int(cache.block_size)
    if vllm_block % block_tokens != 0:
        raise ConnectorConfigError(
            f"kvrelay's block_tokens ({block_tokens}) must divide vLLM's block_size ({vllm_block}): KV moves in "
            "whole kvrelay blocks into whole vLLM blocks; set kv_connector_extra_config.block_tokens to a divisor")
    cache_dtype = str(getattr(cache, "cache_dtype", "auto"))
    if cache_dtype.startswith("fp8"):
        # The KV's own dtype: its bytes move tagged, never converted (the sidecar offers no lossy
        # medium for them). The policy's agents[].model.dtype names it the same way.
        if cache_dtype not in _FP8_CACHE_DTYPES:
            raise ConnectorConfigError(f"kv_cache_dtype {cache_dtype} has no kvrelay dtype; known: "
                                       f"{sorted(_FP8_CACHE_DTYPES)}")
        dtype_name = _FP8_CACHE_DTYPES[cache_dtype]
        dtype = _FP8_DTYPES[dtype_name]
    elif cache_dtype not in ("auto", ""):
        raise ConnectorConfigError(f"kv_cache_dtype {cache_dtype} is not supported: use auto or an fp8 dtype")
    else:
        dtype_name = _dtype_name(model_config.dtype)
        if dtype_name not in _DTYPES:
            raise ConnectorConfigError(f"model dtype {dtype_name} has no kvrelay layout dtype (fp32, fp16, bf16)")
        dtype = _DTYPES[dtype_name]
    layout_name = extra.get("paged_layout")
    if layout_name is not None and layout_name not in _LAYOUTS:
        raise ConnectorConfigError(f"kv_connector_extra_config.paged_layout must be one of {sorted(_LAYOUTS)}")
    hf_config = getattr(model_config, "hf_config", None)
    architecture = extra.get("architecture") or getattr(hf_config, "model_type", None) or "llama"
    publish = extra.get("publish", True)
    if not isinstance(publish, bool):
        raise ConnectorConfigError("kv_connector_extra_config.publish must be true or false")
    copy = extra.get("copy", "auto")
    if copy not in ("auto", "torch", "bounce"):
        raise ConnectorConfigError('kv_connector_extra_config.copy must be "auto", "torch" or "bounce"')
    switches = {}
    for key in ("async_lookup", "async_load"):
        switches[key] = extra.get(key, False)
        if not isinstance(switches[key], bool):
            raise ConnectorConfigError(f"kv_connector_extra_config.{key} must be true or false")
    role = getattr(transfer, "kv_role", "kv_both")
    return ConnectorConfig(
        socket=str(extra.get("socket", DEFAULT_SOCKET)),
        block_tokens=block_tokens,
        vllm_block_size=vllm_block,
        layers=int(model_config.get_num_layers(parallel)),
        kv_heads=int(model_config.get_total_num_kv_heads()),
        head_dim=int(model_config.get_head_size()),
        dtype=dtype,
        dtype_name=dtype_name,
        architecture=str(architecture),
        weights=str(extra.get("weights") or model_config.model),
        tp_rank=int(getattr(parallel, "rank", 0)) % max(1, int(parallel.tensor_parallel_size)),
        tp_size=int(parallel.tensor_parallel_size),
        lookup_timeout_ms=_positive_int(extra, "lookup_timeout_ms", 250),
        load_timeout_ms=_positive_int(extra, "load_timeout_ms", 2000),
        reply_timeout_ms=_positive_int(extra, "reply_timeout_ms", 1000),
        paged_layout=_LAYOUTS[layout_name] if layout_name else None,
        publish=publish and role in ("kv_both", "kv_producer"),
        retry_seconds=float(extra.get("retry_seconds", 1.0)),
        copy=copy,
        async_lookup=switches["async_lookup"],
        async_load=switches["async_load"],
    )
