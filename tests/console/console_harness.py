"""What the web console's browser tests stand on (tests/console/console_test.py, docs/console.md).

Real processes only: two `kvrelay serve` sidecars peered over loopback, a reference worker
(stories260K) behind each, as tests/support/kv_path_fixture.h starts them for the C++ tests, and
headless Chromium driven through the DevTools protocol with Debian's python3-websocket.

Skips exit 77, which ctest reports as skipped (SKIP_RETURN_CODE); under CI=true a missing
dependency fails instead, as tests/support/skip.h does for the C++ tests.
"""

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

SKIP_EXIT_CODE = 77
ADMIN_TOKEN = "kvrelay-console-test-admin-token-5e2b91"


class TestFailure(Exception):
    pass


def skip(reason):
    """Leaves the test as skipped, or fails it under CI=true (CI installs every dependency)."""
    if os.environ.get("CI", "").lower() in ("true", "1"):
        print(f"FAILED: cannot skip under CI=true: {reason} (scripts/install-deps.sh, ../shared/models)")
        sys.exit(1)
    print(f"skipped: {reason}")
    sys.exit(SKIP_EXIT_CODE)


def check(condition, message):
    if not condition:
        raise TestFailure(message)


def wait_until(predicate, timeout_s, what, interval_s=0.1):
    """predicate() until it returns something truthy, which is returned; fails after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last_error = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except TestFailure as error:
            last_error = error
        if time.monotonic() > deadline:
            raise TestFailure(f"timed out after {timeout_s} s waiting for {what}" +
                              (f" (last: {last_error})" if last_error else ""))
        time.sleep(interval_s)


# ---- HTTP ------------------------------------------------------------------------------------

class HttpReply:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)


def http(port, method, path, body=None, headers=None, timeout_s=60):
    data = None
    all_headers = dict(headers or {})
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        all_headers.setdefault("Content-Type", "application/json")
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method, headers=all_headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return HttpReply(response.status, response.headers, response.read())
    except urllib.error.HTTPError as error:
        return HttpReply(error.code, error.headers, error.read())


def admin(port, method, path, body=None):
    return http(port, method, path, body, {"Authorization": f"Bearer {ADMIN_TOKEN}"})


# ---- processes -------------------------------------------------------------------------------

class Process:
    def __init__(self, argv, directory, name):
        self.name = name
        self.log_path = os.path.join(directory, f"{name}.log")
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(argv, cwd=directory, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)

    def running(self):
        return self.popen.poll() is None

    def log(self):
        with open(self.log_path, "rb") as file:
            return file.read().decode(errors="replace")

    def stop(self, sig=signal.SIGTERM):
        if self.running():
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()


def wait_for_ready_file(path, process, timeout_s):
    wait_until(lambda: os.path.exists(path) or not process.running(), timeout_s, f"{process.name} to start")
    if not os.path.exists(path):
        raise TestFailure(f"{process.name} did not start:\n{process.log()}")
    # Written whole by rename or in one write; retry a torn read once.
    for _ in range(20):
        try:
            with open(path) as file:
                return json.load(file)
        except json.JSONDecodeError:
            time.sleep(0.05)
    raise TestFailure(f"unreadable ready file {path}")


class Refworker:
    def __init__(self, binary, model, socket_path, directory, name):
        self.dir = os.path.join(directory, name)
        os.makedirs(self.dir)
        ready = os.path.join(self.dir, "ready.json")
        self.process = Process([binary, "serve", "--model", model, "--ready-file", ready, "--kvrelay-socket", socket_path],
                               self.dir, name)
        self.port = wait_for_ready_file(ready, self.process, 60)["http"]


class Sidecar:
    """A `kvrelay serve` with a Unix-socket data plane, a peer listener and the test admin token."""

    def __init__(self, binary, node_id, directory):
        self.binary = binary
        self.node_id = node_id
        self.dir = os.path.join(directory, node_id)
        os.makedirs(self.dir)
        self.socket_path = os.path.join(self.dir, "kvrelay.sock")
        self.process = None
        self.http_port = self.admin_port = self.peer_port = 0
        with open(os.path.join(self.dir, "admin.token"), "w") as file:
            file.write(ADMIN_TOKEN + "\n")

    def write_policy(self, policy):
        policy = dict(policy)
        policy.setdefault("admin", {"token_file": os.path.join(self.dir, "admin.token")})
        with open(os.path.join(self.dir, "policy.json"), "w") as file:
            json.dump(policy, file, indent=2)

    def start(self, policy):
        self.write_policy(policy)
        ready = os.path.join(self.dir, "ready.json")
        self.process = Process([self.binary, "serve", "--config", os.path.join(self.dir, "policy.json"),
                                "--ready-file", ready], self.dir, "kvrelay")
        ports = wait_for_ready_file(ready, self.process, 20)
        self.http_port, self.admin_port, self.peer_port = ports["http"], ports["admin"], ports["peer"]

    def reload(self, policy):
        self.write_policy(policy)
        reply = admin(self.admin_port, "POST", "/admin/reload")
        check(reply.status == 200, f"reload of {self.node_id}: {reply.status} {reply.body!r}")

    def complete(self, agent, body, headers=None):
        reply = http(self.http_port, "POST", f"/agents/{agent}/v1/completions", body, headers)
        check(reply.status == 200, f"completion by {agent}: {reply.status} {reply.body!r}")
        return reply.json()

    def routes(self):
        reply = admin(self.admin_port, "GET", "/admin/routes")
        check(reply.status == 200, f"GET /admin/routes: {reply.status}")
        return {route["id"]: route for route in reply.json()["routes"]}

    def decisions(self, limit=20):
        reply = admin(self.admin_port, "GET", f"/admin/decisions?limit={limit}")
        check(reply.status == 200, f"GET /admin/decisions: {reply.status}")
        return reply.json()["decisions"]


def stories_model_json():
    return {"architecture": "llama", "layers": 5, "kv_heads": 4, "head_dim": 8, "dtype": "fp32", "weights": "stories260K"}


def agent_json(agent_id, node, upstream_port):
    agent = {"id": agent_id, "upstream": f"http://127.0.0.1:{upstream_port}", "model": stories_model_json(),
             "kv_connector": True}
    if node:
        agent["node"] = node
    return agent


def sidecar_policy(sidecar, agents, routes, peers):
    return {"schema_version": 1,
            "node": {"id": sidecar.node_id},
            "listen": {"http": "127.0.0.1:0", "admin": "127.0.0.1:0", "peer": "127.0.0.1:0",
                       "unix_socket": sidecar.socket_path},
            "peers": peers,
            "agents": agents,
            "routes": routes,
            "limits": {"kv_lookup_timeout_ms": 5000, "peer_summary_interval_ms": 200},
            "kv_store": {"prefetch": False},
            "logging": {"level": "warn"}}


def context_prompt(seed, length=200):
    return [1] + [3 + (index * 37 + seed * 101) % 500 for index in range(1, length)]


def greedy(prompt, max_tokens, ignore_eos=False):
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos}


class TwoNodes:
    """A writer agent behind node-a's sidecar, a reader behind node-b's, peered over loopback: a
    handoff from writer to reader makes node-b fetch the writer's KV from node-a (route
    writer-to-reader), which node-b's decision log records with its cost breakdown."""

    ROUTE = "writer-to-reader"

    def __init__(self, kvrelay, refworker, model, directory, audit=None):
        self.processes = []
        self.node_a = Sidecar(kvrelay, "node-a", directory)
        self.node_b = Sidecar(kvrelay, "node-b", directory)
        self.writer = Refworker(refworker, model, self.node_a.socket_path, directory, "writer")
        self.processes.append(self.writer.process)
        self.reader = Refworker(refworker, model, self.node_b.socket_path, directory, "reader")
        self.processes.append(self.reader.process)
        route = {"id": self.ROUTE, "from": "writer", "to": "reader"}
        if audit:
            route["audit"] = audit
        self.routes = [route, {"id": "reader-to-writer", "from": "reader", "to": "writer", "priority": 1}]
        self.a_agents = [agent_json("writer", "", self.writer.port), agent_json("reader", "node-b", 1)]
        self.b_agents = [agent_json("writer", "node-a", 1), agent_json("reader", "", self.reader.port)]
        # Ports are the kernel's: node-a starts with a placeholder for node-b and learns its
        # address by reload once node-b listens.
        self.node_a.start(sidecar_policy(self.node_a, self.a_agents, self.routes, self._peer("node-b", 1)))
        self.processes.append(self.node_a.process)
        self.node_b.start(sidecar_policy(self.node_b, self.b_agents, self.routes,
                                         self._peer("node-a", self.node_a.peer_port)))
        self.processes.append(self.node_b.process)
        self.node_a.reload(sidecar_policy(self.node_a, self.a_agents, self.routes,
                                          self._peer("node-b", self.node_b.peer_port)))
        self.seed = 0

    @staticmethod
    def _peer(peer_id, port):
        return [{"id": peer_id, "address": f"127.0.0.1:{port}"}]

    def handoff(self, request_id=None, answer_tokens=8):
        """A answers, then B gets A's prompt, A's answer and a follow-up: B's sidecar decides."""
        self.seed += 1
        a_prompt = context_prompt(self.seed)
        a = self.node_a.complete("writer", greedy(a_prompt, 20, True))
        check(a["kvrelay"]["published_tokens"] >= 200, f"A published {a['kvrelay']}")
        b_prompt = a_prompt + a["choices"][0]["token_ids"] + [300, 301, 302, 303, 304]
        headers = {"X-Request-Id": request_id} if request_id else None
        return self.node_b.complete("reader", greedy(b_prompt, answer_tokens), headers)

    def stop(self):
        for process in reversed(self.processes):
            process.stop()


# ---- Chromium over the DevTools protocol -------------------------------------------------------

def find_chromium():
    """$KVRELAY_CHROMIUM when set (only it), else Debian's chromium; None when not there."""
    override = os.environ.get("KVRELAY_CHROMIUM")
    candidates = [override] if override else [shutil.which("chromium"), "/usr/bin/chromium"]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


class Browser:
    """One headless Chromium with a fresh profile, and a DevTools session on its page."""

    def __init__(self, chromium, directory, width=1440, height=1000):
        import websocket  # python3-websocket; the caller checked that it imports

        self.profile = tempfile.mkdtemp(prefix="chromium-", dir=directory)
        argv = [chromium, "--headless=new", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                "--disable-extensions", "--disable-background-networking", "--disable-sync",
                "--disable-component-update", "--password-store=basic", "--use-mock-keychain", "--mute-audio",
                f"--user-data-dir={self.profile}", "--remote-debugging-port=0", f"--window-size={width},{height}",
                "about:blank"]
        if os.geteuid() == 0:
            argv.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self.process = Process(argv, directory, "chromium")
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        wait_until(lambda: os.path.exists(port_file) and open(port_file).read().count("\n") >= 1
                   or not self.process.running(), 30, "Chromium's DevTools port")
        if not self.process.running():
            raise TestFailure(f"Chromium did not start:\n{self.process.log()}")
        port = int(open(port_file).read().split("\n")[0])
        targets = wait_until(lambda: [t for t in json.loads(http(port, "GET", "/json/list").body)
                                      if t.get("type") == "page"], 10, "a page target")
        self.ws = websocket.create_connection(targets[0]["webSocketDebuggerUrl"], timeout=60, suppress_origin=True,
                                              enable_multithread=False)
        self.next_id = 0
        self.replies = {}     # answers that arrived while another call waited
        self.dialogs = []     # Page.javascriptDialogOpening: any dialog is a failure in these tests
        self.exceptions = []  # Runtime.exceptionThrown: the page's own uncaught errors
        self.console_errors = []
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Log.enable")
        self.call("Network.enable")
        # Records what the Content-Security-Policy refused, from before the page's first script.
        self.call("Page.addScriptToEvaluateOnNewDocument", source="""
            window.__cspViolations = [];
            document.addEventListener('securitypolicyviolation', (event) => {
              window.__cspViolations.push(event.violatedDirective + ' ' + event.blockedURI + ' ' + event.sample);
            });""")

    def _handle(self, message):
        method = message.get("method")
        params = message.get("params", {})
        if method == "Page.javascriptDialogOpening":
            self.dialogs.append(params)
            # A dialog blocks the page's scripts: dismiss it so that the test can go on and fail.
            self.next_id += 1
            self.ws.send(json.dumps({"id": self.next_id, "method": "Page.handleJavaScriptDialog",
                                     "params": {"accept": False}}))
        elif method == "Runtime.exceptionThrown":
            self.exceptions.append(params.get("exceptionDetails", {}))
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            self.console_errors.append(params["entry"])
        elif method == "Fetch.requestPaused" and self.on_request_paused:
            self.on_request_paused(params)

    on_request_paused = None

    def call(self, method, **params):
        self.next_id += 1
        call_id = self.next_id
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while call_id not in self.replies:
            message = json.loads(self.ws.recv())
            if "method" in message:
                self._handle(message)  # which may make calls of its own (Fetch interception)
            elif "id" in message:
                self.replies[message["id"]] = message
        message = self.replies.pop(call_id)
        if "error" in message:
            raise TestFailure(f"{method}: {message['error']}")
        return message.get("result", {})

    def pump(self, seconds):
        """Reads events for `seconds` (a dialog or a paused request is handled as it comes)."""
        deadline = time.monotonic() + seconds
        self.ws.settimeout(0.05)
        try:
            while time.monotonic() < deadline:
                try:
                    message = json.loads(self.ws.recv())
                except Exception:  # websocket's timeout
                    continue
                if "method" in message:
                    self._handle(message)
                elif "id" in message:
                    self.replies[message["id"]] = message
        finally:
            self.ws.settimeout(60)

    def evaluate(self, expression):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise TestFailure(f"evaluating {expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression, what, timeout_s=20):
        def probe():
            self.pump(0.05)
            return self.evaluate(expression)
        return wait_until(probe, timeout_s, what, interval_s=0.1)

    def navigate(self, url):
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", f"{url} to load")

    def click(self, selector):
        """A real mouse click at the element's centre, after scrolling it into view."""
        point = self.evaluate(f"""(() => {{
            const element = document.querySelector({json.dumps(selector)});
            if (!element) return null;
            element.scrollIntoView({{block: 'center'}});
            const box = element.getBoundingClientRect();
            return [box.x + box.width / 2, box.y + box.height / 2];
        }})()""")
        check(point is not None, f"no element {selector}")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=point[0], y=point[1], button="left", clickCount=1)

    def type_text(self, selector, text):
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def press_enter(self):
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter", windowsVirtualKeyCode=13)

    def screenshot(self, path, width=1440):
        height = self.evaluate("Math.ceil(document.documentElement.scrollHeight)")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=min(int(height), 4000),
                  deviceScaleFactor=1, mobile=False)
        self.evaluate("window.scrollTo(0, 0)")
        self.pump(0.3)
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        with open(path, "wb") as file:
            file.write(base64.b64decode(shot["data"]))
        self.call("Emulation.clearDeviceMetricsOverride")

    def csp_violations(self):
        return self.evaluate("window.__cspViolations || []")

    def close(self):
        try:
            self.ws.close()
        except Exception:
            pass
        self.process.stop()
        shutil.rmtree(self.profile, ignore_errors=True)


def csp_hashes(page, tag):
    """'sha256-…' of every inline <tag> block, as a browser computes them for the CSP."""
    blocks = re.findall(rf"<{tag}>(.*?)</{tag}>", page, flags=re.S)
    return ["'sha256-" + base64.b64encode(hashlib.sha256(block.encode()).digest()).decode() + "'" for block in blocks]
