"""KvRelayConnector end to end: the stand-in engine (mini_engine) in real processes, real torch
tensors, a real kvrelay sidecar (or two, over TCP), real shared memory."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest
from pathlib import Path

from engine_proc import build_engine, counters, run_requests
from kvrelay_sidecar import MODEL, Sidecar, agent
from kvrelay_vllm.config import ConnectorConfigError

HERE = Path(__file__).resolve().parent


def prompt(seed: int, length: int) -> list[int]:
    return [1] + [3 + (index * 37 + seed * 101) % 500 for index in range(1, length)]


def run_engine_process(spec: dict) -> dict:
    """The engine in a process of its own (as vLLM's are), returning its JSON report."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(spec, handle)
    try:
        done = subprocess.run([sys.executable, str(HERE / "engine_proc.py"), handle.name], capture_output=True,
                              text=True, timeout=240, env=os.environ.copy())
    finally:
        os.unlink(handle.name)
    if done.returncode != 0:
        raise AssertionError(f"engine process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class OneNode(unittest.TestCase):
    def setUp(self) -> None:
        self.sidecar = Sidecar("node-a").start()

    def tearDown(self) -> None:
        self.sidecar.close()

    def handoff(self, layout: str, block_size: int, **spec_extra) -> tuple[dict, dict]:
        a_prompt = prompt(1, 70)
        b_prompt = a_prompt + prompt(2, 30)[1:]
        base = {"socket": self.sidecar.socket, "layout": layout, "block_size": block_size, **spec_extra}
        a = run_engine_process({**base, "requests": [{"id": "a", "prompt": a_prompt}]})
        b = run_engine_process({**base, "requests": [{"id": "b", "prompt": b_prompt}]})
        return a, b

    def test_publish_then_load_is_bit_exact_between_two_engine_processes_in_every_layout(self) -> None:
        for layout, block_size in (("flash_attn", 16), ("flashinfer", 16), ("cpu", 32)):
            with self.subTest(layout=layout):
                self.sidecar.close()
                self.sidecar = Sidecar("node-a").start()
                a, b = self.handoff(layout, block_size)
                ra, rb = a["results"]["a"], b["results"]["b"]
                self.assertTrue(ra["kv_ok"], ra["mismatched_tokens"])
                self.assertEqual(ra["loaded_tokens"], 0)
                self.assertEqual(a["counters"]["worker"]["publishes"], 1)
                # A published its 64 whole-block tokens; B (99 tokens) imports all of them.
                self.assertEqual(rb["loaded_tokens"], 64)
                self.assertTrue(rb["kv_ok"], rb["mismatched_tokens"])
                self.assertEqual(rb["load_error_blocks"], 0)
                self.assertEqual(b["counters"]["copy_mode"], "native")
                # Each finished prefill fed the sidecar's cost model.
                self.assertEqual(a["counters"]["worker"]["prefill_reports"], 1)
                self.assertEqual(b["counters"]["worker"]["prefill_reports"], 1)
                reports = [line for line in self.sidecar.metrics().splitlines()
                           if line.startswith("kvrelay_kv_prefill_reports_total")]
                self.assertEqual(sum(float(line.rsplit(" ", 1)[1]) for line in reports), 2)

    def test_the_torch_copy_path_on_host_tensors_moves_the_same_kv(self) -> None:
        a, b = self.handoff("flash_attn", 16, extra={"copy": "torch"})
        self.assertEqual(b["counters"]["copy_mode"], "torch-host")
        self.assertEqual(b["results"]["b"]["loaded_tokens"], 64)
        self.assertTrue(b["results"]["b"]["kv_ok"])

    def test_the_last_prompt_token_is_recomputed_and_loads_are_whole_blocks(self) -> None:
        spec = {"socket": self.sidecar.socket}
        base = prompt(3, 64)
        run_engine_process({**spec, "requests": [{"id": "a", "prompt": base + [7]}]})  # publishes 64 tokens
        # The same 64 tokens as a whole prompt: vLLM must compute the last one, so 48 are loaded.
        again = run_engine_process({**spec, "requests": [{"id": "b", "prompt": base}]})["results"]["b"]
        self.assertEqual(again["loaded_tokens"], 48)
        self.assertTrue(again["kv_ok"])
        self.assertEqual(again["loaded_tokens"] % 16, 0)
        # The last block, its last token included, then one decode step for the second new token.
        self.assertEqual(again["computed_tokens"], 16 + 1)

    def test_a_prompt_sharing_only_the_first_blocks_of_a_published_one_loads_those_blocks(self) -> None:
        spec = {"socket": self.sidecar.socket}
        a_prompt = prompt(23, 70)  # publishes 64 tokens: 4 blocks, filed under the last one's key
        run_engine_process({**spec, "requests": [{"id": "a", "prompt": a_prompt}]})
        # The same system prompt and context (40 tokens: 2 whole blocks), then another question.
        branch = a_prompt[:40] + prompt(24, 30)[1:]
        b = run_engine_process({**spec, "requests": [{"id": "b", "prompt": branch}]})["results"]["b"]
        self.assertEqual(b["loaded_tokens"], 32)
        self.assertEqual(b["load_error_blocks"], 0)
        self.assertTrue(b["kv_ok"], b["mismatched_tokens"])

    def test_kv_transfer_params_pass_through_and_a_chain_root_separates_tenants(self) -> None:
        spec = {"socket": self.sidecar.socket}
        a_prompt = prompt(4, 70)
        salted = {"kvrelay": {"chain_root": "00000000000000aa"}}
        a = run_engine_process({**spec, "requests": [{"id": "a", "prompt": a_prompt, "kv_transfer_params": salted}]})
        published = a["results"]["a"]["kv_transfer_params"]["kvrelay"]["published"]
        self.assertEqual(published["tokens"], 64)
        self.assertEqual(published["chain_root"], "00000000000000aa")
        b_prompt = a_prompt + [9, 9, 9]
        # Another root (another tenant or cache salt) never finds it; the same root does.
        other = run_engine_process({**spec, "requests": [{"id": "b", "prompt": b_prompt}]})["results"]["b"]
        self.assertEqual(other["loaded_tokens"], 0)
        same = run_engine_process({**spec, "requests": [{"id": "c", "prompt": b_prompt,
                                                         "kv_transfer_params": salted}]})["results"]["c"]
        self.assertEqual(same["loaded_tokens"], 64)
        self.assertTrue(same["kv_ok"])
        self.assertEqual(same["kv_transfer_params"]["kvrelay"]["imported_tokens"], 64)
        self.assertEqual(same["kv_transfer_params"]["kvrelay"]["imported_medium"], "kv_raw")

    def test_a_load_that_fails_is_reported_and_recomputed_never_served_wrong(self) -> None:
        spec = {"socket": self.sidecar.socket}
        a_prompt = prompt(5, 70)
        run_engine_process({**spec, "requests": [{"id": "a", "prompt": a_prompt}]})
        # The sidecar dies between the scheduler's lookup and the worker's load.
        engine = build_engine(spec)
        sidecar = self.sidecar
        original = engine.worker_connector.start_load_kv

        def load_after_the_sidecar_died(forward_context, **kwargs):
            if engine.worker_connector.has_connector_metadata() and \
                    engine.worker_connector._get_connector_metadata().loads:
                sidecar.kill()
            return original(forward_context, **kwargs)

        engine.worker_connector.start_load_kv = load_after_the_sidecar_died
        result = run_requests(engine, [{"id": "b", "prompt": a_prompt + [5, 6]}])["b"]
        self.assertEqual(result["loaded_tokens"], 64)        # the scheduler was promised 64
        self.assertEqual(result["load_error_blocks"], 4)     # the worker could not load them
        self.assertGreaterEqual(result["recomputed_tokens"], 64)
        self.assertTrue(result["kv_ok"], result["mismatched_tokens"])
        self.assertEqual(counters(engine)["worker"]["load_failures"], 1)

    def test_a_killed_sidecar_costs_vllm_nothing_but_the_hit_and_the_connector_reconnects(self) -> None:
        spec = {"socket": self.sidecar.socket}
        engine = build_engine(spec)
        first = prompt(6, 70)
        run_requests(engine, [{"id": "warm", "prompt": first}])
        self.sidecar.kill()
        down = run_requests(engine, [{"id": "down", "prompt": first + [4, 4]},
                                     {"id": "down2", "prompt": prompt(7, 50)}])
        for result in down.values():
            self.assertEqual(result["loaded_tokens"], 0)
            self.assertTrue(result["kv_ok"])
        self.assertGreaterEqual(counters(engine)["worker"]["publishes_dropped"], 1)
        # Back: the connector reconnects by itself; the new sidecar holds nothing until A publishes.
        self.sidecar.start()
        time.sleep(0.1)  # past retry_seconds (0.05)
        again = prompt(8, 70)
        run_requests(engine, [{"id": "a2", "prompt": again}])
        hit = run_requests(engine, [{"id": "b2", "prompt": again + [3, 3]}])["b2"]
        self.assertEqual(hit["loaded_tokens"], 64)
        self.assertTrue(hit["kv_ok"])
        self.assertGreaterEqual(counters(engine)["scheduler"]["connects"], 2)

    def test_fp8_kv_caches_move_as_tagged_bytes_bit_exact(self) -> None:
        fp8 = {**MODEL, "dtype": "fp8_e4m3"}
        self.sidecar.close()
        self.sidecar = Sidecar("node-a", agents=[agent("writer", model=fp8), agent("reader", model=fp8)]).start()
        for layout, block_size in (("flash_attn", 16), ("cpu", 32)):
            with self.subTest(layout=layout):
                seed = 18 if layout == "flash_attn" else 19
                a_prompt = prompt(seed, 70)
                spec = {"socket": self.sidecar.socket, "cache_dtype": "fp8", "layout": layout,
                        "block_size": block_size}
                a = run_engine_process({**spec, "requests": [{"id": "a", "prompt": a_prompt}]})
                self.assertEqual(a["counters"]["worker"]["publishes"], 1)
                b = run_engine_process({**spec, "requests": [{"id": "b", "prompt": a_prompt + [2]}]})["results"]["b"]
                self.assertEqual(b["loaded_tokens"], 64)
                self.assertTrue(b["kv_ok"], b["mismatched_tokens"])
                self.assertEqual(b["kv_transfer_params"]["kvrelay"]["imported_medium"], "kv_raw")
        # e5m2 is another model's KV: e4m3 bytes are never served to it.
        other = run_engine_process({"socket": self.sidecar.socket, "cache_dtype": "fp8_e5m2", "requests": [
            {"id": "c", "prompt": prompt(18, 70) + [2]}]})["results"]["c"]
        self.assertEqual(other["loaded_tokens"], 0)
        self.assertTrue(other["kv_ok"])

    def test_a_preempted_request_resolves_and_loads_again_when_it_resumes(self) -> None:
        spec = {"socket": self.sidecar.socket}
        a_prompt = prompt(17, 70)
        run_engine_process({**spec, "requests": [{"id": "a", "prompt": a_prompt}]})
        engine = build_engine(spec)
        engine.add_request("b", a_prompt + [3, 3], 3)
        engine.step()  # b loads 64 tokens, prefills the rest, samples its first token
        self.assertEqual(engine.results["b"].loaded_tokens, 64)
        engine.preempt("b")  # out of blocks: vLLM frees them and starts b over later
        engine.run()
        result = engine.results["b"]
        self.assertEqual(result.preemptions, 1)
        self.assertEqual(result.loaded_tokens, 128)  # imported again on resume, not recomputed
        self.assertEqual(result.load_error_blocks, 0)
        self.assertTrue(result.kv_ok, result.mismatched_tokens)
        self.assertEqual(counters(engine)["scheduler"]["lookups"], 2)
        engine.shutdown()

    def test_a_stopped_sidecar_costs_each_call_its_deadline_and_the_connector_comes_back(self) -> None:
        spec = {"socket": self.sidecar.socket, "extra": {"lookup_timeout_ms": 200, "reply_timeout_ms": 200}}
        engine = build_engine(spec)
        run_requests(engine, [{"id": "warm", "prompt": prompt(20, 40)}])  # connected, both sides
        self.sidecar.pause()
        try:
            stalled = run_requests(engine, [{"id": "stalled", "prompt": prompt(21, 70)}])["stalled"]
        finally:
            self.sidecar.pause(False)
        self.assertEqual(stalled["loaded_tokens"], 0)  # the lookup's deadline passed: a miss
        self.assertTrue(stalled["kv_ok"])
        self.assertEqual(counters(engine)["worker"]["publishes_dropped"], 1)  # the save's alloc timed out
        time.sleep(0.1)  # past retry_seconds
        again = prompt(22, 70)
        run_requests(engine, [{"id": "a", "prompt": again}])
        hit = run_requests(engine, [{"id": "b", "prompt": again + [1]}])["b"]
        self.assertEqual(hit["loaded_tokens"], 64)
        self.assertTrue(hit["kv_ok"])
        engine.shutdown()

    def test_tensor_parallel_ranks_publish_and_load_their_own_shards(self) -> None:
        a_prompt = prompt(9, 70)
        b_prompt = a_prompt + [8, 8, 8]
        for rank in (0, 1):
            a = run_engine_process({"socket": self.sidecar.socket, "tp_size": 2, "tp_rank": rank,
                                    "requests": [{"id": f"a{rank}", "prompt": a_prompt}]})
            self.assertEqual(a["counters"]["worker"]["publishes"], 1)
        for rank in (0, 1):
            b = run_engine_process({"socket": self.sidecar.socket, "tp_size": 2, "tp_rank": rank,
                                    "requests": [{"id": f"b{rank}", "prompt": b_prompt}]})["results"][f"b{rank}"]
            self.assertEqual(b["loaded_tokens"], 64, rank)
            self.assertEqual(b["load_error_blocks"], 0, rank)
            self.assertTrue(b["kv_ok"], (rank, b["mismatched_tokens"]))
        # A rank whose shard is missing reports load errors and recomputes: rank 1 of TP=4.
        lone = run_engine_process({"socket": self.sidecar.socket, "tp_size": 4, "tp_rank": 1,
                                   "requests": [{"id": "lone", "prompt": b_prompt}]})["results"]["lone"]
        self.assertEqual(lone["loaded_tokens"], 0)  # rank 0's shard of TP=4 was never published
        self.assertTrue(lone["kv_ok"])


class Asynchronous(unittest.TestCase):
    """async_lookup and async_load: vLLM is answered None while the sidecar decides, and loads
    run beside its forward passes, reported through get_finished."""

    def setUp(self) -> None:
        self.sidecar = Sidecar("node-a").start()
        self.spec = {"socket": self.sidecar.socket}

    def tearDown(self) -> None:
        self.sidecar.close()

    def publish(self, seed: int) -> list[int]:
        a_prompt = prompt(seed, 70)
        a = run_engine_process({**self.spec, "requests": [{"id": "a", "prompt": a_prompt}]})
        self.assertEqual(a["counters"]["worker"]["publishes"], 1)
        return a_prompt

    def test_async_lookups_answer_none_until_the_sidecar_decides_and_then_load(self) -> None:
        a_prompt = self.publish(11)
        engine = build_engine({**self.spec, "extra": {"async_lookup": True}})
        # The sidecar "decides" only when the test lets it: until then every step answers None.
        decided = threading.Event()
        resolve = engine.scheduler_connector._resolve

        def slow_resolve(*args):
            decided.wait(30)
            return resolve(*args)

        engine.scheduler_connector._resolve = slow_resolve
        engine.add_request("b", a_prompt + [2, 2], 2)
        engine.add_request("c", prompt(12, 40), 2)
        for _ in range(3):
            engine.step()
        self.assertGreaterEqual(engine.results["b"].none_answers, 3)
        self.assertEqual(engine.results["b"].computed_tokens, 0)  # waiting, not scheduled
        decided.set()
        engine.run()
        hit, miss = engine.results["b"], engine.results["c"]
        self.assertEqual(hit.loaded_tokens, 64)
        self.assertTrue(hit.kv_ok, hit.mismatched_tokens)
        self.assertEqual(miss.loaded_tokens, 0)  # a miss is also asked for again, then 0
        self.assertTrue(miss.kv_ok)
        self.assertEqual(counters(engine)["scheduler"]["lookups"], 2)  # one resolve each, however often asked
        engine.shutdown()

    def test_async_loads_land_through_get_finished_bit_exact(self) -> None:
        a_prompt = self.publish(13)
        b = run_engine_process({**self.spec, "extra": {"async_lookup": True, "async_load": True},
                                "requests": [{"id": "b", "prompt": a_prompt + [4]}]})
        result = b["results"]["b"]
        self.assertEqual(result["loaded_tokens"], 64)
        self.assertEqual(result["load_error_blocks"], 0)
        # Once loaded, vLLM schedules it from token 64: only the rest is computed.
        self.assertEqual(result["computed_tokens"], 71 - 64 + 1)
        self.assertTrue(result["kv_ok"], result["mismatched_tokens"])
        self.assertFalse(result["delayed_free"])

    def test_an_async_load_that_fails_is_reported_and_recomputed(self) -> None:
        a_prompt = self.publish(14)
        engine = build_engine({**self.spec, "extra": {"async_load": True}})
        sidecar = self.sidecar
        original = engine.worker_connector._load

        def load_after_the_sidecar_died(load):
            sidecar.kill()
            return original(load)

        engine.worker_connector._load = load_after_the_sidecar_died
        result = run_requests(engine, [{"id": "b", "prompt": a_prompt + [5]}])["b"]
        self.assertEqual(result["loaded_tokens"], 64)
        self.assertEqual(result["load_error_blocks"], 4)
        self.assertTrue(result["kv_ok"], result["mismatched_tokens"])
        self.assertEqual(result["computed_tokens"], 71 + 1)  # all of it, from the first failed block
        engine.shutdown()

    def test_a_request_aborted_while_its_load_runs_keeps_its_blocks_until_the_load_ends(self) -> None:
        a_prompt = self.publish(15)
        engine = build_engine({**self.spec, "extra": {"async_load": True}})
        gate = threading.Event()
        started = threading.Event()
        original = engine.worker_connector._load

        def held_load(load):
            started.set()
            gate.wait(30)
            return original(load)

        engine.worker_connector._load = held_load
        free_before = len(engine.free_blocks)
        engine.add_request("b", a_prompt + [6], 2)
        while not started.is_set():
            engine.step()
        engine.abort("b")
        self.assertTrue(engine.results["b"].delayed_free)
        for _ in range(3):
            engine.step()  # the load is still writing into its blocks: they stay allocated
        self.assertEqual(len(engine.free_blocks), free_before - 4)  # 64 tokens
        gate.set()
        engine.run()
        self.assertEqual(len(engine.free_blocks), free_before)
        self.assertEqual(engine.pending_free, {})
        engine.shutdown()


class Configuration(unittest.TestCase):
    def test_block_tokens_must_divide_the_vllm_block_size(self) -> None:
        with self.assertRaises(ConnectorConfigError) as refused:
            build_engine({"socket": "/nonexistent.sock", "block_size": 16, "extra": {"block_tokens": 24}})
        self.assertIn("must divide vLLM's block_size (16)", str(refused.exception))
        # 16 divides the CPU backend's 128.
        build_engine({"socket": "/nonexistent.sock", "block_size": 128, "num_blocks": 8}).shutdown()

    def test_an_unknown_kv_cache_dtype_is_refused_by_name(self) -> None:
        with self.assertRaises(ConnectorConfigError) as refused:
            build_engine({"socket": "/nonexistent.sock", "cache_dtype": "fp8_inc"})
        self.assertIn("fp8_inc", str(refused.exception))
        self.assertIn("fp8_e5m2", str(refused.exception))

    def test_unknown_settings_are_refused_by_name(self) -> None:
        with self.assertRaises(ConnectorConfigError) as refused:
            build_engine({"socket": "/nonexistent.sock", "extra": {"sockte": "/x"}})
        self.assertIn("sockte", str(refused.exception))


class TwoNodes(unittest.TestCase):
    """Node A's writer and node B's reader, a route between them that forces raw KV, and each
    sidecar the other's peer over TCP."""

    def start_nodes(self, tp_size: int = 1, prefetch: bool = False) -> tuple[Sidecar, Sidecar]:
        port_a, port_b = free_port(), free_port()
        route = [{"id": "writer-to-reader", "from": "writer", "to": "reader", "forced_medium": "kv_raw"}]
        node_a = Sidecar("node-a", agents=[agent("writer", tp_size=tp_size), agent("reader", "node-b", tp_size=tp_size)],
                         routes=route, peers=[{"id": "node-b", "address": f"127.0.0.1:{port_b}"}],
                         kv_store={"prefetch": prefetch})
        node_b = Sidecar("node-b", agents=[agent("writer", "node-a", tp_size=tp_size), agent("reader", tp_size=tp_size)],
                         routes=route, peers=[{"id": "node-a", "address": f"127.0.0.1:{port_a}"}])
        node_a.policy["listen"]["peer"] = f"127.0.0.1:{port_a}"
        node_b.policy["listen"]["peer"] = f"127.0.0.1:{port_b}"
        node_a.start()
        self.addCleanup(node_a.close)
        node_b.start()
        self.addCleanup(node_b.close)
        return node_a, node_b

    def test_kv_published_on_node_a_is_loaded_bit_exact_on_node_b_over_tcp(self) -> None:
        node_a, node_b = self.start_nodes()
        a_prompt = prompt(10, 70)
        a = run_engine_process({"socket": node_a.socket, "requests": [
            {"id": "a", "prompt": a_prompt, "kv_transfer_params": {"kvrelay": {"agent": "writer"}}}]})
        self.assertEqual(a["counters"]["worker"]["publishes"], 1)
        b = run_engine_process({"socket": node_b.socket, "requests": [
            {"id": "b", "prompt": a_prompt + [6, 6, 6],
             "kv_transfer_params": {"kvrelay": {"agent": "reader", "route": "writer-to-reader"}}}]})
        result = b["results"]["b"]
        self.assertEqual(result["loaded_tokens"], 64, node_b.stderr()[-2000:])
        self.assertTrue(result["kv_ok"], result["mismatched_tokens"])
        decisions = node_b.admin("/admin/decisions?limit=5")
        self.assertIn("peer:node-a", json.dumps(decisions))

    def test_kv_prefetched_from_node_a_is_loaded_from_node_bs_own_store(self) -> None:
        # kv_store.prefetch (the product's default): A's publish goes ahead to B at background
        # priority, so B's lookup is a local hit, counted as a prefetch hit.
        node_a, node_b = self.start_nodes(prefetch=True)
        a_prompt = prompt(12, 70)
        a = run_engine_process({"socket": node_a.socket, "requests": [
            {"id": "a", "prompt": a_prompt, "kv_transfer_params": {"kvrelay": {"agent": "writer"}}}]})
        self.assertEqual(a["counters"]["worker"]["publishes"], 1)
        deadline = time.monotonic() + 10
        while node_b.admin("/admin/kv")["entries"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(node_b.admin("/admin/kv")["top"][0]["origin"], "prefetched")
        b = run_engine_process({"socket": node_b.socket, "requests": [
            {"id": "b", "prompt": a_prompt + [6, 6, 6],
             "kv_transfer_params": {"kvrelay": {"agent": "reader", "route": "writer-to-reader"}}}]})
        result = b["results"]["b"]
        self.assertEqual(result["loaded_tokens"], 64, node_b.stderr()[-2000:])
        self.assertTrue(result["kv_ok"], result["mismatched_tokens"])
        lookups = [d for d in node_b.admin("/admin/decisions?limit=5")["decisions"] if d.get("kind") == "lookup"]
        self.assertTrue(lookups, "no lookup on node B")
        self.assertEqual(lookups[0]["kv_from"], "local")
        self.assertTrue(lookups[0].get("prefetch_hit"), json.dumps(lookups[0]))

    def test_tensor_parallel_shards_are_fetched_from_the_peer_by_the_schedulers_lookup(self) -> None:
        # Both engines run TP=2: node A lets node B fetch the shards of reader's model.
        node_a, node_b = self.start_nodes(tp_size=2)
        a_prompt = prompt(16, 70)
        writer = {"kvrelay": {"agent": "writer"}}
        for rank in (0, 1):
            a = run_engine_process({"socket": node_a.socket, "tp_size": 2, "tp_rank": rank, "requests": [
                {"id": f"a{rank}", "prompt": a_prompt, "kv_transfer_params": writer}]})
            self.assertEqual(a["counters"]["worker"]["publishes"], 1)
        reader = {"kvrelay": {"agent": "reader", "route": "writer-to-reader"}}
        # Rank 1 of node B: its scheduler's lookup fetches both shards from node A; the worker
        # claims its own.
        b = run_engine_process({"socket": node_b.socket, "tp_size": 2, "tp_rank": 1, "requests": [
            {"id": "b1", "prompt": a_prompt + [6, 6], "kv_transfer_params": reader}]})
        result = b["results"]["b1"]
        self.assertEqual(result["loaded_tokens"], 64, json.dumps(node_b.admin("/admin/decisions?limit=5"))[-3000:])
        self.assertEqual(result["load_error_blocks"], 0)
        self.assertTrue(result["kv_ok"], result["mismatched_tokens"])
        self.assertEqual(b["counters"]["scheduler"]["lookup_hits"], 1)


if __name__ == "__main__":
    unittest.main()
