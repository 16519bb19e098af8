"""An HA pair behind a real router in proxy mode (issue 12, item 5): real broker processes, a
real router process, unmodified python-qpid-proton clients.

The pair is simulated with two brokers that share a node id: broker A runs; broker B's data
directory gets a copy of A's ``node.id`` and B starts only after A is SIGKILLed — B then serves
A's node id at its own address, as a backup that activated would. A third broker C is a target
on its own. The router's static pool names B as ``backup-of = "a"``; ``check-period`` is long
(5 s) and ``quorum-timeout`` covers the failover.

* keys cached on A's node id wait while the pair fails over (``failover_waits``; the pair's
  state is ``failing_over``) and none is re-placed on C (routing log, cache);
* the first clients after the kill meet dead A; that failure marks A not ready and re-probes it
  at once (``upstream_marked_down``), and the client is routed again (``connect-retries``): it
  waits with the pair's other keys and is served by B, never seeing the failure; the pair's
  members are then probed fast, so the keys reach B well under one check-period after the kill;
* afterwards the keys still name A's node id and land on B; C's keys stay on C.

Run with ``workers = 1`` and ``workers = 2`` (the worker's upstream failure reaches the
supervisor's prober over the control channel).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from tests.serverproc import free_ports
from proton import ConnectionException, Timeout
from proton.utils import BlockingConnection

from tests.brokerproc import BrokerProcess, USERS_FILE, start_broker, write_config
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

CHECK_PERIOD_MS = 5000
QUORUM_TIMEOUT_MS = 20000
CLIENT = {"allowed_mechs": "PLAIN", "allow_insecure_mechs": True, "user": "app", "password": "app"}


def _router_toml(tmp: Path, a, b_port: int, b_mgmt: str, c, workers: int, *, policy: str = "CONSISTENT_HASH",
                 cache: bool = True, pool_extra: tuple[str, ...] = ()) -> str:
    lines = ['name = "r"', f"users-file = {toml_str(USERS_FILE)}", f"workers = {workers}",
             "[management]", "port = 0", 'user = "admin"', 'password = "admin"',
             "[routing-log]", f"path = {toml_str(tmp / 'logs' / 'routing.log')}",
             "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
             "connect-timeout-ms = 2000",
             "[routers.main]", 'key-type = "CLIENT_ID"',
             "[routers.main.policy]", f'name = "{policy}"',
             *(["[routers.main.cache]"] if cache else []),
             "[routers.main.pool]", *pool_extra, f"check-period = {CHECK_PERIOD_MS}",
             f"quorum-timeout = {QUORUM_TIMEOUT_MS}", 'username = "admin"', 'password = "admin"',
             "[[routers.main.pool.targets]]", 'name = "a"', 'host = "127.0.0.1"', f"port = {a.port}",
             f"management-url = {toml_str(a.management_url)}",
             "[[routers.main.pool.targets]]", 'name = "a-backup"', 'backup-of = "a"',
             'host = "127.0.0.1"', f"port = {b_port}", f"management-url = {toml_str(b_mgmt)}",
             "[[routers.main.pool.targets]]", 'name = "c"', 'host = "127.0.0.1"', f"port = {c.port}",
             f"management-url = {toml_str(c.management_url)}"]
    return "\n".join(lines) + "\n"


def _pool(router) -> dict:
    status, body = router.get("/api/v1/routers/main/pool")
    assert status == 200, body
    return body


def _target(router, name: str) -> dict:
    return next(t for t in _pool(router)["targets"] if t["name"] == name)


def _cache(router) -> dict[str, str]:
    status, page = router.get("/api/v1/routers/main/cache?limit=1000")
    assert status == 200, page
    return {e["key"]: e["node_id"] for e in page["entries"]}


def _router_counters(router) -> dict[str, int]:
    status, body = router.get("/api/v1/counters")
    assert status == 200, body
    return body["routers"]["main"]


def _connect(router, key: str, timeout: float = 10) -> str:
    """Open a proxied connection with container-id ``key``; the node id its broker announces."""
    conn = BlockingConnection(router.url("proxy"), container_id=key, timeout=timeout, **CLIENT)
    try:
        return conn.conn.remote_properties["node-id"]
    finally:
        conn.close()


def _route_lines(tmp: Path) -> list[dict]:
    out = []
    for path in sorted((tmp / "logs").glob("routing*.log")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in out if line["event"] == "route"]


def _pair_and_other(tmp_path: Path, procs: list):
    """A and C running; B (not started) with A's node id at its own ports: the pair's backup.
    Returns ``(a, b, c, b_amqp_port, b_management_url)``."""
    a = start_broker(tmp_path, name="a")
    c = start_broker(tmp_path, name="c")
    procs += [a, c]
    b_amqp, b_mgmt_port = free_ports(2)
    b_path = write_config(tmp_path / "b", name="b", config={"acceptors.amqp": {"port": b_amqp},
                                                            "management": {"port": b_mgmt_port}})
    (tmp_path / "b" / "data").mkdir(parents=True)
    shutil.copy(a.data_dir / "node.id", tmp_path / "b" / "data" / "node.id")
    b = BrokerProcess(tmp_path / "b", b_path)
    procs.append(b)
    return a, b, c, b_amqp, f"http://127.0.0.1:{b_mgmt_port}"


@pytest.mark.parametrize("workers", [1, 2])
def test_keys_follow_their_pair_to_the_backup_without_moving_to_another_broker(tmp_path, procs, workers):
    a, b, c, b_amqp, b_mgmt = _pair_and_other(tmp_path, procs)
    x, z = a.node_id, c.node_id

    rdir = tmp_path / "router"
    router = start_router(rdir, _router_toml(rdir, a, b_amqp, b_mgmt, c, workers), expect=2)
    procs.append(router)
    wait_for(lambda: _pool(router)["ready"] == 2, 20)
    pool = _pool(router)
    assert pool["total"] == 2 and pool["pairs"][0]["state"] == "serving"
    assert pool["pairs"][0]["serving"] == "a" and pool["pairs"][0]["node_id"] == x

    # place keys: some on the pair (A's node id), some on C
    landed = {f"k{i}": _connect(router, f"k{i}") for i in range(24)}
    on_x = [k for k, n in landed.items() if n == x][:4]
    on_z = [k for k, n in landed.items() if n == z][:2]
    assert len(on_x) == 4 and len(on_z) == 2, landed
    assert all(_cache(router)[k] == x for k in on_x)

    # kill A right after its probe, so the first clients meet it while it still counts as ready
    seen = _target(router, "a")["last_probe_at"]
    wait_for(lambda: _target(router, "a")["last_probe_at"] != seen, CHECK_PERIOD_MS / 1000 + 10, interval_s=0.01)
    a.kill()
    killed = time.monotonic()

    results: dict[str, tuple[float, str]] = {}
    errors: dict[str, list[str]] = {k: [] for k in on_x}

    def client(key: str) -> None:
        deadline = time.monotonic() + QUORUM_TIMEOUT_MS / 1000 + 20
        while time.monotonic() < deadline:  # a client that retries on a refusal, as apps do
            try:
                node = _connect(router, key, timeout=QUORUM_TIMEOUT_MS / 1000 + 10)
            except (ConnectionException, Timeout) as exc:
                errors[key].append(str(exc))
                continue
            results[key] = (time.monotonic(), node)
            return

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in on_x]
    for t in threads:
        t.start()

    # the pair fails over: its keys wait (nobody re-places them), A was marked down by the
    # failed upstream connect, not by its next probe (5 s away)
    wait_for(lambda: _router_counters(router)["failover_waits"] >= 1, 10, interval_s=0.02)
    assert _router_counters(router)["upstream_marked_down"] >= 1
    assert _pool(router)["pairs"][0]["state"] == "failing_over"
    assert not results
    b.start()                                      # the backup activates with A's node id
    started = time.monotonic()
    for t in threads:
        t.join(QUORUM_TIMEOUT_MS / 1000 + 30)
    assert set(results) == set(on_x), (results, errors)
    assert all(node == x for _, node in results.values())   # A is dead: node id X is B
    first = min(at for at, _ in results.values())
    print(f"kill -> first proxied connection via the backup: {first - killed:.3f} s "
          f"(B started {started - killed:.3f} s after the kill; check-period {CHECK_PERIOD_MS} ms)")
    assert first - killed < CHECK_PERIOD_MS / 1000 / 2
    assert first - started < 1.5
    # the clients that met dead A were routed again and waited for B: none saw a refusal
    assert not any(errors.values()), errors
    assert router.get("/api/v1/counters")[1]["edge"]["upstream_retried"] >= 1

    pool = _pool(router)
    assert pool["pairs"][0]["state"] == "serving" and pool["pairs"][0]["serving"] == "a-backup"
    assert _target(router, "a-backup")["ready"] and not _target(router, "a")["ready"]
    counters = _router_counters(router)
    assert counters["failover_wait_timeouts"] == 0
    # after the failover: the keys still name the pair's node id and land on B; C keeps its own
    cache = _cache(router)
    assert all(cache[k] == x for k in on_x), cache
    for k in on_x:
        conn = BlockingConnection(router.url("proxy"), container_id=k, timeout=10, **CLIENT)
        try:
            assert any(cn["container_id"] == k for cn in b.management_get("/api/v1/connections")[1])
        finally:
            conn.close()
    assert all(_connect(router, k) == z for k in on_z)

    # none of the pair's keys was ever sent to C (routing log: every decision for them)
    def logged():
        lines = [ln for ln in _route_lines(rdir) if ln["key_filtered"] in on_x]
        served = [ln for ln in lines if ln["action"] == "proxied" and ln["target_name"] == "a-backup"]
        return lines if len(served) >= 2 * len(on_x) else None
    lines = wait_for(logged, 10)
    assert {ln["target_name"] for ln in lines} <= {"a", "a-backup"}, lines
    assert not [ln for ln in lines if ln["target_node_id"] == z or ln["cache"] == "stale"
                and ln["outcome"] == "OK"], lines
    # the failed-over decisions waited for the pair, then hit the cache on its node id
    failover = [ln for ln in lines if ln["action"] == "proxied" and ln["target_name"] == "a-backup"]
    assert all(ln["cache"] == "hit" and ln["target_node_id"] == x for ln in failover), failover
    assert router.terminate() == 0
    assert "Traceback" not in router.stderr_text(), router.stderr_text()
    assert "pair a (node id " in router.stderr_text() and "is failing over" in router.stderr_text()


def test_first_element_new_clients_wait_for_the_pair_so_it_is_not_held(tmp_path, procs):
    """A two-site pool whose first site is an HA pair (docs/site-failover.md): FIRST_ELEMENT, no
    cache, allow-failback = false. New clients that arrive while the pair fails over wait for its
    backup instead of going to the second site, so nothing is diverted and the pair is not held."""
    a, b, c, b_amqp, b_mgmt = _pair_and_other(tmp_path, procs)
    x = a.node_id
    rdir = tmp_path / "router"
    router = start_router(rdir, _router_toml(rdir, a, b_amqp, b_mgmt, c, 1, policy="FIRST_ELEMENT", cache=False,
                                             pool_extra=("allow-failback = false",
                                                         f"state-path = {toml_str(rdir / 'held.json')}")),
                          expect=2)
    procs.append(router)
    wait_for(lambda: _pool(router)["ready"] == 2, 20)
    assert all(_connect(router, f"before-{i}") == x for i in range(3))      # FIRST_ELEMENT: the pair
    a.kill()
    results: dict[str, str] = {}

    def client(key: str) -> None:
        results[key] = _connect(router, key, timeout=QUORUM_TIMEOUT_MS / 1000 + 10)

    threads = [threading.Thread(target=client, args=(f"new-{i}",), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    wait_for(lambda: _router_counters(router)["failover_waits"] >= 1, 10, interval_s=0.02)
    assert not results and _pool(router)["pairs"][0]["state"] == "failing_over"
    b.start()                                      # the backup activates with A's node id
    for t in threads:
        t.join(QUORUM_TIMEOUT_MS / 1000 + 30)
    assert results == {f"new-{i}": x for i in range(4)}, results             # all on the backup, none on C
    pool = _pool(router)
    assert pool["held"] == {} and pool["pairs"][0]["serving"] == "a-backup", pool
    assert _connect(router, "after") == x
