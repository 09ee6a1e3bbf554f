"""A real kvrelay sidecar process for the connector's tests (KVRELAY_BIN names the binary)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

# The stand-in model every test engine runs: what agents[].model says and the connector's
# kv_connector_extra_config.weights names.
MODEL = {"architecture": "llama", "layers": 4, "kv_heads": 4, "head_dim": 32, "dtype": "fp16",
         "weights": "standin-tiny"}


def kvrelay_binary() -> str:
    path = os.environ.get("KVRELAY_BIN")
    if not path:
        raise RuntimeError("KVRELAY_BIN must name the kvrelay binary (ctest sets it)")
    return path


def agent(agent_id: str, node: str | None = None, model: dict | None = None, tp_size: int = 1) -> dict:
    entry = {"id": agent_id, "upstream": "http://127.0.0.1:9", "model": model or MODEL, "kv_connector": True}
    if node:
        entry["node"] = node
    if tp_size > 1:
        entry["tensor_parallel_size"] = tp_size
    return entry


class Sidecar:
    """`kvrelay serve` with a data-plane socket in a temporary directory."""

    def __init__(self, node_id: str = "node-a", agents: list | None = None, routes: list | None = None,
                 peers: list | None = None, limits: dict | None = None, peer_listener: bool = False,
                 kv_store: dict | None = None):
        self.node_id = node_id
        self._dir = tempfile.TemporaryDirectory(prefix=f"kvrelay-{node_id}-")
        self.dir = Path(self._dir.name)
        self.socket = str(self.dir / "kvrelay.sock")
        listen = {"http": "127.0.0.1:0", "admin": "127.0.0.1:0", "unix_socket": self.socket}
        if peer_listener:
            listen["peer"] = "127.0.0.1:0"
        token = self.dir / "admin.token"
        token.write_text("kvrelay-vllm-test-admin-token\n")
        self.policy = {
            "schema_version": 1,
            "node": {"id": node_id},
            "listen": listen,
            "admin": {"token_file": str(token)},
            "agents": agents if agents is not None else [agent("writer"), agent("reader")],
            "routes": routes if routes is not None else [],
            "peers": peers or [],
            "limits": {"kv_lookup_timeout_ms": 3000, "peer_summary_interval_ms": 200, **(limits or {})},
            "logging": {"level": "warn"},
        }
        if kv_store is not None:
            self.policy["kv_store"] = kv_store
        self.process: subprocess.Popen | None = None
        self.ports: dict = {}

    def start(self) -> "Sidecar":
        (self.dir / "policy.json").write_text(json.dumps(self.policy, indent=2))
        ready = self.dir / "ready.json"
        if ready.exists():
            ready.unlink()
        if getattr(self, "_stderr", None):
            self._stderr.close()
        self._stderr = open(self.dir / "stderr.log", "ab")
        self.process = subprocess.Popen(
            [kvrelay_binary(), "serve", "--config", str(self.dir / "policy.json"), "--ready-file", str(ready)],
            cwd=self.dir, stdout=subprocess.DEVNULL, stderr=self._stderr)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if ready.exists() and ready.stat().st_size > 0:
                try:
                    self.ports = json.loads(ready.read_text())
                    return self
                except json.JSONDecodeError:
                    pass
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"sidecar {self.node_id} did not start: {self.stderr()}")

    def stderr(self) -> str:
        path = self.dir / "stderr.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def pause(self, paused: bool = True) -> None:
        """SIGSTOP (a sidecar that is alive and answers nothing) or SIGCONT."""
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if getattr(self, "_stderr", None):
            self._stderr.close()

    def close(self) -> None:
        self.stop()
        self._dir.cleanup()

    def peer_address(self) -> str:
        return f"127.0.0.1:{self.ports['peer']}"

    def admin(self, path: str) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{self.ports['admin']}{path}",
                                         headers={"Authorization": "Bearer kvrelay-vllm-test-admin-token"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            return json.loads(reply.read())

    def metrics(self) -> str:
        request = urllib.request.Request(f"http://127.0.0.1:{self.ports['admin']}/metrics",
                                         headers={"Authorization": "Bearer kvrelay-vllm-test-admin-token"})
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.read().decode()
