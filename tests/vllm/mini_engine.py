"""A small engine that replays vLLM v0.11.2's connector call order (Scheduler.schedule /
update_from_output, the GPU model runner's KV-connector hooks) with real paged torch caches
and a deterministic "model", so a connector's loads can be checked bit for bit.
"""

from __future__ import annotations

import os
import random
import time
import sys
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin"))

import torch  # noqa: E402

from vllm.config import (CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig,  # noqa: E402
                         SchedulerConfig, VllmConfig)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.forward_context import ForwardContext, set_forward_context  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlock, KVCacheBlocks  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,  # noqa: E402
                                        KVCacheTensor)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus, SamplingParams  # noqa: E402

LAYOUTS = ("flash_attn", "flashinfer", "cpu")
_MASK = (1 << 61) - 1


def prefix_hashes(tokens: list[int]) -> list[int]:
    """Running hash of the prefix up to and including each token."""
    out, h = [], 0x9E3779B97F4A7C15 & _MASK
    for token in tokens:
        h = ((h * 1000003) ^ (int(token) + 0x5BD1E995)) & _MASK
        out.append(h)
    return out


@dataclass
class RequestResult:
    request_id: str
    prompt_tokens: int
    output_token_ids: list[int]
    loaded_tokens: int = 0         # external tokens the connector supplied (sum over allocations)
    computed_tokens: int = 0       # tokens the engine ran through the model (prefill chunks, decode, recompute)
    recomputed_tokens: int = 0     # tokens rolled back after load errors and computed again
    load_error_blocks: int = 0
    kv_ok: bool = False            # paged KV of every prompt token equals expected_kv (torch.equal)
    mismatched_tokens: list[int] = field(default_factory=list)
    kv_transfer_params: Optional[dict[str, Any]] = None
    preemptions: int = 0
    none_answers: int = 0          # times get_num_new_matched_tokens answered (None, False)
    delayed_free: bool = False     # request_finished asked vLLM to keep its blocks for a while
    finish_status: Optional[RequestStatus] = None


class _State:
    def __init__(self, request: Request, result: RequestResult) -> None:
        self.request = request
        self.result = result
        self.block_ids: list[int] = []
        self.resumed = False       # scheduled next as a resumed (preempted) request
        self.new_block_ids: list[int] = []
        self.loading_until = 0     # WAITING_FOR_REMOTE_KVS: computed tokens once the load lands


class MiniEngine:
    def __init__(self, connector: Optional[type] = None, *, kv_transfer_config: Optional[KVTransferConfig] = None,
                 extra_config: Optional[dict[str, Any]] = None, layers: int = 4, kv_heads: int = 4,
                 head_size: int = 32, dtype: torch.dtype = torch.float16, block_size: int = 16,
                 num_blocks: int = 64, layout: str = "flash_attn", tp_size: int = 1, tp_rank: int = 0,
                 max_tokens_per_step: Optional[int] = None, seed: int = 0, model: str = "standin/tiny-llama",
                 kv_role: str = "kv_both", device: str = "cpu", cache_dtype: str = "auto") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}")
        if kv_transfer_config is None:
            if connector is None:
                raise ValueError("give a connector class or a kv_transfer_config")
            kv_transfer_config = KVTransferConfig(kv_connector=connector.__name__,
                                                  kv_connector_module_path=connector.__module__, kv_role=kv_role,
                                                  kv_connector_extra_config=dict(extra_config or {}))
        self.layout = layout
        self.block_size = block_size
        self.num_blocks = num_blocks
        # The KV caches' element type: the model's, or bytes for an fp8 kv_cache_dtype (vLLM
        # allocates fp8 caches as uint8, STR_DTYPE_TO_TORCH_DTYPE).
        self.dtype = torch.uint8 if cache_dtype.startswith("fp8") else dtype
        self.max_tokens_per_step = max_tokens_per_step
        self.rng = random.Random(seed)
        model_config = ModelConfig(model=model, dtype=dtype, num_hidden_layers=layers, num_key_value_heads=kv_heads,
                                   head_dim=head_size)
        parallel = ParallelConfig(tensor_parallel_size=tp_size, rank=tp_rank)
        self.vllm_config = VllmConfig(model_config=model_config,
                                      cache_config=CacheConfig(block_size=block_size, cache_dtype=cache_dtype,
                                                               enable_prefix_caching=False,
                                                               num_gpu_blocks=num_blocks),
                                      parallel_config=parallel, scheduler_config=SchedulerConfig(),
                                      kv_transfer_config=kv_transfer_config)
        self.layers = layers
        self.heads = model_config.get_num_kv_heads(parallel)
        # This rank's first KV head: a shard of heads, or one replicated head when kv_heads < tp_size.
        self.head_offset = (tp_rank * self.heads if kv_heads >= tp_size
                            else tp_rank // (tp_size // kv_heads))
        self.head_size = head_size
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        self.caches = {name: torch.zeros(self._shape(), dtype=self.dtype, device=device) for name in self.layer_names}
        page = FullAttentionSpec(block_size=block_size, num_kv_heads=self.heads, head_size=head_size,
                                 dtype=self.dtype)
        self.kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(size=page.page_size_bytes * num_blocks, shared_by=[n])
                              for n in self.layer_names],
            kv_cache_groups=[KVCacheGroupSpec(layer_names=list(self.layer_names), kv_cache_spec=page)])
        # Two instances, as vLLM's engine-core and worker processes each build one.
        self.scheduler_connector = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.SCHEDULER,
                                                                       self.kv_cache_config)
        self.worker_connector = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                                    self.kv_cache_config)
        self.worker_connector.register_kv_caches(dict(self.caches))
        self.free_blocks: deque[int] = deque(range(1, num_blocks))  # block 0 is vLLM's null block
        self.waiting: deque[_State] = deque()
        self.running: list[_State] = []
        self.states: dict[str, _State] = {}
        self.results: dict[str, RequestResult] = {}
        self.pending_free: dict[str, _State] = {}   # request_finished said True: freed when get_finished names it
        self.finished_recving: set[str] = set()
        self.finished_req_ids: set[str] = set()
        self.steps = 0
        self.max_new_tokens: dict[str, int] = {}

    # ---- the "model" ----
    def _shape(self) -> tuple[int, ...]:
        b, n, h, d = self.block_size, self.num_blocks, self.heads, self.head_size
        return {"flash_attn": (2, n, b, h, d), "flashinfer": (n, 2, b, h, d), "cpu": (2, n, h, b, d)}[self.layout]

    def _token_kv(self, layer: int, kv: int, prefix_hash: int) -> torch.Tensor:
        # Integers/64 in [-125/64, 125/64]: exact in fp32, fp16 and bf16.
        base = (prefix_hash % 65521) + layer * 7919 + kv * 104729 + self.head_offset * self.head_size
        values = (torch.arange(self.heads * self.head_size, dtype=torch.int64) + base) % 251 - 125
        if self.dtype == torch.uint8:  # fp8 bit patterns: every byte value is a distinct element
            return (values + 125).to(torch.uint8).reshape(self.heads, self.head_size)
        return (values.to(torch.float32) / 64).reshape(self.heads, self.head_size).to(self.dtype)

    def expected_kv(self, tokens: list[int]) -> torch.Tensor:
        """(layers, 2, len(tokens), heads, head_size): the KV this rank's model computes for tokens."""
        hashes = prefix_hashes(tokens)
        out = torch.empty((self.layers, 2, len(tokens), self.heads, self.head_size), dtype=self.dtype)
        for layer in range(self.layers):
            for kv in range(2):
                for pos, h in enumerate(hashes):
                    out[layer, kv, pos] = self._token_kv(layer, kv, h)
        return out

    def _slot(self, cache: torch.Tensor, kv: int, block: int, offset: int) -> torch.Tensor:
        if self.layout == "flash_attn":
            return cache[kv, block, offset]
        if self.layout == "flashinfer":
            return cache[block, kv, offset]
        return cache[kv, block, :, offset]

    def paged_kv(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """What the paged caches hold for the first num_tokens tokens of a block list."""
        out = torch.empty((self.layers, 2, num_tokens, self.heads, self.head_size), dtype=self.dtype)
        for layer, name in enumerate(self.layer_names):
            for kv in range(2):
                for pos in range(num_tokens):
                    out[layer, kv, pos] = self._slot(self.caches[name], kv, block_ids[pos // self.block_size],
                                                     pos % self.block_size)
        return out

    # ---- requests ----
    def add_request(self, request_id: str, prompt_token_ids: list[int], max_new_tokens: int = 4,
                    kv_transfer_params: Optional[dict[str, Any]] = None) -> Request:
        request = Request(request_id, prompt_token_ids, SamplingParams(max_tokens=max_new_tokens),
                          kv_transfer_params=kv_transfer_params)
        state = _State(request, RequestResult(request_id, len(prompt_token_ids), []))
        self.states[request_id] = state
        self.results[request_id] = state.result
        self.waiting.append(state)
        return request

    def _allocate(self, state: _State, total_tokens: int) -> bool:
        need = -(-total_tokens // self.block_size) - len(state.block_ids)
        if need <= 0:
            return True
        if need > len(self.free_blocks):
            return False
        new = [self.free_blocks.popleft() for _ in range(need)]
        state.block_ids.extend(new)
        state.new_block_ids.extend(new)
        return True

    def _free(self, state: _State) -> None:
        self.free_blocks.extend(state.block_ids)
        state.block_ids = []
        state.new_block_ids = []

    def preempt(self, request_id: str) -> None:
        """As the scheduler does when it runs out of blocks: free them, start over later."""
        state = self.states[request_id]
        if state in self.running:
            self.running.remove(state)
        elif state in self.waiting:
            self.waiting.remove(state)
        self._free(state)
        state.request.status = RequestStatus.PREEMPTED
        state.request.num_computed_tokens = 0
        state.request.num_preemptions += 1
        state.result.preemptions += 1
        state.resumed = True
        self.waiting.appendleft(state)

    def abort(self, request_id: str) -> None:
        """As vLLM's finish_requests(FINISHED_ABORTED) for a waiting or running request: the
        connector's request_finished decides whether its blocks are freed now or once the
        workers name it in finished_sending."""
        state = self.states[request_id]
        if state in self.running:
            self.running.remove(state)
        elif state in self.waiting:
            self.waiting.remove(state)
        else:
            return
        req = state.request
        req.status = RequestStatus.FINISHED_ABORTED
        state.result.finish_status = req.status
        delay, params = self.scheduler_connector.request_finished(req, list(state.block_ids))
        state.result.kv_transfer_params = params
        state.result.delayed_free = bool(delay)
        self.finished_req_ids.add(request_id)
        if delay:
            self.pending_free[request_id] = state
        else:
            self._free(state)

    def _blocks(self, ids: list[int]) -> KVCacheBlocks:
        return KVCacheBlocks((([KVCacheBlock(block_id=i) for i in ids]),))

    # ---- one step ----
    def _schedule(self) -> tuple[SchedulerOutput, dict[str, int]]:
        budget = self.max_tokens_per_step or (1 << 30)
        scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached = CachedRequestData.make_empty()
        for state in list(self.running):
            req = state.request
            if state not in self.running:
                continue  # preempted below to make room
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            while not self._allocate(state, req.num_computed_tokens + num_new):
                victim = self.running[-1]
                self.preempt(victim.request.request_id)
                if victim is state:
                    break
            if state not in self.running:
                continue
            scheduled[req.request_id] = num_new
            budget -= num_new
            cached.req_ids.append(req.request_id)
            cached.resumed_from_preemption.append(False)
            cached.new_token_ids.append([])
            cached.new_block_ids.append((list(state.new_block_ids),) if state.new_block_ids else None)
            cached.num_computed_tokens.append(req.num_computed_tokens)
            cached.num_output_tokens.append(req.num_output_tokens)
            state.new_block_ids = []
        skipped: list[_State] = []
        while self.waiting and budget > 0:
            state = self.waiting.popleft()
            req = state.request
            external = 0
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if req.request_id not in self.finished_recving:
                    skipped.append(state)
                    continue
                self.finished_recving.discard(req.request_id)
                req.status = RequestStatus.WAITING
                req.num_computed_tokens = state.loading_until
                computed = req.num_computed_tokens
            else:
                computed = 0  # vLLM's own prefix cache is off
                answer, load_async = self.scheduler_connector.get_num_new_matched_tokens(req, computed)
                if answer is None:
                    state.result.none_answers += 1
                    skipped.append(state)
                    continue
                external = int(answer)
                if load_async:
                    if not self._allocate(state, computed + external):
                        self.waiting.appendleft(state)
                        break
                    self.scheduler_connector.update_state_after_alloc(req, self._blocks(state.block_ids), external)
                    state.result.loaded_tokens += external
                    state.loading_until = computed + external
                    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    skipped.append(state)
                    continue
                computed += external
            num_new = min(req.num_tokens - computed, budget)
            if num_new <= 0 or not self._allocate(state, computed + num_new):
                self.waiting.appendleft(state)
                break
            self.scheduler_connector.update_state_after_alloc(req, self._blocks(state.block_ids), external)
            state.result.loaded_tokens += external
            req.num_computed_tokens = computed
            req.status = RequestStatus.RUNNING
            self.running.append(state)
            scheduled[req.request_id] = num_new
            budget -= num_new
            if state.resumed:
                state.resumed = False
                cached.req_ids.append(req.request_id)
                cached.resumed_from_preemption.append(True)
                cached.new_token_ids.append([])
                cached.new_block_ids.append((list(state.block_ids),))
                cached.num_computed_tokens.append(computed)
                cached.num_output_tokens.append(req.num_output_tokens)
            else:
                new_reqs.append(NewRequestData.from_request(req, (list(state.block_ids),)))
            state.new_block_ids = []
        for state in reversed(skipped):
            self.waiting.appendleft(state)
        output = SchedulerOutput(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
                                 num_scheduled_tokens=dict(scheduled),
                                 total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={},
                                 scheduled_encoder_inputs={}, num_common_prefix_blocks=[0],
                                 finished_req_ids=set(self.finished_req_ids), free_encoder_mm_hashes=[])
        self.finished_req_ids = set()
        output.kv_connector_metadata = self.scheduler_connector.build_connector_meta(output)
        starts = {req_id: self.states[req_id].request.num_computed_tokens for req_id in scheduled}
        for req_id, count in scheduled.items():  # vLLM advances num_computed_tokens at schedule time
            self.states[req_id].request.num_computed_tokens += count
        return output, starts

    def _execute(self, output: SchedulerOutput, starts: dict[str, int]) -> KVConnectorOutput:
        worker = self.worker_connector
        slots: dict[str, list[tuple[int, int, int]]] = {}  # req -> (position, block, offset)
        for req_id, count in output.num_scheduled_tokens.items():
            state = self.states[req_id]
            slots[req_id] = [(p, state.block_ids[p // self.block_size], p % self.block_size)
                             for p in range(starts[req_id], starts[req_id] + count)]
        flat = [b * self.block_size + o for entries in slots.values() for _, b, o in entries]
        attn = {name: SimpleNamespace(slot_mapping=torch.tensor(flat, dtype=torch.int64),
                                      num_actual_tokens=len(flat)) for name in self.layer_names}
        layers = {name: SimpleNamespace(kv_cache=[self.caches[name]], layer_name=name) for name in self.layer_names}
        context = ForwardContext(no_compile_layers=layers, attn_metadata=attn, virtual_engine=0)
        with set_forward_context(context):
            worker.bind_connector_metadata(output.kv_connector_metadata)
            worker.start_load_kv(context)
            for layer, name in enumerate(self.layer_names):
                worker.wait_for_layer_load(name)
                for req_id, entries in slots.items():
                    hashes = prefix_hashes(list(self.states[req_id].request.all_token_ids))
                    for pos, block, offset in entries:
                        for kv in range(2):
                            self._slot(self.caches[name], kv, block, offset).copy_(
                                self._token_kv(layer, kv, hashes[pos]))
                worker.save_kv_layer(name, self.caches[name], attn[name])
            worker.wait_for_save()
        sending, recving = worker.get_finished(output.finished_req_ids)
        invalid = set(worker.get_block_ids_with_load_errors())
        worker.clear_connector_metadata()
        return KVConnectorOutput(finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid)

    def _update(self, output: SchedulerOutput, starts: dict[str, int], kv_output: KVConnectorOutput) -> None:
        failed: set[str] = set()
        if kv_output.invalid_block_ids:
            for state in list(self.running) + [s for s in self.waiting
                                               if s.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS]:
                bad = [i for i, b in enumerate(state.block_ids) if b in kv_output.invalid_block_ids]
                if not bad:
                    continue
                rollback = bad[0] * self.block_size
                req = state.request
                state.result.load_error_blocks += len(bad)
                if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    state.loading_until = min(state.loading_until, rollback)
                    continue
                if rollback < req.num_computed_tokens:
                    state.result.recomputed_tokens += req.num_computed_tokens - rollback
                    req.num_computed_tokens = rollback
                    failed.add(req.request_id)
        self.scheduler_connector.update_connector_output(kv_output)
        for req_id, count in output.num_scheduled_tokens.items():
            state = self.states[req_id]
            state.result.computed_tokens += count
            req = state.request
            if req_id in failed or req.num_computed_tokens < req.num_tokens:
                continue  # a prefill chunk, or a step whose loaded KV was bad: no token sampled
            req.append_output_token_ids(self.rng.randrange(1, 32000))
            if req.num_output_tokens >= req.max_tokens:
                self._finish(state)
        for req_id in kv_output.finished_recving or ():
            self.finished_recving.add(req_id)
        for req_id in kv_output.finished_sending or ():
            state = self.pending_free.pop(req_id, None)
            if state is not None:
                self._free(state)

    def _finish(self, state: _State) -> None:
        req = state.request
        req.status = RequestStatus.FINISHED_LENGTH_CAPPED
        self.running.remove(state)
        result = state.result
        prompt = list(req.prompt_token_ids)
        got, want = self.paged_kv(state.block_ids, len(prompt)), self.expected_kv(prompt)
        result.kv_ok = torch.equal(got, want)
        if not result.kv_ok:
            result.mismatched_tokens = [p for p in range(len(prompt)) if not torch.equal(got[:, :, p], want[:, :, p])]
        result.output_token_ids = list(req.output_token_ids)
        result.finish_status = req.status
        delay, params = self.scheduler_connector.request_finished(req, list(state.block_ids))
        result.kv_transfer_params = params
        result.delayed_free = bool(delay)
        self.finished_req_ids.add(req.request_id)
        if delay:
            self.pending_free[req.request_id] = state
        else:
            self._free(state)

    def step(self) -> SchedulerOutput:
        output, starts = self._schedule()
        kv_output = self._execute(output, starts)
        self._update(output, starts, kv_output)
        self.steps += 1
        if not output.num_scheduled_tokens:
            time.sleep(0.001)  # only waiting requests (a lookup or load in flight): as a real step would take
        return output

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.pending_free)

    def run(self, max_steps: int = 10000) -> dict[str, RequestResult]:
        while self.has_unfinished():
            if self.steps >= max_steps:
                raise RuntimeError(f"not finished after {max_steps} steps")
            self.step()
        return self.results

    def shutdown(self) -> None:
        self.scheduler_connector.shutdown()
        self.worker_connector.shutdown()
