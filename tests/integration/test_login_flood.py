"""A wrong-password login flood cannot starve good clients (issue: "no client can hurt the others").

Real processes: a broker node, a router in proxy mode in front of it, and the flood
(``loadtest/login_flood.py``, its own process) from 127.0.0.2 … 127.0.0.11 — hundreds of
concurrent connections, each sending SASL PLAIN with a fresh wrong password, reconnecting as
soon as it is answered. The good client (unmodified python-qpid-proton, from 127.0.0.1) measures
before and during the flood:

* connect + send (one message, settled) with a login the node has verified before,
* the same with a first login (a user never seen by the process: a real scrypt verification),
* the broker's durable-send acknowledgement time on an open connection,

and each median during the flood stays within 2x its baseline. The baseline is measured before
the flood and again after it (the flood process killed): two shared cores also carry the
machine's own noise (the previous test's processes ending, the kernel), and a stretch of it that
spans the flood shows in the second baseline too, so the larger of the two is the reference; a
node still slow after the flood is checked separately. The users file keeps the
production scrypt cost (n = 16384), so every flood attempt that is verified costs what it would
in production. The router's health probe must keep the flooded broker ready throughout.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import start_broker
from tests.routerproc import start_router, toml_str
from tests.serverproc import REPO, http_json, metric_by_label
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

FLOOD_SOURCES = ",".join(f"127.0.0.{i}" for i in range(2, 12))   # 10 sources
FLOOD_PER_SOURCE = 25                                            # 250 concurrent connections
FRESH_USERS = 24


@pytest.fixture(autouse=True)
def lean_client(monkeypatch, tmp_path):
    """Every proton ``Container`` (one per ``BlockingConnection``) loads the system CA store for
    its SSL domains: ~100 ms of the client's own CPU per connection, unrelated to these plain
    connections, which would dominate (and, on two shared cores, blur) what the servers take.
    An empty trust store makes the client measure the servers."""
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "no-ca.pem"))
    monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path))


@pytest.fixture(scope="module")
def users(tmp_path_factory) -> Path:
    """A users file at the production scrypt cost: app, admin, and fresh users for first logins."""
    from broker.wire.io.users import hash_password

    lines = []
    entries = {"app": ("app-pw", ["app"]), "admin": ("admin-pw", ["admin"]),
               **{f"fresh{i}": (f"fresh-pw-{i}", ["app"]) for i in range(FRESH_USERS)}}
    for name, (password, roles) in entries.items():
        lines += [f"[users.{name}]", f"password = {json.dumps(hash_password(password))}",
                  f"roles = {json.dumps(roles)}", ""]
    lines += ["[[permissions]]", 'match = "#"', 'send = ["admin", "app"]', 'consume = ["admin", "app"]',
              'create-address = ["admin", "app"]', 'manage = ["admin"]', ""]
    path = tmp_path_factory.mktemp("flood-users") / "users.toml"
    path.write_text("\n".join(lines))
    return path


class _Fresh:
    def __init__(self):
        self.i = 0

    def next(self) -> tuple[str, str]:
        i = self.i
        self.i += 1
        assert i < FRESH_USERS, "out of fresh users"
        return f"fresh{i}", f"fresh-pw-{i}"


def _connect_and_send(url: str, user: str, password: str) -> float:
    t0 = time.perf_counter()
    conn = BlockingConnection(url, timeout=30, user=user, password=password, allowed_mechs="PLAIN")
    try:
        snd = conn.create_sender("flood.good")
        snd.send(Message(body="hello", durable=False))
    finally:
        conn.close()
    return time.perf_counter() - t0


def _durable_ack_times(url: str, n: int) -> list[float]:
    conn = BlockingConnection(url, timeout=30, user="app", password="app-pw", allowed_mechs="PLAIN")
    try:
        snd = conn.create_sender("flood.durable")
        times = []
        for i in range(n):
            t0 = time.perf_counter()
            snd.send(Message(body=f"m{i}", durable=True))   # returns when the broker settled it
            times.append(time.perf_counter() - t0)
        return times
    finally:
        conn.close()


def _measure(url: str, fresh: _Fresh, *, seen: int = 15, first: int = 5, durable: int | None = 0) -> dict:
    _connect_and_send(url, "app", "app-pw")    # this login is now known to the node
    out = {"seen": statistics.median(_connect_and_send(url, "app", "app-pw") for _ in range(seen)),
           "first": statistics.median(_connect_and_send(url, *fresh.next()) for _ in range(first))}
    if durable:
        out["durable"] = statistics.median(_durable_ack_times(url, durable))
    return out


class Flood:
    """loadtest/login_flood.py in its own process."""

    def __init__(self, port: int, duration_s: float):
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "loadtest" / "login_flood.py"), "--port", str(port),
             "--sources", FLOOD_SOURCES, "--concurrency", str(FLOOD_PER_SOURCE),
             "--duration-s", str(duration_s), "--user", "app", "--unknown-share", "0.2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self) -> dict:
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def _logins(metrics_text: str, prefix: str) -> dict[str, float]:
    return metric_by_label(metrics_text, prefix)


def _within_2x(before: dict, during: dict, after: dict) -> list[str]:
    """What was more than twice as slow during the flood as without it (the larger of the two
    baselines), and what stayed more than 3x as slow once the flood had ended."""
    slow = []
    for k in before:
        baseline = max(before[k], after[k])
        if during[k] > 2 * baseline:
            slow.append(f"{k}: {during[k] * 1000:.1f} ms during the flood vs {before[k] * 1000:.1f} ms "
                        f"before and {after[k] * 1000:.1f} ms after")
        if after[k] > 3 * before[k]:
            slow.append(f"{k}: {after[k] * 1000:.1f} ms after the flood vs {before[k] * 1000:.1f} ms before")
    return slow


def _router_text(users: Path, broker) -> str:
    return "\n".join([
        f"users-file = {toml_str(users)}", "[management]", "port = 0", 'user = "admin"', 'password = "admin"',
        "[routing-log]", "enabled = false",
        "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
        "idle-timeout-s = 60",
        "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
        "[routers.main.pool]", "check-period = 250", 'username = "admin"', 'password = "admin-pw"',
        "[[routers.main.pool.targets]]", 'name = "b1"', 'host = "127.0.0.1"', f"port = {broker.port}",
        f"management-url = {toml_str(broker.management_url)}", ""])


def test_broker_login_flood_leaves_good_clients_and_acks_alone(tmp_path, users):
    broker = start_broker(tmp_path, users_file=users)
    router = start_router(tmp_path / "router", _router_text(users, broker), expect=2, auth=("admin", "admin"))
    fresh = _Fresh()
    try:
        wait_for(lambda: _target_ready(router), timeout_s=20)
        baseline = _measure(broker.amqp_url, fresh, durable=40)
        flood = Flood(broker.port, duration_s=40)
        ready_samples: list[bool] = []
        stop = threading.Event()

        def watch_ready():
            while not stop.is_set():
                ready_samples.append(_target_ready(router))
                time.sleep(0.1)   # pacing the samples, not a wait

        watcher = threading.Thread(target=watch_ready, daemon=True)
        try:
            # the flood is under way once the broker has refused a good number of its logins
            wait_for(lambda: _broker_logins(broker).get("login_failed", 0) >= 100, timeout_s=30)
            watcher.start()
            during = _measure(broker.amqp_url, fresh, durable=40)
            counts = _broker_logins(broker)
        finally:
            stop.set()
            flood.stop()
        watcher.join(5)
        after = _measure(broker.amqp_url, fresh, durable=40)
        slow = _within_2x(baseline, during, after)
        print(f"broker flood: before {baseline}, during {during}, after {after}, logins {counts}")
        assert not slow, f"{slow}; before {baseline}, during {during}, after {after}; logins {counts}"
        assert ready_samples and all(ready_samples), \
            f"the router marked the flooded broker not ready in {ready_samples.count(False)} of {len(ready_samples)} probes"
        _assert_no_password_logged(broker, router)
        # the flood was refused, throttled, and never verified more than the gate allows
        assert counts["login_failed"] >= 100
        assert counts["login_refused_throttled"] > 0
        assert counts["login_ok_verified"] >= 5 + 5 + 1    # the good client's first logins went through
    finally:
        router.terminate()
        broker.terminate()


def test_router_login_flood_leaves_good_clients_alone(tmp_path, users):
    broker = start_broker(tmp_path, users_file=users)
    router = start_router(tmp_path / "router", _router_text(users, broker), expect=2, auth=("admin", "admin"))
    fresh = _Fresh()
    try:
        wait_for(lambda: _target_ready(router), timeout_s=20)
        url = router.url("proxy")
        baseline = _measure(url, fresh)
        flood = Flood(router.port("proxy"), duration_s=40)
        try:
            wait_for(lambda: _router_logins(router).get("login_failed", 0) >= 100, timeout_s=30)
            during = _measure(url, fresh)
            counts = _router_logins(router)
        finally:
            flood.stop()
        after = _measure(url, fresh)
        slow = _within_2x(baseline, during, after)
        print(f"router flood: before {baseline}, during {during}, after {after}, logins {counts}")
        assert not slow, f"{slow}; before {baseline}, during {during}, after {after}; logins {counts}"
        assert counts["login_refused_throttled"] > 0
        # the flood never reached the broker: the router refused it at its own door
        assert _broker_logins(broker).get("login_failed", 0) == 0
        _assert_no_password_logged(broker, router)
    finally:
        router.terminate()
        broker.terminate()


def _target_ready(router) -> bool:
    status, body = router.get("/api/v1/routers/main/pool")
    assert status == 200, body
    return any(t["ready"] for t in body["targets"])


def _broker_logins(broker) -> dict[str, float]:
    status, text = http_json(broker.management_url + "/metrics", auth=("admin", "admin-pw"), timeout_s=10)
    return _logins(text if isinstance(text, str) else "", "lodestone_broker_logins_total")


def _router_logins(router) -> dict[str, float]:
    status, text = http_json(router.urls["management"] + "/metrics", auth=("admin", "admin"), timeout_s=10)
    return _logins(text if isinstance(text, str) else "", "lodestone_router_logins_total")


def _assert_no_password_logged(*servers) -> None:
    """Neither the flood's passwords (``wrong-<hex>``) nor the good ones appear in any log."""
    for server in servers:
        text = server.stderr_text()
        for secret in ("wrong-", "app-pw", "fresh-pw", "admin-pw"):
            assert secret not in text, f"{secret!r} in {server.config_path.name}'s log"
