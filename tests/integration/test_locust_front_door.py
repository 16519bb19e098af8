"""Locust through the front door: ``loadtest/locustfile.py`` headless against a real deployment.

Three real broker processes (``tests/brokerproc.py``), a real router (``tests/routerproc.py``)
with an ``auto``, a ``proxy`` and a ``redirect`` acceptor, and ``locust`` itself in a subprocess
(gevent monkey-patches the process it runs in, so it never runs inside pytest). Every Locust
request is written with a wall-clock timestamp to an events file (``--events-file``); each test
fails on any failed request outside its scenario's window:

* steady load — no failure at all, and every step of every user succeeded;
* a broker killed under load (``kill -9`` by this test, at a moment it records) — failures only
  within one ``check-period`` (+ a scheduling margin) after the kill;
* a connection storm at start-up, the router started before its brokers (quorum gate) — no
  failure once the quorum is reached;
* Redis (the router's cache backend) killed under load — no failure at all.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.brokerproc import BrokerProcess, write_config, write_users_file
from tests.routerproc import start_router, toml_str
from tests.serverproc import REPO
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
CHECK_PERIOD_MS = 1000
# A failed step may begin up to one check-period after the kill (until the probe marks the broker
# not ready), plus this much for the probe itself and scheduling on a busy 2-core machine.
MARGIN_S = 0.5
RUN_S = 10


def _users(tmp: Path) -> Path:
    """etc/users.toml's users (admin/admin, app/app) with a cheap scrypt cost: the run measures
    the front door, not password hashing (each proxied login is hashed by router and broker)."""
    return write_users_file(tmp / "users.toml", {"admin": ("admin", ["admin"]), "app": ("app", ["app"])})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broker(tmp: Path, name: str) -> BrokerProcess:
    """A broker on fixed ports chosen now (so the router's config can name it before it runs)."""
    path = write_config(tmp / name, name=name, users_file=_users(tmp),
                        config={"acceptors.amqp": {"port": _free_port()}, "management": {"port": _free_port()}})
    return BrokerProcess(tmp / name, path)


def _ports(b: BrokerProcess) -> tuple[int, int]:
    text = b.config_path.read_text()
    amqp = int(text.split("[acceptors.amqp]", 1)[1].split("port = ", 1)[1].split()[0])
    mgmt = int(text.split("[management]", 1)[1].split("port = ", 1)[1].split()[0])
    return amqp, mgmt


def _router_toml(tmp: Path, brokers: list[BrokerProcess], *, quorum_size: int = 1, quorum_timeout_ms: int = 3000,
                 cache: str = "") -> str:
    lines = [f"users-file = {toml_str(_users(tmp))}", "[management]", "port = 0", 'user = "admin"',
             'password = "admin"', "[routing-log]", f"path = {toml_str(tmp / 'routing.log')}",
             "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "CONSISTENT_HASH"',
             "[routers.main.cache]", cache or "timeout = 0",
             "[routers.main.pool]", f"check-period = {CHECK_PERIOD_MS}", f"quorum-size = {quorum_size}",
             f"quorum-timeout = {quorum_timeout_ms}", 'username = "admin"', 'password = "admin"']
    for b in brokers:
        amqp, mgmt = _ports(b)
        lines += ["[[routers.main.pool.targets]]", f"name = {toml_str(b.workdir.name)}", 'host = "127.0.0.1"',
                  f"port = {amqp}", f'management-url = "http://127.0.0.1:{mgmt}"']
    for name, mode in (("auto", "auto"), ("proxy", "proxy"), ("redirect", "redirect")):
        lines += ["[[acceptors]]", f'name = "{name}"', 'host = "127.0.0.1"', "port = 0", 'router = "main"',
                  f'mode = "{mode}"', 'sasl-mechanisms = ["PLAIN"]', "idle-timeout-s = 0"]
    return "\n".join(lines) + "\n"


def _start_all(brokers: list[BrokerProcess]) -> None:
    errors: list[BaseException] = []

    def go(b):
        try:
            b.start()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(b,)) for b in brokers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _ready(router) -> int:
    status, body = router.get("/api/v1/routers/main/pool")
    return body["ready"] if status == 200 else -1


class Run:
    """One headless Locust run in a subprocess; ``events`` are the JSON lines it wrote."""

    def __init__(self, tmp: Path, router, scenario: str, users: int, spawn_rate: int, seconds: int = RUN_S,
                 classes: tuple[str, ...] = ("RedirectUser", "ProxyUser", "LookupUser")):
        self.dir = tmp / f"locust-{scenario}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.events_path = self.dir / "events.jsonl"
        cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(users),
               "-r", str(spawn_rate), "-t", f"{seconds}s", "--host", router.url("auto"),
               "--proxy-url", router.url("proxy"), "--redirect-url", router.url("auto"),
               "--management-url", router.management_url, "--scenario", scenario,
               "--events-file", str(self.events_path), "--csv", str(self.dir / "stats"),
               "--stop-timeout", "5", "--loglevel", "WARNING", "--only-summary", *classes]
        self.started = time.time()
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONWARNINGS": ""})
        LIVE.append(self)

    def wait(self) -> str:
        out, _ = self.proc.communicate(timeout=RUN_S + 40)
        self.output = out.decode(errors="replace")
        assert "Traceback" not in self.output, self.output
        assert self.proc.returncode in (0, 1), self.output  # 1 = some request failed: judged below
        return self.output

    def note(self, record: dict) -> None:
        """What the test saw (kill / quorum time), beside the events, for a human to read."""
        (self.dir / "harness.json").write_text(json.dumps(record, indent=1))

    @property
    def events(self) -> list[dict]:
        if not self.events_path.exists():
            return []
        out = []
        for line in self.events_path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:  # the line Locust is writing right now
                assert self.proc.poll() is None, f"bad events line: {line!r}"
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=10)

    def successes_after(self, t: float) -> int:
        return sum(1 for e in self.events if "ok" in e and e["ok"] and e["t"] > t)

    def failures(self) -> list[dict]:
        return [e for e in self.events if "ok" in e and not e["ok"]]

    def steps_ok(self) -> set[tuple[str, str]]:
        return {(e["type"], e["name"]) for e in self.events if e.get("ok")}

    def stats_csv_failures(self) -> int:
        import csv

        with (self.dir / "stats_stats.csv").open() as fh:
            rows = list(csv.DictReader(fh))
        return int(next(r for r in rows if r["Name"] == "Aggregated")["Failure Count"])


ALL_STEPS = {("redirect", "redirect"), ("round trip", "redirect"), ("close", "redirect"),
             ("connect", "proxy"), ("round trip", "proxy"), ("close", "proxy"),
             ("lookup", "lookup"), ("connect", "lookup"), ("round trip", "lookup"), ("close", "lookup")}


LIVE: list[Run] = []


@pytest.fixture(autouse=True)
def _no_locust_left():
    """A test that failed before its run ended leaves no Locust process behind."""
    yield
    while LIVE:
        LIVE.pop().kill()


def _outside(failures: list[dict], start: float, end: float) -> list[dict]:
    """Failures whose step ended before ``start`` or began after ``end`` (a step's ``t`` is when it
    ended, ``ms`` how long it took: a step that was under way at the kill may fail later)."""
    return [f for f in failures if f["t"] < start or f["t"] - f["ms"] / 1000 > end]


@pytest.fixture(scope="module")
def brokers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("locust-brokers")
    bs = [_broker(tmp, f"b{i}") for i in (1, 2, 3)]
    _start_all(bs)
    yield bs
    for b in bs:
        b.kill()


def _counters(router) -> dict:
    status, body = router.get("/api/v1/counters")
    assert status == 200, body
    return body["routers"]["main"]


def _router(tmp: Path, brokers, **kw):
    router = start_router(tmp / "router", _router_toml(tmp, brokers, **kw), expect=4)
    return router


def _stop(router) -> None:
    status = router.terminate()
    assert "Traceback" not in router.stderr_text(), router.stderr_text()
    assert status == 0, router.stderr_text()


def test_steady_then_a_broker_killed_under_load(tmp_path, brokers):
    router = _router(tmp_path, brokers)
    try:
        wait_for(lambda: _ready(router) == 3, 20)
        steady = Run(tmp_path, router, "steady", users=9, spawn_rate=9)
        steady.wait()
        assert steady.failures() == [], steady.failures()[:5]
        assert steady.stats_csv_failures() == 0
        assert steady.steps_ok() >= ALL_STEPS, ALL_STEPS - steady.steps_ok()

        run = Run(tmp_path, router, "broker-kill", users=9, spawn_rate=9)
        wait_for(lambda: run.successes_after(run.started) >= 30, 15)
        killed_at = time.time()
        brokers[1].kill()
        run.wait()
        run.note({"killed_at": killed_at, "failures": run.failures()})
        window_end = killed_at + CHECK_PERIOD_MS / 1000 + MARGIN_S
        bad = _outside(run.failures(), killed_at, window_end)
        assert bad == [], f"failures outside [{killed_at:.3f}, {window_end:.3f}]: {bad[:5]}"
        assert run.successes_after(window_end) >= 30  # the load went on with two brokers
    finally:
        _stop(router)


def test_connection_storm_behind_the_quorum_gate(tmp_path):
    bs = [_broker(tmp_path, f"s{i}") for i in (1, 2, 3)]
    router = _router(tmp_path, bs, quorum_size=2, quorum_timeout_ms=3000)
    try:
        assert _ready(router) == 0
        run = Run(tmp_path, router, "storm", users=15, spawn_rate=15)
        # The storm hits a router with no broker ready: wait until it has (Locust's own start-up
        # takes from a fraction of a second to several on a busy machine), then start the brokers.
        wait_for(lambda: run.proc.poll() is None and _counters(router)["quorum_waits"] >= 5, 30, interval_s=0.02)
        _start_all(bs)
        wait_for(lambda: _ready(router) >= 2, 20, interval_s=0.02)
        quorum_at = time.time()
        run.wait()
        counters = _counters(router)
        run.note({"quorum_at": quorum_at, "failures": run.failures(), "counters": counters})
        assert counters["quorum_waits"] >= 5, counters  # the storm did meet the gate (and went on)
        bad = [f for f in run.failures() if f["t"] > quorum_at]
        assert bad == [], f"refused after the quorum was reached at {quorum_at:.3f}: {bad[:5]}"
        assert run.successes_after(quorum_at) >= 30
        assert run.steps_ok() >= ALL_STEPS, ALL_STEPS - run.steps_ok()
    finally:
        _stop(router)
        for b in bs:
            b.kill()


@pytest.mark.redis
def test_redis_killed_under_load(tmp_path, brokers):
    import redis
    from routing_cache_helpers import RedisServer

    redis_server = RedisServer(tmp_path)
    try:
        router = _router(tmp_path, brokers, cache=f'timeout = 0\nbackend = "redis"\nredis-url = "{redis_server.url}"')
        try:
            wait_for(lambda: _ready(router) >= 2, 20)
            run = Run(tmp_path, router, "redis-kill", users=9, spawn_rate=9)
            wait_for(lambda: run.successes_after(run.started) >= 30, 15)
            client = redis.Redis(port=redis_server.port, decode_responses=True)
            try:  # the router's decisions for the Locust users' keys are in Redis
                wait_for(lambda: len(client.keys("lodestone:main:locust-*")) >= 3, 10)
            finally:
                client.close()
            killed_at = time.time()
            redis_server.kill()
            wait_for(lambda: _counters(router).get("redis_errors", 0) >= 1, 10)  # Redis was asked after the kill
            run.wait()
            run.note({"killed_at": killed_at, "failures": run.failures()})
            assert run.failures() == [], run.failures()[:5]
            assert run.successes_after(killed_at + 1) >= 30
            assert run.steps_ok() >= ALL_STEPS, ALL_STEPS - run.steps_ok()
        finally:
            _stop(router)
    finally:
        redis_server.kill()
