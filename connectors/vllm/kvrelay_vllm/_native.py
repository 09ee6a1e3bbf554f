"""ctypes bindings of libkvrelay_client.so (C ABI 6: kvrelay_client.h and kvrelay_paged.h).

Only the calls the connector makes are bound. Struct layouts mirror the C headers field for
field; every struct that starts with struct_size gets it set here, so a library of another ABI
refuses the call with an error that names the struct instead of reading garbage.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass

MIN_ABI_VERSION = 6
MIN_PAGED_ABI_VERSION = 1

# kvrelay::ErrorCode numbers (kvrelay_client.h).
OK = 0
E_INVALID_ARGUMENT = 1
E_OUT_OF_RANGE = 3
E_LAYOUT_MISMATCH = 8
E_NOT_FOUND = 11
E_ALREADY_EXISTS = 12
E_TIMEOUT = 15
E_IO = 16

ROOT_BLOCK_HASH = 0x6B7672656C6179
RESOLVE_RESERVE = 1
MEDIUM_BYTES = 32
FIDELITY_CODEC_BYTES = 64

DTYPE_FP32 = 1
DTYPE_FP16 = 2
DTYPE_BF16 = 3
DTYPE_FP8_E4M3 = 4  # C ABI 6: fp8 KV moved as tagged bytes, never converted
DTYPE_FP8_E5M2 = 5
DTYPE_SIZES = {DTYPE_FP32: 4, DTYPE_FP16: 2, DTYPE_BF16: 2, DTYPE_FP8_E4M3: 1, DTYPE_FP8_E5M2: 1}

PAGED_FLASH_ATTN = 1
PAGED_FLASHINFER = 2
PAGED_CPU = 3


class KvrelayError(RuntimeError):
    """A failed C call: its code and the library's message."""

    def __init__(self, call: str, code: int, message: str):
        super().__init__(f"{call}: code {code}: {message}")
        self.call = call
        self.code = code
        self.message = message


class Key(ctypes.Structure):
    _fields_ = [("model_id", ctypes.c_uint64), ("context_hash", ctypes.c_uint64)]


class Layout(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.c_uint32),
        ("kv_heads", ctypes.c_uint32),
        ("head_dim", ctypes.c_uint32),
        ("dtype", ctypes.c_uint32),
        ("tokens", ctypes.c_uint64),
    ]


class Fidelity(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("lossy", ctypes.c_uint32),
        ("exact_tokens", ctypes.c_uint64),
        ("lossy_codec", ctypes.c_char * FIDELITY_CODEC_BYTES),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("layers", ctypes.c_uint32),
        ("kv_heads", ctypes.c_uint32),
        ("head_dim", ctypes.c_uint32),
        ("dtype", ctypes.c_uint32),
        ("tp_rank", ctypes.c_uint32),
        ("tp_size", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("architecture", ctypes.c_char_p),
        ("weights", ctypes.c_char_p),
    ]


class ResolveRequest(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("block_tokens", ctypes.c_uint32),
        ("model_id", ctypes.c_uint64),
        ("root", ctypes.c_uint64),
        ("tokens", ctypes.POINTER(ctypes.c_uint32)),
        ("count", ctypes.c_uint64),
        ("params_json", ctypes.c_char_p),
        ("flags", ctypes.c_uint32),
        ("timeout_ms", ctypes.c_uint32),
    ]


class Resolved(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("tokens", ctypes.c_uint64),
        ("reservation", ctypes.c_uint64),
        ("medium", ctypes.c_char * MEDIUM_BYTES),
        ("fidelity", Fidelity),
    ]


class PublishRequest(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("block_tokens", ctypes.c_uint32),
        ("model_id", ctypes.c_uint64),
        ("root", ctypes.c_uint64),
        ("tokens", ctypes.POINTER(ctypes.c_uint32)),
        ("count", ctypes.c_uint64),
        ("prompt_tokens", ctypes.c_uint64),
        ("params_json", ctypes.c_char_p),
        ("fidelity", ctypes.POINTER(Fidelity)),
    ]


class PrefillReport(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("model_id", ctypes.c_uint64),
        ("computed_tokens", ctypes.c_uint64),
        ("context_tokens", ctypes.c_uint64),
        ("seconds", ctypes.c_double),
        ("params_json", ctypes.c_char_p),
    ]


class PagedTensor(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("layout", ctypes.c_uint32),
        ("elem_size", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("data", ctypes.c_void_p),
        ("shape", ctypes.c_int64 * 5),
        ("strides", ctypes.c_int64 * 5),
    ]


class ClientOptions(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("memory_strategy", ctypes.c_uint32),
                ("reply_timeout_ms", ctypes.c_uint32)]  # ABI 6


def sized(struct_type):
    """A zeroed struct with its struct_size set."""
    value = struct_type()
    value.struct_size = ctypes.sizeof(struct_type)
    return value


def token_array(tokens) -> ctypes.Array:
    ids = list(tokens)
    return (ctypes.c_uint32 * len(ids))(*ids)


@dataclass(frozen=True)
class ResolvedPrefix:
    tokens: int
    reservation: int
    medium: str
    lossy: bool
    exact_tokens: int
    lossy_codec: str

    @staticmethod
    def from_struct(value: Resolved) -> "ResolvedPrefix":
        return ResolvedPrefix(
            tokens=int(value.tokens),
            reservation=int(value.reservation),
            medium=value.medium.decode("utf-8", "replace"),
            lossy=bool(value.fidelity.lossy),
            exact_tokens=int(value.fidelity.exact_tokens),
            lossy_codec=value.fidelity.lossy_codec.decode("utf-8", "replace"),
        )


def _library_path() -> str:
    explicit = os.environ.get("KVRELAY_CLIENT_LIB")
    if explicit:
        return explicit
    found = ctypes.util.find_library("kvrelay_client")
    if found:
        return found
    return "libkvrelay_client.so"


class Library:
    """The loaded client library with its prototypes declared."""

    def __init__(self, path: str | None = None):
        self.path = path or _library_path()
        lib = ctypes.CDLL(self.path)
        self.lib = lib
        vp, u32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
        proto = {
            "kvrelay_abi_version": (ctypes.c_int, []),
            "kvrelay_client_connect_with_options": (
                ctypes.c_int,
                [ctypes.c_char_p, ctypes.POINTER(ClientOptions), ctypes.POINTER(vp)],
            ),
            "kvrelay_client_close": (None, [vp]),
            "kvrelay_last_error": (ctypes.c_char_p, [vp]),
            "kvrelay_model_id": (ctypes.c_int, [ctypes.POINTER(Model), ctypes.POINTER(u64)]),
            "kvrelay_model_shard_heads": (ctypes.c_int, [ctypes.POINTER(Model), ctypes.POINTER(u32)]),
            "kvrelay_resolve": (
                ctypes.c_int,
                [vp, ctypes.POINTER(ResolveRequest), ctypes.POINTER(Resolved), ctypes.POINTER(vp)],
            ),
            "kvrelay_claim": (ctypes.c_int, [vp, u64, u32, ctypes.POINTER(Resolved), ctypes.POINTER(vp)]),
            "kvrelay_release_reservation": (ctypes.c_int, [vp, u64]),
            "kvrelay_region_alloc": (ctypes.c_int, [vp, u64, ctypes.POINTER(vp)]),
            "kvrelay_region_data": (vp, [vp]),
            "kvrelay_region_abort": (ctypes.c_int, [vp, vp]),
            "kvrelay_region_commit_request": (
                ctypes.c_int,
                [vp, vp, ctypes.POINTER(PublishRequest), ctypes.POINTER(Layout)],
            ),
            "kvrelay_report_prefill": (ctypes.c_int, [vp, ctypes.POINTER(PrefillReport)]),
            "kvrelay_entry_data": (vp, [vp]),
            "kvrelay_entry_size": (u64, [vp]),
            "kvrelay_entry_layout": (None, [vp, ctypes.POINTER(Layout)]),
            "kvrelay_entry_release": (None, [vp]),
            "kvrelay_release_leases": (ctypes.c_int, [vp]),
            "kvrelay_paged_abi_version": (ctypes.c_int, []),
            "kvrelay_paged_last_error": (ctypes.c_char_p, []),
            "kvrelay_paged_gather": (
                ctypes.c_int,
                [ctypes.POINTER(PagedTensor), ctypes.POINTER(ctypes.c_int32), u64, u64, u64, vp, vp],
            ),
            "kvrelay_paged_scatter": (
                ctypes.c_int,
                [ctypes.POINTER(PagedTensor), ctypes.POINTER(ctypes.c_int32), u64, u64, u64, vp, vp],
            ),
        }
        for name, (restype, argtypes) in proto.items():
            try:
                function = getattr(lib, name)
            except AttributeError as missing:
                raise KvrelayError(name, E_INVALID_ARGUMENT,
                                   f"{self.path} has no {name}: it is older than C ABI {MIN_ABI_VERSION}") from missing
            function.restype = restype
            function.argtypes = argtypes
        abi = lib.kvrelay_abi_version()
        if abi < MIN_ABI_VERSION:
            raise KvrelayError("kvrelay_abi_version", E_INVALID_ARGUMENT,
                               f"{self.path} has C ABI {abi}; kvrelay_vllm needs {MIN_ABI_VERSION} or later")
        paged = lib.kvrelay_paged_abi_version()
        if paged < MIN_PAGED_ABI_VERSION:
            raise KvrelayError("kvrelay_paged_abi_version", E_INVALID_ARGUMENT,
                               f"{self.path} has paged ABI {paged}; kvrelay_vllm needs {MIN_PAGED_ABI_VERSION}")
        self.abi_version = abi

    def model_id(self, model: Model) -> int:
        out = ctypes.c_uint64()
        code = self.lib.kvrelay_model_id(ctypes.byref(model), ctypes.byref(out))
        if code != OK:
            raise KvrelayError("kvrelay_model_id", code, "invalid model (see the connector's config)")
        return int(out.value)

    def shard_heads(self, model: Model) -> int:
        out = ctypes.c_uint32()
        code = self.lib.kvrelay_model_shard_heads(ctypes.byref(model), ctypes.byref(out))
        if code != OK:
            raise KvrelayError("kvrelay_model_shard_heads", code, "invalid tensor-parallel shape")
        return int(out.value)

    def paged_error(self) -> str:
        message = self.lib.kvrelay_paged_last_error()
        return message.decode("utf-8", "replace") if message else ""

    def paged_copy(self, scatter: bool, tensor: PagedTensor, block_ids: ctypes.Array, first_token: int,
                   tokens: int, k_address: int, v_address: int) -> None:
        call = self.lib.kvrelay_paged_scatter if scatter else self.lib.kvrelay_paged_gather
        code = call(ctypes.byref(tensor), block_ids, len(block_ids), first_token, tokens, k_address, v_address)
        if code != OK:
            name = "kvrelay_paged_scatter" if scatter else "kvrelay_paged_gather"
            raise KvrelayError(name, code, self.paged_error())


_loaded: Library | None = None


def library() -> Library:
    """The process's one Library (loaded on first use)."""
    global _loaded
    if _loaded is None:
        _loaded = Library()
    return _loaded
