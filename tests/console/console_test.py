#!/usr/bin/env python3
"""The web console (GET /admin/ui, docs/console.md) in a real browser: headless Chromium driven
through the DevTools protocol, against two real sidecars with reference workers behind them.

One case per run (ctest registers each, label `console`):

  page_loads        the page loads from node-b's admin listener with its security headers, asks
                    for the token once, keeps it in sessionStorage, and shows routes, peers, the
                    other node's summary, the KV store and the audit panel; the agent listener
                    does not serve it
  route_toggle      clicking a route's toggle and choosing a forced medium in the page changes
                    GET /admin/routes; a wrong token is refused and the page asks again
  handoff_decision  a real handoff's decision appears in the page with its cost breakdown drawn
                    as a stacked bar per candidate medium
  hostile_text      a route named <img src=x onerror=alert(1)> (served through DevTools' Fetch
                    interception: the policy refuses such an id) and a request id of the same
                    text (a real handoff's X-Request-Id) are shown as text; no image is made of
                    them, no dialog opens, the CSP refuses nothing
  fetch_failure     when the admin listener goes away the page says so and keeps the last data
  older_admin_api   against an admin API without #30's additions (decisions' seq and cursor,
                    since=, /admin/decisions/last, routes' recent_ttft) the page still follows
                    the decision log and takes each route's last medium from it
  screenshot        (not registered) audited handoffs, then a screenshot: --screenshot PATH

Exit 0 passed, 1 failed, 77 skipped (chromium, python3-websocket or stories260K missing; a
failure under CI=true).
"""

import argparse
import base64
import json
import os
import sys
import tempfile
import time
import traceback

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import console_harness as h  # noqa: E402

HOSTILE = "<img src=x onerror=alert(1)>"


def open_console(browser, nodes, token=h.ADMIN_TOKEN):
    """Loads node-b's console and answers its token prompt."""
    browser.navigate(f"http://127.0.0.1:{nodes.node_b.admin_port}/admin/ui")
    browser.wait_for("!document.querySelector('#token-dialog').hidden", "the token prompt")
    browser.type_text("#token-input", token)
    browser.click("#token-save")
    browser.wait_for("document.querySelector('#token-dialog').hidden", "the prompt to close")


def route_row(route):
    return f"#routes-panel tr[data-route={json.dumps(route)}]"


def wait_for_routes(browser):
    browser.wait_for(f"!!document.querySelector('{route_row(h.TwoNodes.ROUTE)}')", "the routes table")


def check_clean(browser):
    h.check(browser.dialogs == [], f"a dialog opened: {browser.dialogs}")
    h.check(browser.exceptions == [], f"the page threw: {browser.exceptions}")
    violations = browser.csp_violations()
    h.check(violations == [], f"the Content-Security-Policy refused: {violations}")


# ---- cases -----------------------------------------------------------------------------------

def case_page_loads(nodes, browser, args):
    port = nodes.node_b.admin_port
    page = h.http(port, "GET", "/admin/ui")
    h.check(page.status == 200, f"GET /admin/ui without a token: {page.status}")
    h.check(page.headers["Content-Type"].startswith("text/html"), page.headers["Content-Type"])
    h.check(page.headers["X-Content-Type-Options"] == "nosniff", "nosniff")
    h.check(page.headers["Referrer-Policy"] == "no-referrer", "no-referrer")
    csp = page.headers["Content-Security-Policy"]
    text = page.body.decode()
    directives = {part.split()[0]: part.split()[1:] for part in csp.split(";") if part.strip()}
    h.check(directives["default-src"] == ["'none'"], csp)
    h.check(directives["script-src"] == h.csp_hashes(text, "script") and len(directives["script-src"]) == 1, csp)
    h.check(directives["style-src"] == h.csp_hashes(text, "style") and len(directives["style-src"]) == 1, csp)
    h.check(directives["connect-src"] == ["'self'"], csp)
    h.check(directives["frame-ancestors"] == ["'none'"] and directives["base-uri"] == ["'none'"], csp)
    h.check(directives["form-action"] == ["'none'"], csp)
    h.check("unsafe" not in csp, csp)
    # The page is the admin listener's only: the agent listener answers 404.
    h.check(h.http(nodes.node_b.http_port, "GET", "/admin/ui").status == 404, "agent listener served /admin/ui")
    listing = h.admin(port, "GET", "/admin").json()["endpoints"]
    row = [e for e in listing if e["path"] == "/admin/ui"]
    h.check(len(row) == 1 and row[0]["access"] == "public" and row[0]["method"] == "GET", f"{row}")

    open_console(browser, nodes)
    wait_for_routes(browser)
    h.check(browser.evaluate("sessionStorage.getItem('kvrelay.admin_token')") == h.ADMIN_TOKEN, "token not kept")
    h.check(browser.evaluate("document.querySelector('#node-id').textContent") == "node node-b", "node id")
    routes = browser.evaluate("[...document.querySelectorAll('#routes-panel tbody tr')].map(r => r.dataset.route)")
    h.check(routes == [h.TwoNodes.ROUTE, "reader-to-writer"], f"routes shown: {routes}")
    # Peers and links: node-a connected over tcp; the other node's own summary.
    browser.wait_for("""(() => { const row = document.querySelector('#peers-panel tr[data-peer="node-a"]');
                                 return row && row.textContent.includes('connected') && row.textContent.includes('tcp'); })()""",
                     "node-a connected in the peers table")
    browser.wait_for("""(() => { const card = document.querySelector('#nodes-panel .node-card[data-peer="node-a"]');
                                 return !!(card && card.textContent.includes('KV store') && card.querySelector('.meter')); })()""",
                     "node-a's summary in the other-nodes panel")
    kv_text = browser.wait_for("""(() => { const t = document.querySelector('#kv-panel .kv-use');
                                            return t && t.textContent; })()""", "the KV store's use")
    budget = h.admin(port, "GET", "/admin/kv").json()["budget_bytes"]
    h.check(" used of " in kv_text and budget > 0, f"KV panel: {kv_text!r}")
    browser.wait_for("document.querySelector('#audit-panel .body').textContent.includes('trials')", "the audit panel")
    h.check(browser.evaluate("document.querySelector('#banner').hidden"), "a fetch failed on a healthy daemon")
    # The token is asked for once: a reload of the page keeps it for this tab.
    before = int(browser.evaluate("document.body.dataset.refreshes || 0"))
    browser.navigate(f"http://127.0.0.1:{port}/admin/ui")
    h.check(browser.evaluate("document.querySelector('#token-dialog').hidden"), "asked for the token again")
    wait_for_routes(browser)
    h.check(before > 0, "no refresh happened before the reload")
    # It refreshes without reloading: the refresh count moves on by itself.
    first = int(browser.wait_for("Number(document.body.dataset.refreshes || 0)", "a refresh"))
    browser.wait_for(f"Number(document.body.dataset.refreshes) >= {first + 2}", "two more refreshes")
    check_clean(browser)
    if args.screenshot:
        browser.screenshot(args.screenshot)


def case_route_toggle(nodes, browser, args):
    route = h.TwoNodes.ROUTE
    open_console(browser, nodes)
    wait_for_routes(browser)
    h.check(nodes.node_b.routes()[route]["enabled"] is True, "route starts enabled")
    toggle = route_row(route) + " input.enabled"
    h.check(browser.evaluate(f"document.querySelector('{toggle}').checked") is True, "toggle shows enabled")
    browser.click(toggle)
    h.wait_until(lambda: nodes.node_b.routes()[route]["enabled"] is False, 10, "GET /admin/routes to say disabled")
    browser.wait_for(f"""!document.querySelector('{toggle}').checked &&
                         !document.querySelector('{toggle}').disabled""", "the toggle to show disabled")
    h.check(nodes.node_b.routes()["reader-to-writer"]["enabled"] is True, "the other route changed too")
    browser.click(toggle)
    h.wait_until(lambda: nodes.node_b.routes()[route]["enabled"] is True, 10, "GET /admin/routes to say enabled")

    # The forced-medium selector: a medium, then back to the engine's choice.
    select = route_row(route) + " select.forced"
    options = browser.evaluate(f"[...document.querySelector('{select}').options].map(o => o.value)")
    h.check(options[0] == "" and "kv_int8" in options and "tokens" in options, f"media offered: {options}")

    def choose(value):
        browser.wait_for(f"!document.querySelector('{select}').disabled", "the selector")
        browser.evaluate(f"""(() => {{ const s = document.querySelector('{select}'); s.focus();
                                       s.value = {json.dumps(value)};
                                       s.dispatchEvent(new Event('change', {{bubbles: true}})); s.blur(); }})()""")
    choose("kv_int8")
    h.wait_until(lambda: nodes.node_b.routes()[route]["forced_medium"] == "kv_int8", 10, "forced_medium kv_int8")
    choose("")
    h.wait_until(lambda: nodes.node_b.routes()[route]["forced_medium"] is None, 10, "forced_medium null")

    # A wrong token: the change is refused (401), the page asks for the token again, and the
    # right one then makes the change.
    browser.evaluate("sessionStorage.setItem('kvrelay.admin_token', 'not-the-admin-token-at-all')")
    browser.navigate(f"http://127.0.0.1:{nodes.node_b.admin_port}/admin/ui")
    wait_for_routes(browser)
    browser.click(toggle)
    browser.wait_for("!document.querySelector('#token-dialog').hidden", "the prompt after a 401")
    h.check("refused" in browser.evaluate("document.querySelector('#token-reason').textContent"), "prompt reason")
    h.check(nodes.node_b.routes()[route]["enabled"] is True, "a wrong token changed the route")
    note = browser.wait_for(f"document.querySelector('{route_row(route)} td.error')?.textContent",
                            "the refusal in the row")
    h.check("401" in note, f"row note: {note!r}")
    browser.type_text("#token-input", h.ADMIN_TOKEN)
    browser.press_enter()
    browser.wait_for("document.querySelector('#token-dialog').hidden", "the prompt to close")
    browser.wait_for(f"document.querySelector('{toggle}').checked", "the toggle to show the route as it is")
    browser.click(toggle)
    h.wait_until(lambda: nodes.node_b.routes()[route]["enabled"] is False, 10, "disabled with the right token")
    check_clean(browser)


def decision_shown(browser, request_id):
    """The decision view whose request id is `request_id`, as {text, costs} once it is shown."""
    return browser.evaluate(f"""(() => {{
        for (const view of document.querySelectorAll('#decisions-panel .decision')) {{
          const ids = [...view.querySelectorAll('.facts .mono')].map(e => e.textContent);
          if (!ids.includes({json.dumps(request_id)})) continue;
          return {{text: view.textContent, kind: view.dataset.kind, seq: view.dataset.seq,
                   route: view.querySelector('.route')?.textContent,
                   medium: view.querySelector('.head .medium')?.textContent,
                   chosen: view.querySelector('.cost-row.chosen')?.dataset.medium,
                   costs: [...view.querySelectorAll('.cost-row')].map(r => ({{
                     medium: r.dataset.medium, segments: r.querySelectorAll('.bar > div').length,
                     widths: [...r.querySelectorAll('.bar > div')].map(s => parseFloat(s.style.width)),
                     eligible: !r.classList.contains('ineligible')}}))}};
        }}
        return null;
    }})()""")


def case_handoff_decision(nodes, browser, args):
    open_console(browser, nodes)
    wait_for_routes(browser)
    browser.wait_for("document.querySelector('#decisions-panel .body').textContent.length > 0", "the decision log")
    request_id = "console-test-handoff-1"
    b = nodes.handoff(request_id=request_id)
    h.check(b["kvrelay"]["cached_tokens"] > 0, f"B imported no KV: {b['kvrelay']}")
    record = [d for d in nodes.node_b.decisions() if d.get("request_id") == request_id]
    h.check(len(record) == 1, f"node-b's log has no lookup of {request_id}")
    record = record[0]
    shown = h.wait_until(lambda: decision_shown(browser, request_id), 20, "the handoff's decision in the page")
    h.check(shown["kind"] == "lookup" and shown["route"] == h.TwoNodes.ROUTE, f"{shown}")
    h.check(shown["medium"] == record["medium"], f"medium {shown['medium']} vs {record['medium']}")
    h.check(record["outcome"] in shown["text"] and "peer:node-a" in shown["text"], shown["text"])
    candidates = record["cost"]["candidates"]
    h.check([c["medium"] for c in shown["costs"]] == [c["medium"] for c in candidates], f"{shown['costs']}")
    h.check(shown["chosen"] == record["cost"]["chosen"], f"chosen {shown['chosen']}")
    # A stacked bar per eligible candidate: one segment per positive cost term, widths in
    # proportion to the seconds, the largest total filling the bar.
    terms = ["c_comm_s", "c_codec_s", "c_comp_s", "c_loss_s", "audit_correction_s"]
    scale = max(sum(max(0.0, c.get(t) or 0.0) for t in terms) for c in candidates if c["eligible"])
    for drawn, candidate in zip(shown["costs"], candidates):
        h.check(drawn["eligible"] == candidate["eligible"], f"{drawn} vs {candidate}")
        if not candidate["eligible"]:
            continue
        positive = [candidate[t] for t in terms if (candidate.get(t) or 0.0) > 0.0]
        h.check(drawn["segments"] == len(positive), f"{drawn} vs {candidate}")
        for width, value in zip(drawn["widths"], positive):
            h.check(abs(width - value / scale * 100.0) < 0.05, f"segment {width}% for {value} s of {scale} s")
    h.check(any(d["segments"] >= 2 for d in shown["costs"]), f"no stacked bar: {shown['costs']}")
    # A second handoff arrives by the cursor without a reload.
    nodes.handoff(request_id="console-test-handoff-2")
    h.wait_until(lambda: decision_shown(browser, "console-test-handoff-2"), 20, "the second decision")
    order = browser.evaluate("""[...document.querySelectorAll('#decisions-panel .decision')]
                                  .map(v => v.textContent.includes('console-test-handoff-2') ? 2 :
                                            v.textContent.includes('console-test-handoff-1') ? 1 : 0).filter(Boolean)""")
    h.check(order == [2, 1], f"newest first: {order}")
    check_clean(browser)


def case_hostile_text(nodes, browser, args):
    # GET /admin/routes and /admin/peers as node-b answers them, plus a route and a peer whose
    # names are markup. The policy refuses such ids (identifiers only), so DevTools' Fetch
    # domain stands in for an API that would return them; the decision below is real.
    def on_paused(params):
        request_id = params["requestId"]
        url = params["request"]["url"]
        if params.get("responseStatusCode") != 200:
            browser.call("Fetch.continueRequest", requestId=request_id)
            return
        body = browser.call("Fetch.getResponseBody", requestId=request_id)
        data = json.loads(base64.b64decode(body["body"]) if body.get("base64Encoded") else body["body"])
        if "/admin/routes" in url:
            data["routes"].append({"id": HOSTILE, "from": HOSTILE, "to": HOSTILE, "enabled": True,
                                   "allowed_media": [HOSTILE], "forced_medium": HOSTILE, "priority": 0,
                                   "audit_fraction": 0, "push": False})
        elif "/admin/peers" in url:
            data["peers"].append({"id": HOSTILE, "address": HOSTILE, "state": HOSTILE, "transport": HOSTILE,
                                  "last_error": HOSTILE, "ucx_lanes": [HOSTILE], "same_host": False,
                                  "node_state": {"store_budget": 1, "store_used": 1}})
        encoded = base64.b64encode(json.dumps(data).encode()).decode()
        browser.call("Fetch.fulfillRequest", requestId=request_id, responseCode=200,
                     responseHeaders=[{"name": "Content-Type", "value": "application/json"}], body=encoded)
    browser.on_request_paused = on_paused
    browser.call("Fetch.enable", patterns=[{"urlPattern": "*/admin/routes", "requestStage": "Response"},
                                           {"urlPattern": "*/admin/peers", "requestStage": "Response"}])
    open_console(browser, nodes)
    browser.wait_for(f"!!document.querySelector('{route_row(HOSTILE)}')", "the hostile route's row")
    nodes.handoff(request_id=HOSTILE)
    h.check(any(d.get("request_id") == HOSTILE for d in nodes.node_b.decisions()), "hostile id not in the log")
    h.wait_until(lambda: decision_shown(browser, HOSTILE), 20, "the decision with the hostile request id")
    browser.wait_for(f"!!document.querySelector('#peers-panel tr[data-peer={json.dumps(HOSTILE)}]')", "the hostile peer")
    browser.pump(1.0)  # a few refreshes with the markup on the page
    shown = browser.evaluate(f"""(() => {{
        const row = document.querySelector('{route_row(HOSTILE)}');
        return {{routeCell: row.querySelector('.route-id').textContent,
                 routeCellChildren: row.querySelector('.route-id').children.length,
                 options: [...row.querySelectorAll('option')].map(o => o.textContent),
                 peerError: document.querySelector('#peers-panel tr[data-peer={json.dumps(HOSTILE)}] .error').textContent,
                 images: [...document.querySelectorAll('img')].map(i => i.className + ' ' + (i.getAttribute('src') || '').slice(0, 20)),
                 bodyText: document.body.textContent.split({json.dumps(HOSTILE)}).length - 1}};
    }})()""")
    h.check(shown["routeCell"] == HOSTILE and shown["routeCellChildren"] == 0, f"route cell: {shown}")
    h.check(HOSTILE in shown["options"], f"forced medium options: {shown['options']}")
    h.check(shown["peerError"] == HOSTILE, f"peer error: {shown['peerError']!r}")
    # The only images are the audit plot's (a data: URL), none made from the markup.
    h.check(all(image.startswith("audit-plot data:image/svg+xml") for image in shown["images"]), f"{shown['images']}")
    h.check(shown["bodyText"] >= 5, f"the markup shown as text {shown['bodyText']} times")
    h.check(browser.evaluate("document.querySelectorAll('img[src=\"x\"], img:not(.audit-plot)').length") == 0,
            "an <img> was made from data")
    check_clean(browser)


def case_fetch_failure(nodes, browser, args):
    open_console(browser, nodes)
    wait_for_routes(browser)
    browser.wait_for("document.querySelector('#peers-panel tr[data-peer=\"node-a\"]') !== null", "the peers table")
    h.check(browser.evaluate("document.querySelector('#banner').hidden"), "banner on a healthy daemon")
    nodes.node_b.process.stop()  # the admin listener the page talks to goes away
    banner = browser.wait_for("(() => { const b = document.querySelector('#banner');"
                              " return !b.hidden && b.textContent; })()", "the failure banner", timeout_s=20)
    h.check("failed" in banner and "unreachable" in banner and "showing the data of" in banner, f"banner: {banner!r}")
    h.check("fetches failed" in browser.evaluate("document.querySelector('#status').textContent"), "status line")
    stale = browser.evaluate("document.querySelector('#routes-panel .stale').textContent")
    h.check("refresh failed" in stale, f"routes panel note: {stale!r}")
    # The last data stays on the page.
    h.check(browser.evaluate(f"!!document.querySelector('{route_row(h.TwoNodes.ROUTE)}')"), "routes dropped")
    h.check(browser.evaluate("!!document.querySelector('#peers-panel tr[data-peer=\"node-a\"]')"), "peers dropped")
    h.check(browser.dialogs == [] and browser.exceptions == [], f"{browser.dialogs} {browser.exceptions}")


def case_older_admin_api(nodes, browser, args):
    # The page against an admin API from before #30's CLI: decisions without seq or cursor (since=
    # refused as an unknown parameter), no GET /admin/decisions/last, routes without a recent
    # TTFT. DevTools' Fetch domain takes those out of node-b's answers.
    def on_paused(params):
        request_id = params["requestId"]
        url = params["request"]["url"]

        def fulfill(status, data):
            browser.call("Fetch.fulfillRequest", requestId=request_id, responseCode=status,
                         responseHeaders=[{"name": "Content-Type", "value": "application/json"}],
                         body=base64.b64encode(json.dumps(data).encode()).decode())
        if "/admin/decisions/last" in url:
            return fulfill(404, {"error": {"message": "no endpoint at /admin/decisions/last", "type": "not_found"}})
        if "since=" in url:
            return fulfill(400, {"error": {"message": "unknown query parameter", "type": "invalid_argument"}})
        if params.get("responseStatusCode") != 200:
            return browser.call("Fetch.continueRequest", requestId=request_id)
        body = browser.call("Fetch.getResponseBody", requestId=request_id)
        data = json.loads(base64.b64decode(body["body"]) if body.get("base64Encoded") else body["body"])
        if "/admin/decisions" in url:
            data.pop("cursor", None)
            data.pop("missed", None)
            for record in data["decisions"]:
                record.pop("seq", None)
        else:
            for route in data["routes"]:
                route.pop("recent_ttft", None)
                route.pop("last_medium", None)
        fulfill(200, data)
    browser.on_request_paused = on_paused
    browser.call("Fetch.enable", patterns=[{"urlPattern": "*/admin/decisions*", "requestStage": "Response"},
                                           {"urlPattern": "*/admin/routes", "requestStage": "Response"}])
    open_console(browser, nodes)
    wait_for_routes(browser)
    nodes.handoff(request_id="older-api-1")
    h.wait_until(lambda: decision_shown(browser, "older-api-1"), 20, "the decision")
    nodes.handoff(request_id="older-api-2")
    h.wait_until(lambda: decision_shown(browser, "older-api-2"), 20, "the second decision, without a reload")
    medium = nodes.node_b.decisions(1)[0]["medium"]
    row = route_row(h.TwoNodes.ROUTE)
    cells = browser.wait_for(f"""(() => {{ const row = document.querySelector('{row}');
        const last = row.querySelector('td:nth-child(5) .medium');
        return last && [last.textContent, row.querySelector('td:nth-child(6)').textContent]; }})()""",
                             "the last medium from the decision log")
    h.check(cells == [medium, "–"], f"last medium and TTFT cells: {cells}")
    h.check(browser.evaluate("document.querySelector('#banner').hidden"), "the older API shows as a failure")
    check_clean(browser)


def case_screenshot(nodes, browser, args):
    # Audited handoffs so that the audit panel has a plot, then one more plain decision.
    open_console(browser, nodes)
    wait_for_routes(browser)
    for index in range(args.handoffs):
        nodes.handoff(request_id=f"req-{index:03d}")
    browser.click("#refresh-now")
    browser.wait_for("!!document.querySelector('#audit-panel img.audit-plot')", "the audit plot", timeout_s=30)
    browser.wait_for("!!document.querySelector('#nodes-panel .node-card .meter')", "the nodes panel")
    browser.pump(2.5)
    browser.screenshot(args.screenshot)
    check_clean(browser)


CASES = {
    "page_loads": case_page_loads,
    "route_toggle": case_route_toggle,
    "handoff_decision": case_handoff_decision,
    "hostile_text": case_hostile_text,
    "fetch_failure": case_fetch_failure,
    "older_admin_api": case_older_admin_api,
    "screenshot": case_screenshot,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--kvrelay", required=True)
    parser.add_argument("--refworker", required=True)
    parser.add_argument("--source-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    parser.add_argument("--work-dir", default=None, help="where the test's processes keep their files")
    parser.add_argument("--screenshot", default=None, help="save a PNG of the page here")
    parser.add_argument("--handoffs", type=int, default=16, help="screenshot: audited handoffs to make first")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args()
    if args.case == "screenshot" and not args.screenshot:
        parser.error("--case screenshot needs --screenshot PATH")
    args.kvrelay, args.refworker = os.path.abspath(args.kvrelay), os.path.abspath(args.refworker)

    chromium = h.find_chromium()
    if not chromium:
        h.skip("chromium not found (Debian package chromium; KVRELAY_CHROMIUM overrides)")
    try:
        import websocket  # noqa: F401
    except ImportError:
        h.skip("python3-websocket not installed")
    model = os.environ.get("KVRELAY_TEST_MODEL") or os.path.join(args.source_dir, "..", "shared", "models",
                                                                  "stories260K.bin")
    if not os.path.exists(model):
        h.skip(f"stories260K.bin not found ({model}; KVRELAY_TEST_MODEL overrides)")

    root = args.work_dir or tempfile.gettempdir()
    os.makedirs(root, exist_ok=True)
    # Short: the sidecars' Unix socket paths must fit sockaddr_un.
    directory = tempfile.mkdtemp(prefix=f"c{os.getpid()}-", dir=root)
    nodes = browser = None
    status = 1
    started = time.monotonic()
    try:
        audit = None
        if args.case == "screenshot":
            audit = {"fraction": 0.5, "treatments": [{"name": "T0", "medium": "tokens", "span": "none"},
                                                     {"name": "T3", "medium": "kv_raw", "span": "all"}]}
        nodes = h.TwoNodes(args.kvrelay, args.refworker, model, directory, audit=audit)
        browser = h.Browser(chromium, directory)
        CASES[args.case](nodes, browser, args)
        status = 0
        print(f"passed: {args.case} ({time.monotonic() - started:.1f} s)")
    except Exception as error:  # noqa: BLE001: any failure fails the test, with what the processes said
        traceback.print_exc()
        print(f"FAILED: {args.case}: {error}")
        for name in ("node-a/kvrelay.log", "node-b/kvrelay.log", "chromium.log"):
            path = os.path.join(directory, name)
            if os.path.exists(path):
                with open(path, errors="replace") as file:
                    print(f"--- {name} (last 40 lines)\n" + "".join(file.readlines()[-40:]))
    finally:
        if browser:
            browser.close()
        if nodes:
            nodes.stop()
        if not args.keep and status == 0:
            import shutil
            shutil.rmtree(directory, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
