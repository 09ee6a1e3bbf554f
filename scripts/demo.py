#!/usr/bin/env python3
"""The main job: two reference workers (agents A and B) behind one kvrelay sidecar.

Agent A answers a prompt; agent B then gets A's prompt + A's answer + a follow-up, as a multi-agent
framework would hand context over. Every call goes through kvrelay's OpenAI front proxy
(http://sidecar/agents/{agent}/v1). The table shows what B pays to re-prefill A's context on the
tokens medium at each length: the compute kvrelay's KV path (lookup/publish through the sidecar's
shared-memory data plane) exists to remove.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

BUILD = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "build/default")
KVRELAY = BUILD / "proxy" / "kvrelay"
REFWORKER = BUILD / "refworker" / "kvrelay-refworker"
SHAPE = "layers=8,dim=512,heads=8,kv_heads=4,ffn=1376,vocab=512,seq_len=4096"
LENGTHS = [64, 256, 512, 1024, 2048]
FOLLOW_UP = [300, 301, 302, 303, 304, 305, 306, 307]


def wait_ready(path, process, what, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.stat().st_size > 0:
            return json.loads(path.read_text())
        if process.poll() is not None:
            sys.exit(f"{what} exited with {process.returncode}")
        time.sleep(0.05)
    sys.exit(f"{what} did not start within {timeout} s")


def post(port, agent, body):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/agents/{agent}/v1/completions",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.loads(response.read())
    return reply, (time.perf_counter() - started) * 1000


def main():
    work = pathlib.Path(tempfile.mkdtemp(prefix="kvrelay-demo-"))
    processes = []
    try:
        workers = {}
        for agent in ("agent-a", "agent-b"):
            ready = work / f"{agent}.json"
            process = subprocess.Popen([str(REFWORKER), "serve", "--synthetic", SHAPE, "--seed", "1", "--model-name",
                                        "demo-8l", "--ready-file", str(ready)],
                                       stdout=subprocess.DEVNULL, stderr=open(work / f"{agent}.log", "w"))
            processes.append(process)
            workers[agent] = (process, ready)
        ports = {agent: wait_ready(ready, process, agent)["http"] for agent, (process, ready) in workers.items()}

        model = {"architecture": "llama", "layers": 8, "kv_heads": 4, "head_dim": 64, "dtype": "fp32",
                 "weights": f"synthetic:{SHAPE}:1"}
        policy = {
            "schema_version": 1,
            "node": {"id": "demo-node"},
            "listen": {"http": "127.0.0.1:0"},
            "agents": [{"id": agent, "upstream": f"http://127.0.0.1:{port}", "model": model, "kv_connector": True}
                       for agent, port in ports.items()],
            "routes": [{"id": "a-to-b", "from": "agent-a", "to": "agent-b"}],
            "logging": {"level": "warn"},
        }
        (work / "policy.json").write_text(json.dumps(policy, indent=2))
        subprocess.run([str(KVRELAY), "check-config", str(work / "policy.json")], check=True)
        sidecar = subprocess.Popen([str(KVRELAY), "serve", "--config", str(work / "policy.json"), "--ready-file",
                                    str(work / "kvrelay.json")], stderr=open(work / "kvrelay.log", "w"))
        processes.append(sidecar)
        port = wait_ready(work / "kvrelay.json", sidecar, "kvrelay")["http"]

        print(f"\nmodel: synthetic Llama {SHAPE} (fp32, CPU); one kvrelay sidecar on :{port}")
        print("B receives A's prompt + A's 16-token answer + an 8-token follow-up, through the front proxy\n")
        header = f"{'context':>8} {'A ttft ms':>10} {'B prefill tokens':>17} {'B prefill ms':>13} {'B ttft ms':>10} {'B total ms':>11}"
        print(header)
        print("-" * len(header))
        rows = []
        for length in LENGTHS:
            prompt = [1] + [3 + (i * 37) % 500 for i in range(length - 1)]
            a_reply, _ = post(port, "agent-a", {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
            a_output = a_reply["choices"][0]["token_ids"]
            b_prompt = prompt + a_output + FOLLOW_UP
            b_reply, b_total = post(port, "agent-b", {"prompt": b_prompt, "max_tokens": 8, "temperature": 0})
            a_stats, b_stats = a_reply["kvrelay"], b_reply["kvrelay"]
            rows.append((length, b_stats["prefill_ms"]))
            print(f"{length:>8} {a_stats['ttft_ms']:>10.1f} {b_stats['prefill_tokens']:>17} "
                  f"{b_stats['prefill_ms']:>13.1f} {b_stats['ttft_ms']:>10.1f} {b_total:>11.1f}")

        per_token = [ms / length for length, ms in rows]
        print(f"\nverdict: on the tokens medium B re-prefills all of A's context, {min(per_token):.2f}-"
              f"{max(per_token):.2f} ms per token here, growing faster than linearly ({rows[-1][1] / 1000:.1f} s at "
              f"{rows[-1][0]} tokens). That is the work kvrelay's KV media (raw, lossless, int8/int4, delta blocks) "
              f"move over shared memory or TCP instead; the sidecar's metrics below counted every request.")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith("kvrelay_proxy_requests_total"):
                    print("  " + line)
        sidecar.send_signal(signal.SIGTERM)
        print(f"\nkvrelay drained and exited {sidecar.wait(timeout=30)}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)


if __name__ == "__main__":
    main()
