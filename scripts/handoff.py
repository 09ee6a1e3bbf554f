"""Agent A -> agent B context handoff on real processes: the orchestration shared by the demo
(scripts/demo.py, the README's main command) and bench/e2e_bench.

Two nodes on loopback. node-a's sidecar fronts agent A and agent B-local (a second worker on the
same node: KV moves over shared memory); node-b's sidecar fronts agent B (KV comes from node-a over
the TCP peer plane, encoded with the route's codec). Every worker is a kvrelay-refworker with the
same synthetic model and its KV connector pointed at its node's sidecar.

For one context length: A answers a prompt; then B gets A's prompt + A's answer + a follow-up with
the route's medium forced to each of tokens, kv_raw, kv_lossless, kv_int8, kv_int4 in turn, then
left to the decision engine; B-local gets the same with kv_raw over shared memory. Before each B
run node-b's KV store is flushed (DELETE /admin/kv) so every medium starts from the same state: A's
KV on node-a, nothing on node-b. Agents talk to each sidecar's agent listener (listen.http); forcing
media, flushing and reloading go to its admin listener (listen.admin), the only place the admin API
answers.

The floor every medium is judged against is the local hit: B's request repeated after B's own
worker computed it, so node-b's store already holds B's whole context and nothing crosses a link
(see `local_hit`).
"""
import json
import os
import pathlib
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

DEMO_SHAPE = "layers=8,dim=512,heads=8,kv_heads=4,ffn=1376,vocab=512,seq_len=4096"
FORCED_MEDIA = ["tokens", "kv_raw", "kv_lossless", "kv_fp8", "kv_int8", "kv_int4"]
FOLLOW_UP = [300, 301, 302, 303, 304, 305, 306, 307]
A_ANSWER_TOKENS = 16
B_ANSWER_TOKENS = 8
BLOCK_TOKENS = 16  # the refworker connector's block size: KV is stored and served in whole blocks


def shape_model(shape):
    fields = dict(item.split("=") for item in shape.split(","))
    heads, dim = int(fields["heads"]), int(fields["dim"])
    return {"architecture": "llama", "layers": int(fields["layers"]), "kv_heads": int(fields["kv_heads"]),
            "head_dim": dim // heads, "dtype": "fp32", "weights": f"synthetic:{shape}:1"}


def http(port, method, path, body=None, timeout=600, token=None):
    """One request; `token` is sent as the admin API's bearer token (changes need it)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode()
    return json.loads(text) if text else {}


def status_of(port, method, path):
    """The HTTP status of one request, error statuses included."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def wait_ready(path, process, what, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.stat().st_size > 0:
            return json.loads(path.read_text())
        if process.poll() is not None:
            sys.exit(f"{what} exited with {process.returncode}; see {path.parent}")
        time.sleep(0.05)
    sys.exit(f"{what} did not start within {timeout} s")


class Cluster:
    """Three workers and two sidecars, torn down on exit."""

    def __init__(self, build, shape=DEMO_SHAPE, memory_strategy=None):
        self.build = pathlib.Path(build)
        self.shape = shape
        # limits.memory_strategy of both sidecars ("portable", "prefault"); None: the binary's default.
        self.memory_strategy = memory_strategy
        self.work = pathlib.Path(tempfile.mkdtemp(prefix="kvrelay-handoff-"))
        self.processes = []
        # The sidecars' admin token (mutating admin endpoints need it), in a file only we can read.
        self.admin_token = secrets.token_hex(32)
        self.admin_token_file = self.work / "admin.token"
        descriptor = os.open(self.admin_token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as token_file:
            token_file.write(self.admin_token + "\n")

    def __enter__(self):
        kvrelay = self.build / "proxy" / "kvrelay"
        refworker = self.build / "refworker" / "kvrelay-refworker"
        sockets = {"node-a": str(self.work / "node-a.sock"), "node-b": str(self.work / "node-b.sock")}
        # Sidecars first: workers connect to their socket when they start.
        peer_ports = {}
        self.sidecar_ports = {}  # agent listeners
        self.admin_ports = {}  # admin listeners
        model = shape_model(self.shape)
        workers = {"agent-a": "node-a", "agent-b-local": "node-a", "agent-b": "node-b"}
        # Worker ports are not known before the workers start, and workers need the sockets: start
        # the sidecars with placeholder upstreams, then reload them with the real ones.
        # Every agent is in one tenant, "demo": both sidecars hold its salt (so its KV crosses
        # nodes) and each signs its front proxy's kvrelay fields with a key of its own
        # (docs/security.md).
        salt_file = self.work / "demo.salt"
        salt_file.write_bytes(os.urandom(32))
        # TLS peers even on loopback, as a cluster runs them: development certificates for both
        # nodes, made with the openssl CLI into the demo's temporary directory.
        certs = self.work / "tls"
        subprocess.run([str(pathlib.Path(__file__).resolve().parent / "make-dev-certs.sh"), str(certs),
                        "node-a", "node-b"], check=True, stdout=subprocess.DEVNULL)
        policies = {}
        for node in ("node-a", "node-b"):
            node_key = self.work / f"{node}.key"
            node_key.write_bytes(os.urandom(32))
            policies[node] = {
                "schema_version": 1,
                "node": {"id": node},
                "listen": {"http": "127.0.0.1:0", "admin": "127.0.0.1:0", "peer": "127.0.0.1:0",
                           "unix_socket": sockets[node]},
                "admin": {"token_file": str(self.admin_token_file)},
                "peers": [],
                "peer_tls": {"certificate": str(certs / f"{node}.pem"), "private_key": str(certs / f"{node}-key.pem"),
                             "ca_bundle": str(certs / "ca.pem")},
                "agents": [],
                "routes": [],
                "limits": {"kv_lookup_timeout_ms": 30000, "peer_summary_interval_ms": 200},
                # Each medium is measured at B's lookup: prefetch would move A's KV before B asks.
                "kv_store": {"prefetch": False},
                "logging": {"level": "warn"},
                "tenants": [{"id": "demo", "salt_file": str(salt_file)}],
                "signing": {"node_key_file": str(node_key)},
            }
            if self.memory_strategy is not None:
                policies[node]["limits"]["memory_strategy"] = self.memory_strategy
            self._write(node, policies[node])
            process = self._spawn(node, [str(kvrelay), "serve", "--config", str(self.work / f"{node}.json"),
                                         "--ready-file", str(self.work / f"{node}.ready")])
            ready = wait_ready(self.work / f"{node}.ready", process, f"kvrelay {node}")
            self.sidecar_ports[node] = ready["http"]
            self.admin_ports[node] = ready["admin"]
            peer_ports[node] = ready["peer"]
        worker_processes = {
            agent: self._spawn(agent, [str(refworker), "serve", "--synthetic", self.shape, "--seed", "1",
                                       "--model-name", "demo", "--ready-file", str(self.work / f"{agent}.ready"),
                                       "--kvrelay-socket", sockets[node]])
            for agent, node in workers.items()}
        worker_ports = {agent: wait_ready(self.work / f"{agent}.ready", process, agent)["http"]
                        for agent, process in worker_processes.items()}
        self.worker_ports = worker_ports
        for node in ("node-a", "node-b"):
            other = "node-b" if node == "node-a" else "node-a"
            policy = policies[node]
            policy["peers"] = [{"id": other, "address": f"127.0.0.1:{peer_ports[other]}",
                                "identity": f"spiffe://kvrelay.dev/node/{other}"}]
            policy["agents"] = [
                {"id": agent, "upstream": f"http://127.0.0.1:{worker_ports[agent]}", "model": model,
                 "kv_connector": True, "metrics_url": f"http://127.0.0.1:{worker_ports[agent]}/metrics",
                 "tenant": "demo",
                 **({} if agent_node == node else {"node": agent_node})}
                for agent, agent_node in workers.items()]
            policy["routes"] = [{"id": "a-to-b", "from": "agent-a", "to": "agent-b"},
                                {"id": "a-to-b-local", "from": "agent-a", "to": "agent-b-local"}]
            self._write(node, policy)
            self.admin(node, "POST", "/admin/reload")
        return self

    def __exit__(self, *exc):
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        return False

    def _write(self, node, policy):
        (self.work / f"{node}.json").write_text(json.dumps(policy, indent=2))

    def _spawn(self, name, argv):
        process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(self.work / f"{name}.log", "w"))
        self.processes.append(process)
        return process

    def complete(self, node, agent, prompt, max_tokens):
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return http(self.sidecar_ports[node], "POST", f"/agents/{agent}/v1/completions", body)

    def complete_on_worker(self, agent, prompt, max_tokens):
        """A completion sent to the agent's worker itself, past its sidecar's front proxy: the
        worker's KV lookup carries no route, so its sidecar serves only what its own store holds
        (no peer fetch, no decision engine, nothing the engine learns from)."""
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return http(self.worker_ports[agent], "POST", "/v1/completions", body)

    def worker_metric(self, agent, name):
        """The sum of one metric's samples on the agent's worker (its Prometheus page)."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.worker_ports[agent]}/metrics")
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "))

    def admin(self, node, method, path, body=None):
        """A request to node's admin API with the admin token."""
        return http(self.admin_ports[node], method, path, body, token=self.admin_token)

    def force(self, node, route, medium):
        self.admin(node, "PUT", f"/admin/routes/{route}", {"forced_medium": medium})

    def flush(self, node):
        self.admin(node, "DELETE", "/admin/kv")

    def admin_only_on_admin_listener(self, node):
        """True when node's admin API answers on its admin listener and is a 404 on its agent one."""
        return (status_of(self.sidecar_ports[node], "GET", "/admin/routes") == 404 and
                status_of(self.admin_ports[node], "GET", "/admin/routes") == 200)

    def admin_changes_need_token(self, node):
        """True when a change through node's admin API without the token is refused (401)."""
        return status_of(self.admin_ports[node], "DELETE", "/admin/kv") == 401

    def last_decision(self, node):
        decisions = http(self.admin_ports[node], "GET", "/admin/decisions?limit=4")["decisions"]
        return next((d for d in decisions if d.get("kind") == "lookup"), {})  # newest first


FETCH_STEPS = ("connect_and_request", "reply_wait", "transfer", "decode", "entry", "join")


def sidecar_phases(decision):
    """The sidecar's side of the lookup phase: its whole Resolve and the peer fetch's steps."""
    phases = {"resolve": decision.get("resolve_ms", 0.0)}
    fetched = next((a for a in decision.get("fetch", []) if a.get("result") == "fetched"), {})
    for step in FETCH_STEPS:
        phases[f"fetch_{step}"] = fetched.get("steps", {}).get(f"{step}_ms", 0.0)
    return phases


def context_prompt(length, seed):
    return [1] + [3 + (index * 37 + seed * 101) % 500 for index in range(length - 1)]


def handoff_prompt(cluster, length, seed):
    """A answers a `length`-token prompt on node-a; B's prompt is A's prompt + answer + follow-up."""
    prompt = context_prompt(length, seed)
    a_reply = cluster.complete("node-a", "agent-a", prompt, A_ANSWER_TOKENS)
    return prompt + a_reply["choices"][0]["token_ids"] + FOLLOW_UP


def warm_up(cluster, length):
    """One discarded handoff of `length` tokens with kv_raw over TCP, and one over shared memory
    on node-a: the sidecars keep their transfer buffers and shared-memory arena between handoffs,
    and each worker maps the arena once (fresh memory and first writes through a new mapping cost
    ~3-4 ms/MiB on this VM), so the first handoffs pay for pages every later one reuses. Measuring
    after them shows running sidecars and workers, not ones that just started."""
    b_prompt = handoff_prompt(cluster, length, 99_999)
    cluster.force("node-b", "a-to-b", "kv_raw")
    cluster.flush("node-b")
    cluster.complete("node-b", "agent-b", b_prompt, 1)
    cluster.flush("node-b")
    cluster.force("node-a", "a-to-b-local", "kv_raw")
    cluster.complete("node-a", "agent-b-local", b_prompt, 1)


def local_hit(cluster, b_prompt, primed=False):
    """B's local hit, the floor every medium is judged against: B's request once more after B's
    own worker computed it, so node-b's store holds B's whole context and nothing crosses a link.
    The refworker keeps no prefix cache of its own (each request starts an empty session and asks
    its sidecar), so a hit is served from its node's store over shared memory: the lookup, the
    import of every whole block of the prompt, and the prefill of the rest (under one block).
    Both requests go to B's worker itself, past the front proxy: the lookup carries no route, so
    node-b serves only what it holds and the decision engine neither decides nor learns anything.
    With `primed` the run before was B's request with medium tokens and node-b's store still holds
    what it published; otherwise node-b is flushed and B's worker computes the prompt first.
    Raises RuntimeError unless the sidecar's lookup, the reply and the worker's
    prefix-cache counter all show the whole-block prefix imported from node-b's own store."""
    if not primed:
        cluster.flush("node-b")
        cluster.complete_on_worker("agent-b", b_prompt, 1)  # publishes every whole block of the prompt
    hits_before = cluster.worker_metric("agent-b", "vllm:prefix_cache_hits_total")
    reply = cluster.complete_on_worker("agent-b", b_prompt, B_ANSWER_TOKENS)
    imported = cluster.worker_metric("agent-b", "vllm:prefix_cache_hits_total") - hits_before
    stats = reply["kvrelay"]
    decision = cluster.last_decision("node-b")
    servable = (len(b_prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    cached = stats.get("cached_tokens", 0)
    if decision.get("outcome") != "hit_local" or cached != servable or imported != cached:
        raise RuntimeError(f"local hit not served from node-b's store: lookup {decision.get('outcome')} "
                           f"({decision.get('reason')}), {cached} of {len(b_prompt)} tokens imported "
                           f"(expected {servable}), worker counted {imported:.0f}")
    return {"ttft_ms": stats["ttft_ms"], "cached_tokens": cached, "prefill_tokens": stats.get("prefill_tokens", 0),
            "phases_ms": {**{phase: stats.get(f"{phase}_ms", 0.0)
                             for phase in ("queue", "lookup", "import", "prefill")},
                          **sidecar_phases(decision)},
            "token_ids": reply["choices"][0]["token_ids"], "medium": decision.get("medium", "kv_raw"),
            "kv_from": decision.get("kv_from"), "worker_prefix_cache_hits": imported,
            "primed_by": "tokens run" if primed else "prime"}


class LengthRun:
    """One context length's handoff on one cluster, run one label at a time: A answers at once,
    then `run(label)` measures B under one medium ("engine": left to the decision engine;
    "kv_raw_shm": B-local over shared memory; "local_hit": see `local_hit`), and `result()`
    returns what `run_length` returns. Lets a caller interleave the runs of several clusters."""

    def __init__(self, cluster, length, seed, with_local_hit=True):
        self.cluster = cluster
        self.length = length
        self.b_prompt = handoff_prompt(cluster, length, seed)
        self.runs = {}
        self.last_on_b = []
        self.node_b_labels = FORCED_MEDIA + ["engine"]
        if with_local_hit:
            self.node_b_labels.insert(1, "local_hit")
        # The tokens run leaves B's whole prompt on node-b when what B's worker published ends in
        # the prompt's last whole block (its answer's KV does not start a new one) -- but in the
        # demo tenant's chain and store scope, which the local hit's requests straight to the
        # worker (no signed kvrelay fields: the default tenant) never reach. So it primes itself.
        self.tokens_run_primes = False

    def order(self, rng=None):
        """Every label once: node-b's (shuffled with `rng`), then B-local's kv_raw_shm."""
        labels = list(self.node_b_labels)
        if rng is not None:
            rng.shuffle(labels)
        return labels + ["kv_raw_shm"]

    def run(self, label):
        if label == "local_hit":
            primed = self.tokens_run_primes and self.last_on_b[-1:] == ["tokens"]
            self.runs[label] = local_hit(self.cluster, self.b_prompt, primed=primed)
            self.last_on_b.append(label)
        elif label == "kv_raw_shm":
            self._run_b(label, "node-a", "agent-b-local", "a-to-b-local", "kv_raw")
        else:
            self._run_b(label, "node-b", "agent-b", "a-to-b", None if label == "engine" else label)

    def _run_b(self, label, node, agent, route, medium):
        cluster = self.cluster
        cluster.force(node, route, medium)
        if node == "node-b":
            cluster.flush("node-b")
            self.last_on_b.append(label)
        reply = cluster.complete(node, agent, self.b_prompt, B_ANSWER_TOKENS)
        stats = reply["kvrelay"]
        decision = cluster.last_decision(node) if medium != "tokens" else {}
        self.runs[label] = {"ttft_ms": stats["ttft_ms"], "cached_tokens": stats.get("cached_tokens", 0),
                            "prefill_tokens": stats.get("prefill_tokens", 0),
                            # Where B's time to first token went: the sidecar's Resolve (choice, fetch,
                            # handoff), loading the prefix into the KV cache, the prefill of the rest.
                            "phases_ms": {**{phase: stats.get(f"{phase}_ms", 0.0)
                                             for phase in ("queue", "lookup", "import", "prefill")},
                                          **sidecar_phases(decision)},
                            "token_ids": reply["choices"][0]["token_ids"],
                            "medium": decision.get("medium", medium) if medium is None else medium}

    def result(self):
        reference = self.runs["tokens"]["token_ids"]
        for run in self.runs.values():
            run["top1_agreement"] = sum(x == y for x, y in zip(run["token_ids"], reference)) / max(1, len(reference))
        return {"length": self.length, "b_prompt_tokens": len(self.b_prompt), "runs": self.runs}


def run_length(cluster, length, seed, rng=None, with_local_hit=True):
    """B's time to first token under every medium for one context length. With `rng` (a
    random.Random) the forced media and the engine's run go in a shuffled order, so neither a
    drift in the machine's load nor a position in the sequence always lands on the same one (the
    engine learns from every handoff measured before it, as it would from live traffic). With
    `with_local_hit` B's local hit (`local_hit`) is measured too, as "local_hit", in the same
    order: unshuffled it follows the tokens run, which leaves node-b holding what it needs."""
    handoff = LengthRun(cluster, length, seed, with_local_hit)
    for label in handoff.order(rng):
        handoff.run(label)
    return handoff.result()
