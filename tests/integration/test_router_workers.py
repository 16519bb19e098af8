"""``workers = 2`` behaves as one router: real router processes (a supervisor and two SO_REUSEPORT
workers) in front of three real brokers, real AMQP clients (proton).

* a filter PUT through management applies to every worker before the PUT returns;
* ROUND_ROBIN + sticky cache: one client id lands on one broker whichever worker accepts it;
* a router restart keeps stickiness (embedded persisted cache, one writer: the supervisor);
* kill -9 of a worker: the supervisor restarts it (with the current filters), serving continues.

Every check that "both workers" did something reads the per-worker counters of
``/api/v1/counters`` (``per_worker``) and the workers' routing logs ``routing-w<i>.log``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from router.client import _open_once
from tests.brokerproc import USERS_FILE, start_broker
from tests.routerproc import RouterProcess, start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

AUTH = ("ops", "ops-pw")
CLIENT = {"timeout": 15, "allowed_mechs": "PLAIN", "user": "admin", "password": "admin"}


@pytest.fixture(scope="module")
def brokers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("workers-brokers")
    bs = [start_broker(tmp, name=f"wb{i}") for i in (1, 2, 3)]
    try:
        yield bs
    finally:
        for b in bs:
            b.kill()


def _toml(tmp: Path, brokers, *, workers: int = 2) -> str:
    lines = ['name = "w"', f"users-file = {toml_str(USERS_FILE)}", f"workers = {workers}",
             "[management]", "port = 0", f"user = {toml_str(AUTH[0])}", f"password = {toml_str(AUTH[1])}",
             "[routing-log]", f"path = {toml_str(tmp / 'logs' / 'routing.log')}",
             "[[acceptors]]", 'name = "redir"', "port = 0", 'router = "rr"', 'mode = "redirect"',
             "[routers.rr]", 'key-type = "CLIENT_ID"',
             "[routers.rr.policy]", 'name = "ROUND_ROBIN"',
             "[routers.rr.cache]", "persisted = true", f"path = {toml_str(tmp / 'cache' / 'rr.log')}",
             "[routers.rr.local-target]", 'name = "local"', 'host = "127.0.0.1"', f"port = {brokers[0].port}",
             "[routers.rr.pool]", "check-period = 500", "quorum-timeout = 0",
             'username = "admin"', 'password = "admin"']
    for i, b in enumerate(brokers):
        lines += ["[[routers.rr.pool.targets]]", f'name = "b{i}"', 'host = "127.0.0.1"', f"port = {b.port}",
                  f"management-url = {toml_str(b.management_url)}"]
    return "\n".join(lines) + "\n"


def _start(tmp: Path, brokers) -> RouterProcess:
    r = start_router(tmp, _toml(tmp, brokers), expect=2, auth=AUTH)
    wait_for(lambda: r.get("/api/v1/routers/rr/pool")[1]["ready"] == 3, 20)
    return r


def redirected_port(router: RouterProcess, container_id: str) -> int:
    """Connect with this container id; return the port the router redirected us to."""
    conn, cond = _open_once(router.url("redir"), {**CLIENT, "container_id": container_id})
    if conn is not None:
        conn.close()
        raise AssertionError("the router did not redirect")
    return int(cond.info["port"])


def per_worker(router: RouterProcess) -> dict[int, dict]:
    status, body = router.get("/api/v1/counters")
    assert status == 200, body
    assert body["workers"] == 2
    return {w["worker"]: w for w in body["per_worker"]}


def route_lines(tmp: Path, worker: int) -> list[dict]:
    path = tmp / "logs" / f"routing-w{worker}.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_logged(tmp: Path, predicate, timeout_s: float = 10.0) -> dict[int, list[dict]]:
    """Routing lines per worker, once ``predicate(lines_by_worker)`` holds (logs flush every 0.5 s)."""
    return wait_for(lambda: {w: route_lines(tmp, w) for w in (0, 1)}, timeout_s, until=predicate,
                    what="the routing lines")


def test_a_filter_put_applies_to_every_worker_before_it_returns(tmp_path, brokers):
    r = _start(tmp_path, brokers)
    try:
        before = per_worker(r)
        status, body = r.request("PUT", "/api/v1/routers/rr/key-filter", {"key_filter": "^[a-z]+"})
        assert status == 200, body
        assert body == {"key_filter": "^[a-z]+", "applied_workers": [0, 1], "failed_workers": []}
        status, body = r.request("PUT", "/api/v1/routers/rr/local-target-filter", {"local_target_filter": "^loc"})
        assert status == 200 and body["applied_workers"] == [0, 1], body
        assert r.request("PUT", "/api/v1/routers/rr/key-filter", {"key_filter": "(bad"})[0] == 400
        # "shard-<n>" all filter to "shard": one broker for all (the shared cache agrees), and
        # "loc<n>" all match the local-target filter: the local target (broker 0)
        shard = {redirected_port(r, f"shard-{n}") for n in range(40)}
        local = {redirected_port(r, f"loc{n}") for n in range(20)}
        assert len(shard) == 1 and local == {brokers[0].port}, (shard, local)
        after = per_worker(r)
        for w in (0, 1):  # both workers accepted some of the 60 connections
            assert after[w]["edge"]["redirected"] > before[w]["edge"]["redirected"], after
        by = wait_logged(tmp_path, lambda by: sum(len(v) for v in by.values()) >= 60)
        for w in (0, 1):
            shard_lines = [ln for ln in by[w] if (ln["container_id"] or "").startswith("shard-")]
            loc_lines = [ln for ln in by[w] if (ln["container_id"] or "").startswith("loc")]
            assert shard_lines and all(ln["key_filtered"] == "shard" for ln in shard_lines), w
            assert loc_lines and all(ln["local"] for ln in loc_lines), w
        # the API answers for the router: the sum of the workers, and the filters are the ones set
        status, counters = r.get("/api/v1/counters")
        assert counters["edge"]["redirected"] == sum(w["edge"]["redirected"] for w in counters["per_worker"])
        assert r.get("/api/v1/routers/rr")[1]["key_filter"] == "^[a-z]+"
        status, metrics = r.get("/metrics")
        total = counters["edge"]["redirected"]
        assert status == 200 and f'lodestone_router_edge_events_total{{acceptor="redir",event="redirected"}} {total}' \
            in metrics
        # one prober for the router: the supervisor's rounds, not one set per worker
        assert counters["routers"]["rr"]["probe_rounds"] >= 1
        assert all(w["routers"]["rr"]["probe_rounds"] == 0 for w in counters["per_worker"])
        summary = r.get("/api/v1/router")[1]
        assert summary["workers"] == 2 and [p["ready"] for p in summary["processes"]] == [True, True]
    finally:
        assert r.terminate() == 0, r.stderr_text()


def test_round_robin_stickiness_holds_whichever_worker_accepts(tmp_path, brokers):
    r = _start(tmp_path, brokers)
    try:
        fresh = [redirected_port(r, f"fresh-{n}") for n in range(9)]
        assert len(set(fresh)) == 3  # round robin spreads new keys
        before = per_worker(r)
        ports = {redirected_port(r, "sticky-client") for _ in range(40)}
        assert len(ports) == 1, ports
        after = per_worker(r)
        for w in (0, 1):
            assert after[w]["edge"]["redirected"] > before[w]["edge"]["redirected"], after
        # every earlier key still sticks, on both workers
        again = [redirected_port(r, f"fresh-{n}") for n in range(9) for _ in range(3)]
        assert again == [p for p in fresh for _ in range(3)]
        # the management API sees the one shared cache and names the same target
        entries = {e["key"]: e["node_id"] for e in r.get("/api/v1/routers/rr/cache")[1]["entries"]}
        assert "sticky-client" in entries
        body = r.target_for("rr", "sticky-client")
        assert body["target"]["port"] in ports and body["explanation"]["cache"] == "hit"
        by = wait_logged(tmp_path, lambda by: all(any(ln["container_id"] == "sticky-client" for ln in by[w])
                                                  for w in (0, 1)))
        for w in (0, 1):  # each worker had hits for the key it did not decide itself
            assert any(ln["container_id"] == "sticky-client" and ln["cache"] == "hit" for ln in by[w])
    finally:
        assert r.terminate() == 0, r.stderr_text()


def test_concurrent_first_connections_of_one_key_agree_across_workers(tmp_path, brokers):
    """A new key's decision is claimed at the supervisor before the client gets it: clients of
    one fresh key connecting at the same time through both workers all land on one broker."""
    from concurrent.futures import ThreadPoolExecutor

    r = _start(tmp_path, brokers)
    try:
        with ThreadPoolExecutor(8) as pool:
            for n in range(12):
                ports = set(pool.map(lambda _i, k=f"race-{n}": redirected_port(r, k), range(8)))
                assert len(ports) == 1, (n, ports)
        status, body = r.get("/api/v1/counters")
        assert all(w["edge"]["redirected"] > 0 for w in body["per_worker"]), body["per_worker"]
    finally:
        assert r.terminate() == 0, r.stderr_text()


def test_stickiness_survives_a_router_restart(tmp_path, brokers):
    r = _start(tmp_path, brokers)
    try:
        first = {f"keep-{n}": redirected_port(r, f"keep-{n}") for n in range(12)}
        assert len(set(first.values())) == 3
    finally:
        assert r.terminate() == 0, r.stderr_text()
    cache_file = tmp_path / "cache" / "rr.log"
    assert cache_file.exists() and b"keep-11" in cache_file.read_bytes()
    r = _start(tmp_path, brokers)  # new process, new round-robin start, same cache file
    try:
        for _ in range(2):
            assert {k: redirected_port(r, k) for k in first} == first
        by = wait_logged(tmp_path, lambda by: sum(1 for w in (0, 1) for ln in by[w]
                                                  if (ln["container_id"] or "").startswith("keep-")) >= 36)
        keep = sorted((ln for w in (0, 1) for ln in by[w] if (ln["container_id"] or "").startswith("keep-")),
                      key=lambda ln: ln["time"])
        assert len(keep) == 36 and all(ln["cache"] == "hit" for ln in keep[12:])  # after the restart
    finally:
        assert r.terminate() == 0, r.stderr_text()


def test_a_killed_worker_is_restarted_with_the_current_state_and_serving_continues(tmp_path, brokers):
    r = _start(tmp_path, brokers)
    try:
        assert r.request("PUT", "/api/v1/routers/rr/key-filter", {"key_filter": "^[a-z]+"})[0] == 200
        sticky = redirected_port(r, "survivor-1")
        procs = r.get("/api/v1/router")[1]["processes"]
        victim = procs[1]["pid"]
        os.kill(victim, signal.SIGKILL)

        def gone():   # dead: a zombie until the supervisor reaps it, then no /proc entry at all
            try:
                return Path(f"/proc/{victim}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
            except FileNotFoundError:
                return True
        wait_for(gone, 10, interval_s=0.02, what=f"the killed worker (pid {victim}) dead")
        old_lines = len(route_lines(tmp_path, 1))  # the dead worker writes no more
        # serving continues meanwhile (the other worker takes every connection)
        assert {redirected_port(r, f"survivor-{n}") for n in range(10)} == {sticky}

        def restarted():
            p = r.get("/api/v1/router")[1]["processes"][1]
            return p if p["ready"] and p["pid"] != victim else None

        p = wait_for(restarted, 30)
        assert p["restarts"] == 1
        assert "worker 1" in r.stderr_text() and "restarting" in r.stderr_text()
        start = time.monotonic()
        while per_worker(r)[1]["edge"]["redirected"] == 0:  # until the new worker took some
            assert redirected_port(r, f"survivor-{int(time.monotonic() * 1000)}") == sticky
            assert time.monotonic() - start < 30
        # the new worker got the filter and the shared cache: "survivor-*" -> "survivor" -> same broker
        by = wait_logged(tmp_path, lambda by: len(by[1]) > old_lines)
        new_lines = by[1][old_lines:]
        assert all(ln["container_id"].startswith("survivor-") for ln in new_lines)
        assert all(ln["key_filtered"] == "survivor" for ln in new_lines), new_lines
    finally:
        assert r.terminate() == 0, r.stderr_text()


def test_a_second_router_with_workers_on_the_same_port_is_refused_as_with_one(tmp_path, brokers):
    """Workers share their port with SO_REUSEPORT; a second router on the same host and port must
    not join that group (the kernel would split clients between two routers that share nothing):
    it exits 1 naming the listener, as a one-worker router does."""
    import socket
    import subprocess
    import sys

    from tests.serverproc import REPO

    first = start_router(tmp_path / "first", _toml(tmp_path / "first", brokers), expect=2, auth=AUTH)
    try:
        port = first.port("redir")
        text = _toml(tmp_path / "second", brokers).replace('name = "redir"\nport = 0', f'name = "redir"\nport = {port}')
        assert f"port = {port}" in text
        cfg = tmp_path / "second.toml"
        cfg.write_text(text)
        done = subprocess.run([sys.executable, "-m", "router", "run", str(cfg)], cwd=REPO, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 1, done.stderr[-2000:]
        assert f"acceptors.redir: cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass                              # the first router still listens
    finally:
        first.terminate()
