"""One connection to the node's kvrelay sidecar, reconnected by itself.

Every call either succeeds or raises KvrelayError; a failure other than a plain miss drops the
connection, and the next call reconnects, at most once per `retry_seconds`, so a dead sidecar
costs each lookup one failed connect (immediate on a Unix socket) and never a wait. Calls are
serialized by a lock, so a connector's lookup or load thread and vLLM's own thread share it.
"""

from __future__ import annotations

import ctypes
import functools
import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import _native as native


@dataclass
class SidecarCounters:
    connects: int = 0
    connect_failures: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    lookup_errors: int = 0
    loads: int = 0
    load_failures: int = 0
    publishes: int = 0
    publishes_dropped: int = 0
    prefill_reports: int = 0


class Entry:
    """A read-only entry the sidecar handed out, released on close()."""

    def __init__(self, lib: native.Library, handle: ctypes.c_void_p, meta: native.ResolvedPrefix,
                 lock: threading.RLock):
        self._lib = lib
        self._lock = lock
        self._handle = handle
        self.meta = meta
        layout = native.Layout()
        lib.lib.kvrelay_entry_layout(handle, ctypes.byref(layout))
        self.layout = layout
        self.address = int(lib.lib.kvrelay_entry_data(handle) or 0)
        self.size = int(lib.lib.kvrelay_entry_size(handle))

    def close(self) -> None:
        with self._lock:
            if self._handle:
                self._lib.lib.kvrelay_entry_release(self._handle)
                self._handle = None

    def __enter__(self) -> "Entry":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _locked(method):
    @functools.wraps(method)
    def call(self: "Sidecar", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return call


def params_text(params: Any) -> bytes:
    if params is None:
        return b""
    return json.dumps(params, separators=(",", ":")).encode("utf-8")


class Sidecar:
    def __init__(self, socket_path: str, lib: native.Library | None = None, retry_seconds: float = 1.0,
                 reply_timeout_ms: int = 0):
        self.socket_path = socket_path
        self.reply_timeout_ms = reply_timeout_ms  # 0: the library's default
        self.lib = lib or native.library()
        self.retry_seconds = retry_seconds
        self.counters = SidecarCounters()
        self._client = ctypes.c_void_p()
        self._next_attempt = 0.0
        self._lock = threading.RLock()
        self.before_close: list = []  # callables run before the connection (and its mappings) goes

    # -- connection ---------------------------------------------------------------------------
    def _connected(self) -> ctypes.c_void_p:
        if self._client:
            return self._client
        now = time.monotonic()
        if now < self._next_attempt:
            raise native.KvrelayError("connect", native.E_IO,
                                      f"sidecar {self.socket_path} unreachable; next try in "
                                      f"{self._next_attempt - now:.2f} s")
        options = native.sized(native.ClientOptions)
        options.reply_timeout_ms = self.reply_timeout_ms
        client = ctypes.c_void_p()
        code = self.lib.lib.kvrelay_client_connect_with_options(self.socket_path.encode(), ctypes.byref(options),
                                                                 ctypes.byref(client))
        if code != native.OK:
            self.counters.connect_failures += 1
            self._next_attempt = now + self.retry_seconds
            raise native.KvrelayError("kvrelay_client_connect", code, f"cannot connect to {self.socket_path}")
        self.counters.connects += 1
        self._client = client
        return client

    @_locked
    def close(self) -> None:
        if self._client:
            for hook in self.before_close:
                hook()
            self.lib.lib.kvrelay_client_close(self._client)
            self._client = ctypes.c_void_p()

    def _fail(self, call: str, code: int, keep: bool = False) -> native.KvrelayError:
        message = self.lib.lib.kvrelay_last_error(self._client) if self._client else b""
        error = native.KvrelayError(call, code, (message or b"").decode("utf-8", "replace"))
        if not keep:
            self.close()  # the connection's state is unknown: start afresh next time
        return error

    # -- calls --------------------------------------------------------------------------------
    @_locked
    def resolve(self, *, model_id: int, block_tokens: int, root: int, tokens, params: Any, timeout_ms: int,
                reserve: bool) -> tuple[native.ResolvedPrefix, Entry | None]:
        """The sidecar's decision for a prompt; raises KvrelayError(E_NOT_FOUND) on a miss."""
        client = self._connected()
        ids = native.token_array(tokens)
        request = native.sized(native.ResolveRequest)
        request.block_tokens = block_tokens
        request.model_id = model_id
        request.root = root
        request.tokens = ctypes.cast(ids, ctypes.POINTER(ctypes.c_uint32))
        request.count = len(ids)
        request.params_json = params_text(params)
        request.flags = native.RESOLVE_RESERVE if reserve else 0
        request.timeout_ms = timeout_ms
        answer = native.sized(native.Resolved)
        handle = ctypes.c_void_p()
        code = self.lib.lib.kvrelay_resolve(client, ctypes.byref(request), ctypes.byref(answer),
                                            None if reserve else ctypes.byref(handle))
        if code != native.OK:
            raise self._fail("kvrelay_resolve", code, keep=code == native.E_NOT_FOUND)
        meta = native.ResolvedPrefix.from_struct(answer)
        return meta, (None if reserve else Entry(self.lib, handle, meta, self._lock))

    @_locked
    def claim(self, reservation: int, timeout_ms: int) -> Entry:
        client = self._connected()
        answer = native.sized(native.Resolved)
        handle = ctypes.c_void_p()
        code = self.lib.lib.kvrelay_claim(client, reservation, timeout_ms, ctypes.byref(answer),
                                          ctypes.byref(handle))
        if code != native.OK:
            raise self._fail("kvrelay_claim", code, keep=code == native.E_NOT_FOUND)
        return Entry(self.lib, handle, native.ResolvedPrefix.from_struct(answer), self._lock)

    @_locked
    def release_reservation(self, reservation: int) -> None:
        client = self._connected()
        code = self.lib.lib.kvrelay_release_reservation(client, reservation)
        if code != native.OK:
            raise self._fail("kvrelay_release_reservation", code)

    @_locked
    def allocate(self, size: int) -> tuple[ctypes.c_void_p, int]:
        """A writable region of `size` bytes: (handle, address)."""
        client = self._connected()
        region = ctypes.c_void_p()
        code = self.lib.lib.kvrelay_region_alloc(client, size, ctypes.byref(region))
        if code != native.OK:
            raise self._fail("kvrelay_region_alloc", code)
        return region, int(self.lib.lib.kvrelay_region_data(region))

    @_locked
    def abort(self, region: ctypes.c_void_p) -> None:
        if self._client:
            self.lib.lib.kvrelay_region_abort(self._client, region)

    @_locked
    def commit(self, region: ctypes.c_void_p, *, model_id: int, block_tokens: int, root: int, tokens,
               prompt_tokens: int, params: Any, layout: native.Layout, lossy_from: int | None = None,
               lossy_codec: str = "") -> bool:
        """Commits a written region; False when the sidecar already holds that KV."""
        client = self._connected()
        ids = native.token_array(tokens)
        request = native.sized(native.PublishRequest)
        request.block_tokens = block_tokens
        request.model_id = model_id
        request.root = root
        request.tokens = ctypes.cast(ids, ctypes.POINTER(ctypes.c_uint32))
        request.count = len(ids)
        request.prompt_tokens = prompt_tokens
        request.params_json = params_text(params)
        fidelity = None
        if lossy_from is not None:
            fidelity = native.sized(native.Fidelity)
            fidelity.lossy = 1
            fidelity.exact_tokens = lossy_from
            fidelity.lossy_codec = lossy_codec.encode()[: native.FIDELITY_CODEC_BYTES - 1]
            request.fidelity = ctypes.pointer(fidelity)
        code = self.lib.lib.kvrelay_region_commit_request(client, region, ctypes.byref(request),
                                                          ctypes.byref(layout))
        if code == native.E_ALREADY_EXISTS:
            return False
        if code != native.OK:
            raise self._fail("kvrelay_region_commit_request", code)
        return True

    @_locked
    def report_prefill(self, *, model_id: int, computed_tokens: int, context_tokens: int, seconds: float,
                       params: Any) -> None:
        client = self._connected()
        report = native.sized(native.PrefillReport)
        report.model_id = model_id
        report.computed_tokens = computed_tokens
        report.context_tokens = context_tokens
        report.seconds = seconds
        report.params_json = params_text(params)
        code = self.lib.lib.kvrelay_report_prefill(client, ctypes.byref(report))
        if code != native.OK:
            raise self._fail("kvrelay_report_prefill", code)
