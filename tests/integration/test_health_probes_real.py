"""Health probes as Artemis runs them (issue 8, item 5), with a real router process.

* Each target has its own periodic probe task (Artemis ``TargetMonitor``: fixed delay, initial
  delay 0): a management endpoint that accepts and never answers costs only its own probes
  their timeout; the real broker beside it keeps its cadence.
* LEAST_CONNECTIONS: a target whose probe gives no connection count is not ready (Artemis's
  ``UPDATE_CONNECTION_COUNT_PROBE`` fails when ``broker.ConnectionCount`` cannot be read); other
  policies do not need the count.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest

from tests.brokerproc import start_broker, write_users_file
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin-pw", ["admin"])}
PERIOD_MS = 500  # probe timeout = min(period, 2 s) = 0.5 s


class SilentServer:
    """Accepts connections and never answers; records when each was accepted."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[float] = []
        self.held: list[socket.socket] = []
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop:
            try:
                c, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(time.monotonic())
            self.held.append(c)

    def close(self) -> None:
        self.stop = True
        self.thread.join(5)
        for c in self.held:
            c.close()
        self.sock.close()


class NoCountHandler(http.server.BaseHTTPRequestHandler):
    """A broker management endpoint that is active but reports no connection count."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = json.dumps({"node_id": "no-count-node", "active": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("health-probes")
    users = write_users_file(tmp / "users.toml", USERS)
    broker = start_broker(tmp, name="b1", users_file=users)
    silent = SilentServer()
    nocount = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoCountHandler)
    threading.Thread(target=nocount.serve_forever, daemon=True).start()
    nocount_url = f"http://127.0.0.1:{nocount.server_address[1]}"

    def router(name, policy, targets):
        out = [f"[routers.{name}]", 'key-type = "CLIENT_ID"', f"[routers.{name}.policy]", f'name = "{policy}"',
               f"[routers.{name}.pool]", f"check-period = {PERIOD_MS}", "quorum-timeout = 0",
               'username = "admin"', 'password = "admin-pw"']
        for tname, url in targets:
            out += [f"[[routers.{name}.pool.targets]]", f'name = "{tname}"', 'host = "127.0.0.1"',
                    f"port = {broker.port}", f"management-url = {toml_str(url)}"]
        return out + ["[[acceptors]]", f'name = "{name}"', "port = 0", f'router = "{name}"']

    text = "\n".join([
        f"users-file = {toml_str(users)}", "[management]", "port = 0", "[routing-log]", "enabled = false",
        *router("slow", "FIRST_ELEMENT", [("b1", broker.management_url),
                                          ("silent", f"http://127.0.0.1:{silent.port}")]),
        *router("lc", "LEAST_CONNECTIONS", [("b1", broker.management_url), ("nocount", nocount_url)]),
        *router("fe", "FIRST_ELEMENT", [("nocount", nocount_url), ("b1", broker.management_url)]),
    ]) + "\n"
    r = start_router(tmp / "router", text, expect=4, auth=("admin", "admin-pw"))
    try:
        yield r, silent
    finally:
        status = r.terminate()
        broker.kill()
        silent.close()
        nocount.shutdown()
        nocount.server_close()
        assert status == 0, r.stderr_text()


def targets(router, name) -> dict[str, dict]:
    status, body = router.get(f"/api/v1/routers/{name}/pool")
    assert status == 200, body
    return {t["name"]: t for t in body["targets"]}


def test_a_hung_management_endpoint_does_not_slow_the_healthy_brokers_probes(env):
    router, silent = env
    wait_for(lambda: targets(router, "slow")["b1"]["ready"], 10)
    window = 4.0
    t0 = targets(router, "slow")
    start = time.monotonic()
    time.sleep(window)   # the thing under test: how many probes each target gets in this window
    t1 = targets(router, "slow")
    elapsed = time.monotonic() - start
    healthy = t1["b1"]["probes"] - t0["b1"]["probes"]
    hung = t1["silent"]["probes"] - t0["silent"]["probes"]
    assert not t1["silent"]["ready"] and "timeout" in t1["silent"]["last_error"]
    assert t1["b1"]["ready"]
    # own fixed delay: one probe per ~0.5 s (+ its latency); in one shared round it would be
    # one per 1 s (the hung target's 0.5 s timeout + 0.5 s), i.e. about 4 in this window
    assert healthy >= 0.75 * elapsed / (PERIOD_MS / 1000), (healthy, hung, elapsed)
    # the hung target's own cadence: timeout + period ≈ 1 s
    assert hung <= elapsed / 1.0 + 1, (healthy, hung)
    gaps = [b - a for a, b in zip(silent.accepted[-4:], silent.accepted[-3:])]
    assert all(g >= 0.9 for g in gaps), gaps


def test_least_connections_target_without_a_count_is_not_ready(env):
    router, _ = env
    wait_for(lambda: targets(router, "lc")["b1"]["ready"], 10)
    wait_for(lambda: targets(router, "lc")["nocount"]["probes"] >= 2, 10)
    t = targets(router, "lc")
    assert t["nocount"]["ready"] is False
    assert t["nocount"]["last_error"] == "probe gave no connection count (LEAST_CONNECTIONS needs one)"
    assert isinstance(t["b1"]["connection_count"], int)
    for i in range(5):
        assert router.target_for("lc", f"k{i}")["target"]["name"] == "b1"
    # FIRST_ELEMENT does not need the count: the same endpoint is ready there, and first
    wait_for(lambda: targets(router, "fe")["nocount"]["ready"], 10)
    assert router.target_for("fe", "k")["target"]["name"] == "nocount"
