"""Self-tests of the vLLM stand-in and the mini engine (run from the repo root:
/usr/bin/python3 -m unittest discover -s tests/vllm -p 'test_standin.py')."""

from __future__ import annotations

import logging
import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin"))

import torch  # noqa: E402

import mini_engine  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector import factory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,  # noqa: E402
                                                               KVConnectorRole)


class NeverMatches(KVConnectorBase_V1):
    """Counts the calls vLLM makes; never supplies a token."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self.calls: dict[str, int] = {}
        self.seen_resumed: list[str] = []
        self.layers = 0

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def register_kv_caches(self, kv_caches):
        self.layers = len(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        self._count("start_load_kv")
        assert set(forward_context.no_compile_layers) == set(forward_context.attn_metadata)

    def wait_for_layer_load(self, layer_name):
        self._count("wait_for_layer_load")

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self._count("save_kv_layer")

    def wait_for_save(self):
        self._count("wait_for_save")

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._count("get_num_new_matched_tokens")
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._count("update_state_after_alloc")

    def build_connector_meta(self, scheduler_output):
        cached = scheduler_output.scheduled_cached_reqs
        self.seen_resumed += [r for r, flag in zip(cached.req_ids, cached.resumed_from_preemption) if flag]
        return KVConnectorMetadata.__new__(type("Meta", (KVConnectorMetadata,), {}))

    def request_finished(self, request, block_ids):
        return False, {"seen_blocks": len(block_ids)}


class AsksTwiceFirst(NeverMatches):
    """Answers (None, False) twice per request before answering 0."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self.asked: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.asked[request.request_id] = self.asked.get(request.request_id, 0) + 1
        return (None, False) if self.asked[request.request_id] <= 2 else (0, False)


class TwoArguments(NeverMatches):
    def __init__(self, vllm_config, role):  # the signature v0.11.2 calls deprecated
        KVConnectorBase_V1.__init__(self, vllm_config, role)


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 32000 + 1 for i in range(n)]


class StandinTest(unittest.TestCase):
    def setUp(self) -> None:
        logging.getLogger("vllm").setLevel(logging.ERROR)

    def test_never_matching_connector_completes_with_exact_kv_in_every_layout(self) -> None:
        for layout in mini_engine.LAYOUTS:
            for dtype in (torch.float16, torch.bfloat16, torch.float32):
                with self.subTest(layout=layout, dtype=dtype):
                    engine = mini_engine.MiniEngine(NeverMatches, layout=layout, dtype=dtype, num_blocks=32,
                                                    max_tokens_per_step=40)
                    self.assertEqual(engine.worker_connector.layers, 4)
                    self.assertEqual(engine.scheduler_connector.role, KVConnectorRole.SCHEDULER)
                    self.assertEqual(engine.worker_connector.role, KVConnectorRole.WORKER)
                    engine.add_request("a", prompt(37, 1), max_new_tokens=3)
                    engine.add_request("b", prompt(16, 2), max_new_tokens=2)
                    results = engine.run()
                    for result in results.values():
                        self.assertTrue(result.kv_ok, (layout, dtype, result.mismatched_tokens))
                        self.assertEqual(result.loaded_tokens, 0)
                    self.assertEqual(results["a"].computed_tokens, 37 + 2)  # prompt + decode steps
                    self.assertEqual(len(results["a"].output_token_ids), 3)
                    self.assertEqual(results["b"].kv_transfer_params, {"seen_blocks": 2})
                    calls = engine.worker_connector.calls
                    self.assertEqual(calls["wait_for_layer_load"], 4 * calls["start_load_kv"])
                    self.assertEqual(calls["save_kv_layer"], 4 * calls["wait_for_save"])
                    self.assertEqual(engine.scheduler_connector.calls["get_num_new_matched_tokens"], 2)
                    self.assertEqual(len(engine.free_blocks), 31)  # every block back

    def test_expected_kv_depends_on_the_whole_prefix(self) -> None:
        engine = mini_engine.MiniEngine(NeverMatches)
        a, b = prompt(20, 1), prompt(20, 1)
        b[3] += 1
        kv_a, kv_b = engine.expected_kv(a), engine.expected_kv(b)
        self.assertTrue(torch.equal(kv_a[:, :, :3], kv_b[:, :, :3]))
        for pos in range(3, 20):
            self.assertFalse(torch.equal(kv_a[:, :, pos], kv_b[:, :, pos]), pos)

    def test_a_wrong_block_is_detected(self) -> None:
        engine = mini_engine.MiniEngine(NeverMatches, num_blocks=16)
        engine.add_request("a", prompt(40, 3), max_new_tokens=3)
        engine.step()
        state = engine.states["a"]
        got = engine.paged_kv(state.block_ids, 40)
        self.assertTrue(torch.equal(got, engine.expected_kv(prompt(40, 3))))
        engine.caches[engine.layer_names[2]].zero_()
        self.assertFalse(torch.equal(engine.paged_kv(state.block_ids, 40), engine.expected_kv(prompt(40, 3))))

    def test_none_answer_leaves_the_request_waiting(self) -> None:
        engine = mini_engine.MiniEngine(AsksTwiceFirst)
        engine.add_request("a", prompt(20, 4), max_new_tokens=2)
        results = engine.run()
        self.assertEqual(results["a"].none_answers, 2)
        self.assertEqual(engine.scheduler_connector.asked["a"], 3)
        self.assertTrue(results["a"].kv_ok)

    def test_preemption_and_resume(self) -> None:
        engine = mini_engine.MiniEngine(NeverMatches, num_blocks=16, max_tokens_per_step=16)
        engine.add_request("a", prompt(48, 5), max_new_tokens=2)
        engine.add_request("b", prompt(20, 6), max_new_tokens=2)
        engine.step()  # "a": 16 of 48 prompt tokens
        self.assertEqual(engine.states["a"].request.num_computed_tokens, 16)
        engine.preempt("a")
        self.assertEqual(engine.states["a"].request.num_computed_tokens, 0)
        self.assertEqual(len(engine.free_blocks), 15)
        results = engine.run()
        self.assertEqual(results["a"].preemptions, 1)
        self.assertIn("a", engine.scheduler_connector.seen_resumed)
        self.assertEqual(engine.scheduler_connector.calls["get_num_new_matched_tokens"], 3)  # a, b, a again
        self.assertTrue(results["a"].kv_ok and results["b"].kv_ok)
        self.assertEqual(results["a"].computed_tokens, 16 + 48 + 1)

    def test_out_of_blocks_preempts_the_last_running_request(self) -> None:
        engine = mini_engine.MiniEngine(NeverMatches, num_blocks=6, max_tokens_per_step=64)
        engine.add_request("a", prompt(40, 7), max_new_tokens=12)  # 52 tokens: 4 blocks at the end
        engine.add_request("b", prompt(30, 8), max_new_tokens=12)
        results = engine.run()
        self.assertGreaterEqual(sum(r.preemptions for r in results.values()), 1)
        self.assertTrue(all(r.kv_ok for r in results.values()))

    def test_factory_flags_the_two_argument_signature(self) -> None:
        config = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector="TwoArguments",
                                                                kv_connector_module_path=__name__,
                                                                kv_role="kv_both"))
        with self.assertLogs("vllm.distributed.kv_transfer.kv_connector.factory", "WARNING") as logs:
            _, compat = factory.KVConnectorFactory._get_connector_class_with_compat(config.kv_transfer_config)
        self.assertTrue(compat)
        self.assertIn("deprecated signature with 2 required arguments", "\n".join(logs.output))
        # v0.11.2 still builds it with two arguments; the strict mode refuses it.
        self.assertIsInstance(factory.KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER),
                              TwoArguments)
        factory.STRICT_SIGNATURE = True
        try:
            with self.assertRaises(TypeError):
                factory.KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER)
        finally:
            factory.STRICT_SIGNATURE = False
        three = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector="NeverMatches",
                                                               kv_connector_module_path=__name__, kv_role="kv_both"))
        _, compat = factory.KVConnectorFactory._get_connector_class_with_compat(three.kv_transfer_config)
        self.assertFalse(compat)

    def test_tensor_parallel_ranks_hold_their_own_heads(self) -> None:
        tokens = prompt(20, 11)
        whole = mini_engine.MiniEngine(NeverMatches, kv_heads=4).expected_kv(tokens)
        for rank in range(2):
            shard = mini_engine.MiniEngine(NeverMatches, kv_heads=4, tp_size=2, tp_rank=rank)
            self.assertEqual(shard.heads, 2)
            self.assertTrue(torch.equal(shard.expected_kv(tokens), whole[:, :, :, 2 * rank:2 * rank + 2]))

    def test_abstract_methods_stay_abstract(self) -> None:
        self.assertEqual(KVConnectorBase_V1.__abstractmethods__,
                         {"start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                          "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta"})


class OracleMeta(KVConnectorMetadata):
    def __init__(self) -> None:
        self.loads: list[tuple[str, list[int], int, int, tuple[int, ...]]] = []


class Oracle(NeverMatches):
    """Supplies the whole blocks of a prompt's KV from STORE (the engine's own expected_kv)."""

    ENGINE = None
    STORE: dict[tuple[int, ...], torch.Tensor] = {}
    ASYNC = False
    FAIL_BLOCK_INDEX = None   # this block of each load is left unwritten and reported as failed
    DELAY_FREE = False

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        self.block = vllm_config.cache_config.block_size
        self.pending: list = []
        self.after_alloc: list[tuple[str, int]] = []
        self.errors: set[int] = set()
        self.recving: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        kv = self.STORE.get(tuple(request.prompt_token_ids))
        if kv is None:
            return 0, False
        usable = (request.num_prompt_tokens - 1) // self.block * self.block
        return max(0, usable - num_computed_tokens), self.ASYNC

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.after_alloc.append((request.request_id, num_external_tokens))
        if num_external_tokens > 0:
            self.pending.append((request.request_id, list(blocks.get_block_ids()[0]), request.num_computed_tokens,
                                 num_external_tokens, tuple(request.prompt_token_ids)))

    def build_connector_meta(self, scheduler_output):
        super().build_connector_meta(scheduler_output)
        meta = OracleMeta()
        meta.loads, self.pending = self.pending, []
        return meta

    def start_load_kv(self, forward_context, **kwargs):
        engine = self.ENGINE
        for req_id, block_ids, first, count, prompt in self._get_connector_metadata().loads:
            kv = self.STORE[prompt]
            for layer, name in enumerate(engine.layer_names):
                cache = forward_context.no_compile_layers[name].kv_cache[0]
                for pos in range(first, first + count):
                    index = pos // self.block
                    if index == self.FAIL_BLOCK_INDEX:
                        self.errors.add(block_ids[index])
                        continue
                    for kvi in range(2):
                        engine._slot(cache, kvi, block_ids[index], pos % self.block).copy_(kv[layer, kvi, pos])
            if self.ASYNC:
                self.recving.add(req_id)

    def get_finished(self, finished_req_ids):
        recving, self.recving = self.recving, set()
        sending = set(finished_req_ids) if self.DELAY_FREE else None
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self):
        errors, self.errors = self.errors, set()
        return errors

    def request_finished(self, request, block_ids):
        return self.DELAY_FREE, None


class LoadingTest(unittest.TestCase):
    def setUp(self) -> None:
        logging.getLogger("vllm").setLevel(logging.ERROR)
        Oracle.ASYNC, Oracle.FAIL_BLOCK_INDEX, Oracle.DELAY_FREE = False, None, False

    def engine(self, **kwargs) -> mini_engine.MiniEngine:
        engine = mini_engine.MiniEngine(Oracle, **kwargs)
        Oracle.ENGINE = engine
        Oracle.STORE = {tuple(prompt(50, 9)): engine.expected_kv(prompt(50, 9))}
        return engine

    def test_sync_load_is_used_and_exact(self) -> None:
        for layout in mini_engine.LAYOUTS:
            with self.subTest(layout=layout):
                engine = self.engine(layout=layout)
                engine.add_request("a", prompt(50, 9), max_new_tokens=2)
                result = engine.run()["a"]
                self.assertEqual(result.loaded_tokens, 48)
                self.assertEqual(result.computed_tokens, 2 + 1)
                self.assertTrue(result.kv_ok)

    def test_a_load_of_the_wrong_prompt_is_detected(self) -> None:
        engine = self.engine()
        Oracle.STORE[tuple(prompt(50, 10))] = Oracle.STORE[tuple(prompt(50, 9))]  # another prompt's KV
        engine.add_request("a", prompt(50, 10), max_new_tokens=2)
        result = engine.run()["a"]
        self.assertFalse(result.kv_ok)
        self.assertEqual(result.mismatched_tokens, list(range(48)))

    def test_async_load_resumes_with_zero_external_tokens(self) -> None:
        Oracle.ASYNC = True
        engine = self.engine()
        engine.add_request("a", prompt(50, 9), max_new_tokens=2)
        result = engine.run()["a"]
        self.assertEqual(engine.scheduler_connector.after_alloc, [("a", 48), ("a", 0)])
        self.assertEqual(result.loaded_tokens, 48)
        self.assertEqual(result.computed_tokens, 3)
        self.assertTrue(result.kv_ok)

    def test_load_errors_are_recomputed_from_the_first_failed_block(self) -> None:
        Oracle.FAIL_BLOCK_INDEX = 1
        engine = self.engine()
        engine.add_request("a", prompt(50, 9), max_new_tokens=2)
        result = engine.run()["a"]
        self.assertEqual(result.load_error_blocks, 1)
        self.assertEqual(result.recomputed_tokens, 50 - 16)  # rolled back to block 1's first token
        self.assertEqual(result.computed_tokens, 2 + 34 + 1)
        self.assertTrue(result.kv_ok)

    def test_delayed_free_waits_for_get_finished(self) -> None:
        Oracle.DELAY_FREE = True
        engine = self.engine(num_blocks=16)
        engine.add_request("a", prompt(50, 9), max_new_tokens=2)
        while not engine.pending_free:
            engine.step()
        self.assertEqual(len(engine.free_blocks), 15 - 4)
        engine.run()
        self.assertEqual(len(engine.free_blocks), 15)


if __name__ == "__main__":
    unittest.main()
