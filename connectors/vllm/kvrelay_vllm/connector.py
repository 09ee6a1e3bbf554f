"""KvRelayConnector: vLLM's V1 KV connector over the node's kvrelay sidecar.

Scheduler side: one reserving Resolve per request and TP rank (the sidecar's decision: medium,
peers, audit record), whose answer is cached, so get_num_new_matched_tokens stays side-effect
free however often vLLM asks; with async_lookup it runs on a background thread and vLLM is
answered None until it is back. Worker side: each rank claims its own shard's reservation and
scatters it into the blocks vLLM allocated, before the forward pass or, with async_load, on a
background thread reported through get_finished; after the prompt's prefill it gathers the
prompt's whole kvrelay blocks into a shared region and commits it with their token ids. Any
failure is a miss or a load error that vLLM recomputes, never wrong KV.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)

from . import _native as native
from . import config as connector_config
from .layouts import LAYOUT_NAMES, PagedCache, describe
from .torch_copy import TorchCopier, describe_mode
from .metadata import KvRelayMetadata, LoadSpec, PrefillSpec, SaveSpec
from .sidecar import Entry, Sidecar

logger = logging.getLogger("kvrelay_vllm")


def request_params(request: Any) -> Any:
    """kv_transfer_params.kvrelay of a request (what the front proxy signed), or None."""
    params = getattr(request, "kv_transfer_params", None)
    if isinstance(params, dict):
        return params.get("kvrelay")
    return None


def chain_root(params: Any) -> int:
    """Where the prompt's block-hash chain starts (the tenant's or cache salt's root)."""
    if isinstance(params, dict):
        text = params.get("chain_root")
        if isinstance(text, str) and len(text) == 16:
            try:
                return int(text, 16)
            except ValueError:
                pass
    return native.ROOT_BLOCK_HASH


@dataclass(frozen=True)
class _Hit:
    prefix: native.ResolvedPrefix  # rank 0's answer; tokens: what every rank's shard covers
    reservations: tuple[int, ...]  # one per TP rank


@dataclass
class _Lookup:
    hit: _Hit | None     # None: a miss
    local_computed: int  # vLLM's own prefix-cache hit when it asked


@dataclass
class _RequestState:
    prompt: tuple[int, ...]
    params: Any
    root: int
    lookup: _Lookup | None = None
    lookup_future: Future | None = None  # async_lookup: the resolve in flight
    pending_load: LoadSpec | None = None
    loading: bool = False                # an asynchronous load not yet reported finished
    block_ids: list[int] | None = None
    first_scheduled_computed: int | None = None
    imported_tokens: int = 0
    imported: native.ResolvedPrefix | None = None
    saved: bool = False
    published_tokens: int = 0


class KvRelayConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = connector_config.from_vllm(vllm_config)
        self._lib = native.library()
        cfg = self.config
        self.model_id = self._lib.model_id(cfg.model())
        self.shard_heads = self._lib.shard_heads(cfg.model())
        self.rank_model_ids = []
        for rank in range(max(1, cfg.tp_size)):
            shard = cfg.model()
            shard.tp_rank = rank
            self.rank_model_ids.append(self._lib.model_id(shard))
        self.rank0_model_id = self.rank_model_ids[0]
        self.sidecar = Sidecar(cfg.socket, self._lib, cfg.retry_seconds, cfg.reply_timeout_ms)
        # Scheduler side.
        self._states: dict[str, _RequestState] = {}
        self._delayed_frees: list[str] = []
        self._lookups: ThreadPoolExecutor | None = None
        if role == KVConnectorRole.SCHEDULER and cfg.async_lookup:
            self._lookups = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrelay-lookup")
        # Worker side.
        self._caches: dict[str, PagedCache] = {}
        self._layer_index: dict[str, int] = {}
        self._regions: dict[str, tuple[Any, int]] = {}
        self._load_errors: set[int] = set()
        self._errors_lock = threading.Lock()  # the load thread adds, vLLM's thread takes
        self._loader: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future] = {}
        self._free_when_loaded: set[str] = set()
        self._dropped: set[str] = set()  # publishes abandoned this step
        self._step_started = 0.0
        self.copy_mode = "native"
        self._torch_copier: TorchCopier | None = None
        logger.info("kvrelay connector (%s) for %s: model id %016x, rank %d/%d, block_tokens %d, socket %s",
                    role.name, cfg.weights, self.model_id, cfg.tp_rank, cfg.tp_size, cfg.block_tokens, cfg.socket)

    # ====================================================================================
    # Scheduler side
    # ====================================================================================
    def _state(self, request: Any) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            params = request_params(request)
            state = _RequestState(prompt=tuple(int(t) for t in request.prompt_token_ids), params=params,
                                  root=chain_root(params))
            self._states[request.request_id] = state
        return state

    def _resolve(self, prompt: tuple[int, ...], params: Any, root: int) -> _Hit | None:
        """Every TP rank's shard, reserved: a hit only when all of them are held."""
        cfg = self.config
        self.sidecar.counters.lookups += 1
        answers: list[native.ResolvedPrefix] = []
        deadline = time.monotonic() + cfg.lookup_timeout_ms / 1000.0  # one deadline for all the shards
        try:
            for model_id in self.rank_model_ids:
                left_ms = max(1, int((deadline - time.monotonic()) * 1000))
                prefix, _ = self.sidecar.resolve(model_id=model_id, block_tokens=cfg.block_tokens, root=root,
                                                 tokens=prompt, params=params, timeout_ms=left_ms, reserve=True)
                answers.append(prefix)
        except native.KvrelayError as error:
            self._release_reservations(tuple(a.reservation for a in answers))
            if error.code != native.E_NOT_FOUND:
                self.sidecar.counters.lookup_errors += 1
                logger.debug("kvrelay lookup failed (a miss for vLLM): %s", error)
            return None
        self.sidecar.counters.lookup_hits += 1
        common = replace(answers[0], tokens=min(a.tokens for a in answers),
                         lossy=any(a.lossy for a in answers),
                         exact_tokens=min(a.exact_tokens if a.lossy else a.tokens for a in answers))
        return _Hit(common, tuple(a.reservation for a in answers))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._state(request)
        if state.lookup is None:
            if self._lookups is None:
                state.lookup = _Lookup(self._lookup(state.prompt, state.params, state.root), num_computed_tokens)
            else:
                if state.lookup_future is None:
                    state.lookup_future = self._lookups.submit(self._lookup, state.prompt, state.params, state.root)
                if not state.lookup_future.done():
                    return None, False  # vLLM asks again next step; the request waits, nothing else does
                future, state.lookup_future = state.lookup_future, None
                state.lookup = _Lookup(future.result(), num_computed_tokens)
        state.lookup.local_computed = num_computed_tokens
        hit = state.lookup.hit
        if hit is None:
            return 0, False
        # Whole kvrelay blocks, short of the last prompt token (vLLM computes it for its logits).
        block = self.config.block_tokens
        usable = min(hit.prefix.tokens, len(state.prompt) - 1) // block * block
        if usable <= num_computed_tokens:
            return 0, False
        return usable - num_computed_tokens, self.config.async_load

    def _release_reservations(self, reservations: tuple[int, ...]) -> None:
        for reservation in reservations:
            if not reservation:
                continue
            try:
                self.sidecar.release_reservation(reservation)
            except native.KvrelayError as error:
                logger.debug("kvrelay reservation not released (it expires): %s", error)

    def _release(self, state: _RequestState) -> None:
        lookup = state.lookup
        state.lookup = None
        if lookup is not None and lookup.hit is not None:
            self._release_reservations(lookup.hit.reservations)
        future, state.lookup_future = state.lookup_future, None
        if future is not None:  # a lookup still in flight: release what it reserves once it lands
            future.add_done_callback(self._release_when_resolved)

    def _release_when_resolved(self, future: Future) -> None:
        hit = future.result()  # _lookup never raises
        if hit is not None:
            self._release_reservations(hit.reservations)

    def _lookup(self, prompt: tuple[int, ...], params: Any, root: int) -> _Hit | None:
        """_resolve, where any failure, a bug included, costs the hit and never vLLM's scheduler."""
        try:
            return self._resolve(prompt, params, root)
        except Exception as error:  # noqa: BLE001
            self.sidecar.counters.lookup_errors += 1
            logger.warning("kvrelay lookup raised (a miss for vLLM): %r", error)
            return None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._state(request)
        if num_external_tokens <= 0:
            if state.pending_load is None:
                self._release(state)  # nothing to load: give the sidecar its entry back now
            return
        lookup = state.lookup
        if lookup is None or lookup.hit is None:
            logger.warning("kvrelay: vLLM allocated %d external tokens for %s without a lookup",
                           num_external_tokens, request.request_id)
            return
        block_ids = tuple(int(b) for b in blocks.get_block_ids()[0])
        asynchronous = self.config.async_load
        state.pending_load = LoadSpec(request_id=request.request_id, reservations=lookup.hit.reservations,
                                      block_ids=block_ids, first_token=lookup.local_computed,
                                      tokens=num_external_tokens, asynchronous=asynchronous)
        state.imported_tokens = lookup.local_computed + num_external_tokens
        state.imported = lookup.hit.prefix
        state.loading = asynchronous
        state.block_ids = list(block_ids)  # where load errors land before the request is scheduled
        state.lookup = None  # claimed by the workers; a preempted request resolves again

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KvRelayMetadata(delayed_frees=self._delayed_frees)
        self._delayed_frees = []
        for state in self._states.values():
            if state.pending_load is not None:
                meta.loads.append(state.pending_load)
                state.pending_load = None
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = self._states.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [int(b) for b in new.block_ids[0]]
            state.first_scheduled_computed = int(new.num_computed_tokens)
            self._maybe_save(meta, new.req_id, state, int(new.num_computed_tokens) + int(scheduled[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        resumed_ids = getattr(cached, "resumed_req_ids", None)
        resumed_flags = getattr(cached, "resumed_from_preemption", None)
        for index, req_id in enumerate(cached.req_ids):
            state = self._states.get(req_id)
            if state is None:
                continue
            resumed = (req_id in resumed_ids) if resumed_ids is not None else bool(resumed_flags and
                                                                                   resumed_flags[index])
            new_blocks = cached.new_block_ids[index]
            if resumed:
                state.block_ids = [int(b) for b in new_blocks[0]] if new_blocks else []
                state.first_scheduled_computed = int(cached.num_computed_tokens[index])
            elif new_blocks:
                state.block_ids = (state.block_ids or []) + [int(b) for b in new_blocks[0]]
            done = int(cached.num_computed_tokens[index]) + int(scheduled[req_id])
            self._maybe_save(meta, req_id, state, done)
        return meta

    def _maybe_save(self, meta: KvRelayMetadata, req_id: str, state: _RequestState, done_tokens: int) -> None:
        prompt_tokens = len(state.prompt)
        if state.saved or done_tokens < prompt_tokens or state.block_ids is None:
            return
        state.saved = True
        computed_from = state.first_scheduled_computed or 0
        cached = min(max(computed_from, state.imported_tokens), prompt_tokens)
        meta.prefills.append(PrefillSpec(req_id, prompt_tokens - cached, prompt_tokens, state.params))
        if not self.config.publish:
            return
        full = prompt_tokens // self.config.block_tokens * self.config.block_tokens
        if full == 0 or (state.imported_tokens >= full and (state.imported is None or not state.imported.lossy)):
            return  # nothing this sidecar lacks
        blocks_needed = -(-full // self.config.vllm_block_size)
        if len(state.block_ids) < blocks_needed:
            return
        lossy_from = None
        codec = ""
        if state.imported is not None and state.imported.lossy:
            lossy_from = min(state.imported.exact_tokens, full)
            codec = state.imported.lossy_codec
        meta.saves.append(SaveSpec(req_id, state.prompt[:full], prompt_tokens, tuple(state.block_ids[:blocks_needed]),
                                   state.params, state.root, lossy_from, codec))
        state.published_tokens = full

    def update_connector_output(self, connector_output: Any) -> None:
        # Blocks a worker could not load are recomputed by vLLM: what the prompt then holds is
        # computed from the first failed block on, and its KV is saved once that recompute ends.
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            state = self._states.get(req_id)
            if state is not None:
                state.loading = False
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        block = self.config.vllm_block_size
        for state in self._states.values():
            if not state.block_ids:
                continue
            failed = [index for index, block_id in enumerate(state.block_ids) if block_id in invalid]
            if not failed:
                continue
            state.imported_tokens = min(state.imported_tokens, failed[0] * block)
            if state.imported_tokens == 0:
                state.imported = None
            state.saved = False
            state.published_tokens = 0

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        state = self._states.pop(request.request_id, None)
        if state is None:
            return False, None
        self._release(state)
        delay = state.loading  # the workers still write its blocks: vLLM frees them when they say
        if delay:
            self._delayed_frees.append(request.request_id)
        published = {"tokens": state.published_tokens, "block_tokens": self.config.block_tokens,
                     "model_id": f"{self.rank0_model_id:016x}", "chain_root": f"{state.root:016x}"}
        answer: dict[str, Any] = {"published": published, "imported_tokens": state.imported_tokens}
        if state.imported is not None:
            answer["imported_medium"] = state.imported.medium
        return delay, {"kvrelay": answer}

    # ====================================================================================
    # Worker side
    # ====================================================================================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        cfg = self.config
        self._caches = {}
        self._layer_index = {}
        for index, (name, tensor) in enumerate(kv_caches.items()):
            self._caches[name] = describe(tensor, cfg.vllm_block_size, self.shard_heads, cfg.head_dim,
                                          cfg.paged_layout)
            self._layer_index[name] = index
        if len(self._caches) != cfg.layers:
            raise ValueError(f"vLLM registered {len(self._caches)} KV cache layers; the model has {cfg.layers}")
        want = native.DTYPE_SIZES[cfg.dtype]
        for name, cache in self._caches.items():
            if cache.elem_size != want:
                raise ValueError(f"KV cache {name} has {cache.elem_size}-byte elements; {cfg.dtype_name} KV has {want}")
        # Host caches: the native gather/scatter. CUDA caches (or copy "torch"): torch indexing
        # on the cache's device through a pinned bounce buffer.
        self.copy_mode = describe_mode(kv_caches, cfg.copy)
        self._torch_copier = TorchCopier(register=cfg.copy != "bounce") if self.copy_mode != "native" else None
        if self._torch_copier is not None and self._torch_copier.registry is not None:
            self.sidecar.before_close.append(self._torch_copier.registry.forget)
        if cfg.async_load and self._loader is None:
            self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvrelay-load")
        logger.info("kvrelay connector: %d layers, %s layout, copy %s, %s loads", len(self._caches),
                    LAYOUT_NAMES[next(iter(self._caches.values())).layout], self.copy_mode,
                    "asynchronous" if self._loader else "synchronous")

    def _copy(self, scatter: bool, cache: PagedCache, block_ids: tuple[int, ...], first_token: int, tokens: int,
              k_address: int, v_address: int) -> None:
        if self._torch_copier is not None:
            self._torch_copier.copy(scatter, cache.tensor, cache.layout, self.config.vllm_block_size, list(block_ids),
                                    first_token, tokens, k_address, v_address)
            if self._torch_copier.mode != self.copy_mode:
                self.copy_mode = self._torch_copier.mode  # the first CUDA copy found out which path works
                logger.info("kvrelay connector: copies between the GPU and shared memory go %s", self.copy_mode)
            return
        ids = (native.ctypes.c_int32 * len(block_ids))(*block_ids)
        self._lib.paged_copy(scatter, cache.native_view, ids, first_token, tokens, k_address, v_address)

    def _row_bytes(self) -> int:
        first = next(iter(self._caches.values()))
        return self.shard_heads * self.config.head_dim * first.elem_size

    def _expect_layout(self, entry: Entry, need_tokens: int) -> None:
        layout = entry.layout
        cfg = self.config
        wanted = (cfg.layers, self.shard_heads, cfg.head_dim, cfg.dtype)
        found = (layout.layers, layout.kv_heads, layout.head_dim, layout.dtype)
        if found != wanted or layout.tokens < need_tokens:
            raise native.KvrelayError("load", native.E_LAYOUT_MISMATCH,
                                      f"entry has (layers, heads, head_dim, dtype) {found} and {layout.tokens} "
                                      f"tokens; this rank needs {wanted} and {need_tokens}")

    def _open_load(self, load: LoadSpec) -> Entry:
        cfg = self.config
        rank = cfg.tp_rank if cfg.tp_size > 1 else 0
        if rank >= len(load.reservations):
            raise native.KvrelayError("load", native.E_INVALID_ARGUMENT,
                                      f"the scheduler reserved {len(load.reservations)} shards; this is rank {rank}")
        return self.sidecar.claim(load.reservations[rank], cfg.load_timeout_ms)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._step_started = time.perf_counter()
        self._dropped.clear()
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvRelayMetadata):
            return
        self._free_when_loaded.update(meta.delayed_frees)
        for load in meta.loads:
            if load.asynchronous and self._loader is not None:
                self._inflight[load.request_id] = self._loader.submit(self._load, load)
            else:
                self._load(load)

    def _load(self, load: LoadSpec) -> None:
        counters = self.sidecar.counters
        counters.loads += 1
        end = load.first_token + load.tokens
        try:
            with self._open_load(load) as entry:
                self._expect_layout(entry, end)
                row = self._row_bytes()
                stride = entry.layout.tokens * row
                for name, cache in self._caches.items():
                    layer = self._layer_index[name]
                    k = entry.address + 2 * layer * stride + load.first_token * row
                    self._copy(True, cache, load.block_ids, load.first_token, load.tokens, k, k + stride)
        except Exception as error:  # noqa: BLE001 - any failure is a load error vLLM recomputes
            counters.load_failures += 1
            if not load.asynchronous:
                self._dropped.add(load.request_id)  # its blocks hold no KV worth publishing this step
            block = self.config.vllm_block_size
            failed = load.block_ids[load.first_token // block: -(-end // block)]
            with self._errors_lock:
                self._load_errors.update(failed)
            logger.warning("kvrelay load of %s failed; vLLM recomputes %d blocks: %s", load.request_id,
                           len(failed), error)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads end in start_load_kv; asynchronous ones belong to unscheduled requests

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvRelayMetadata) or not meta.saves:
            return
        cache = self._caches.get(layer_name)
        if cache is None:
            return
        layer = self._layer_index[layer_name]
        row = self._row_bytes()
        for save in meta.saves:
            if save.request_id in self._dropped:
                continue
            tokens = len(save.tokens)
            stride = tokens * row
            region = self._regions.get(save.request_id)
            try:
                if region is None:
                    region = self.sidecar.allocate(self.config.layers * 2 * stride)
                    self._regions[save.request_id] = region
                k = region[1] + 2 * layer * stride
                self._copy(False, cache, save.block_ids, 0, tokens, k, k + stride)
            except native.KvrelayError as error:
                self._drop(save.request_id, error)

    def _drop(self, request_id: str, error: Exception) -> None:
        region = self._regions.pop(request_id, None)
        if region is not None:
            self.sidecar.abort(region[0])
        self.sidecar.counters.publishes_dropped += 1
        self._dropped.add(request_id)
        logger.warning("kvrelay publish of %s dropped: %s", request_id, error)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvRelayMetadata):
            return
        cfg = self.config
        for save in meta.saves:
            region = self._regions.pop(save.request_id, None)
            if region is None:
                continue
            if save.request_id in self._dropped:
                self.sidecar.abort(region[0])
                continue
            layout = native.Layout(layers=cfg.layers, kv_heads=self.shard_heads, head_dim=cfg.head_dim,
                                   dtype=cfg.dtype, tokens=len(save.tokens))
            try:
                self.sidecar.commit(region[0], model_id=self.model_id, block_tokens=cfg.block_tokens,
                                    root=save.root, tokens=save.tokens, prompt_tokens=save.prompt_tokens,
                                    params=save.params, layout=layout, lossy_from=save.lossy_from,
                                    lossy_codec=save.lossy_codec)
                self.sidecar.counters.publishes += 1
            except native.KvrelayError as error:
                self.sidecar.counters.publishes_dropped += 1
                logger.warning("kvrelay publish of %s dropped: %s", save.request_id, error)
        if meta.prefills and (cfg.tp_size <= 1 or cfg.tp_rank == 0):
            self._report_prefills(meta.prefills, time.perf_counter() - self._step_started)

    def _report_prefills(self, prefills: list[PrefillSpec], seconds: float) -> None:
        # One forward pass ran them all: each is charged its share of the step by computed tokens.
        total = sum(p.computed_tokens for p in prefills) or 1
        for prefill in prefills:
            try:
                self.sidecar.report_prefill(model_id=self.model_id, computed_tokens=prefill.computed_tokens,
                                            context_tokens=prefill.context_tokens,
                                            seconds=seconds * prefill.computed_tokens / total, params=prefill.params)
                self.sidecar.counters.prefill_reports += 1
            except native.KvrelayError as error:
                logger.debug("kvrelay prefill report not delivered: %s", error)
                return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Saves complete within the step; asynchronous loads are reported once done (their load
        # errors are already recorded for get_block_ids_with_load_errors, which vLLM asks next).
        recving = {req_id for req_id, future in self._inflight.items() if future.done()}
        for req_id in recving:
            del self._inflight[req_id]
        sending = {req_id for req_id in self._free_when_loaded if req_id not in self._inflight}
        self._free_when_loaded -= sending
        recving -= sending  # finished while loading: vLLM only frees its blocks
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._errors_lock:
            failed, self._load_errors = self._load_errors, set()
        return failed

    def shutdown(self) -> None:
        for pool in (self._lookups, self._loader):
            if pool is not None:
                pool.shutdown(wait=True)
        for region, _ in self._regions.values():
            self.sidecar.abort(region)
        self._regions.clear()
        self.sidecar.close()
