"""OpenAMQ's root election on real broker processes (issue 28; docs/cluster.md "Primaries,
secondaries and the root"): three defined primaries and two secondaries, ports named up front
(a primary finds itself in ``primaries`` by its connector).

The oracle is the seed's rule worked by hand: the root is the most senior active primary, i.e.
the one whose process started first and was not restarted since; it needs more than half of the
three defined primaries (two) to be elected and resigns below half (one). Every wait is on the
state each node reports (``GET /api/v1/cluster``), never a fixed sleep.
"""

from __future__ import annotations

import time

import pytest

from tests.clusterproc import cluster_view, start_node, wait_until
from tests.brokerproc import ADMIN
from tests.netns import Network, available
from tests.serverproc import free_ports, http_json, metric_by_label

pytestmark = pytest.mark.timeout(240)

FAST = {"retry-interval-ms": 100, "max-retry-interval-ms": 300, "connection-ttl-ms": 3000}


def _start(tmp_path, procs, name: str, primaries: list[str], *, port: int | None = None,
           partition: str = "primary", config: dict | None = None):
    extra = {**FAST, "partition": partition, "primaries": primaries}
    config = dict(config or {})
    if port is not None:
        extra["connector"] = f"amqp://127.0.0.1:{port}"
        config["acceptors.amqp"] = {**config.get("acceptors.amqp", {}), "port": port}
    node = start_node(tmp_path, name, extra=extra, config=config)
    procs.append(node)
    return node


def _cluster(tmp_path, procs, secondaries: int = 2, config: dict | None = None):
    ports = free_ports(3)
    primaries = [f"amqp://127.0.0.1:{p}" for p in ports]
    ps = [_start(tmp_path, procs, f"p{i}", primaries, port=port, config=config) for i, port in enumerate(ports)]
    ss = [_start(tmp_path, procs, f"s{i}", primaries, partition="secondary", config=config)
          for i in range(secondaries)]
    return ps, ss, primaries


def _view(node) -> dict:
    return cluster_view(node)


def _metrics(node) -> str:
    status, text = http_json(node.management_url + "/metrics", auth=ADMIN, timeout_s=10)
    assert status == 200
    return text


def _root_of(node):
    return _view(node)["root"]


def _wait_root(nodes, root_id, timeout_s: float = 30.0, what: str = ""):
    wait_until(lambda: all(_root_of(n) == root_id for n in nodes), timeout_s,
               what or f"every node knows root {root_id}")


def test_most_senior_primary_is_elected_and_secondaries_follow(tmp_path, procs):
    ps, ss, primaries = _cluster(tmp_path, procs)
    ids = [p.node_id for p in ps]
    _wait_root(ps + ss, ids[0])       # p0 started first: the most senior
    for p in ps:
        v = _view(p)
        assert v["partition"] == "primary"
        assert v["is_root"] == (p is ps[0])
    wait_until(lambda: all(_view(p)["electorate"] == 3 for p in ps), 30, "an electorate of 3 on every primary")
    for p in ps:
        v = _view(p)
        assert v["votes"] == {i: ids[0] for i in ids}, v["votes"]
        assert v["election"]["defined_primaries"] == 3
    for s in ss:
        v = _view(s)
        assert v["partition"] == "secondary" and not v["is_root"] and v["election"]["vote"] is None
        # a secondary bridges to every primary and to no other secondary
        to = {b["to"] for b in v["bridges"] if b["connected"]}
        assert to == set(ids), to
        assert {b["connector"] for b in v["bridges"]} == set(primaries), v["bridges"]   # not even tried
    # the primaries see both secondaries (they dial every node)
    wait_until(lambda: all(len(_view(p)["election"]["secondaries"]) == 2 for p in ps), 30, "secondaries seen")
    for p in ps + ss:
        root = metric_by_label(_metrics(p), "lodestone_broker_cluster_root")
        assert root == {"primary" if p in ps else "secondary": 1.0 if p is ps[0] else 0.0}, root
    assert "this primary is now the root" in ps[0].stderr_text()
    assert f"this primary votes for {ids[0]}" in ps[1].stderr_text()
    assert "now the root" not in ps[1].stderr_text() + ps[2].stderr_text()


def test_root_killed_the_next_senior_takes_over_and_the_old_root_rejoins_as_a_primary(tmp_path, procs):
    ps, ss, _ = _cluster(tmp_path, procs)
    ids = [p.node_id for p in ps]
    _wait_root(ps + ss, ids[0])
    wait_until(lambda: _view(ps[2])["electorate"] == 3, 30, "p2 active")
    t0 = time.monotonic()
    ps[0].kill()
    _wait_root(ps[1:] + ss, ids[1], 30, "p1 (next most senior) is root everywhere")
    took = time.monotonic() - t0
    print(f"new root known on all four survivors {took:.2f} s after SIGKILL of the root")
    assert took < 2.0, took   # a dead process is gone at once: no idle time-out wait (connection-ttl-ms 3 s)
    v = _view(ps[1])
    assert v["is_root"] and v["electorate"] == 2 and v["votes"] == {ids[1]: ids[1], ids[2]: ids[1]}, v
    assert "this primary is now the root" in ps[1].stderr_text()
    # the old root comes back: the youngest now, it votes for p1 and never takes the root back
    ps[0].restart()
    wait_until(lambda: _view(ps[0])["election"]["state"] == "active" and _view(ps[0])["election"]["vote"] == ids[1], 30,
               "the restarted old root active and voting for p1")
    _wait_root(ps + ss, ids[1])
    wait_until(lambda: _view(ps[1])["electorate"] == 3, 30, "an electorate of 3 again")
    v = _view(ps[1])
    assert v["is_root"] and set(v["votes"].values()) == {ids[1]}, v["votes"]
    assert v["election"]["counters"].get("elected") == 1 and "resigned" not in v["election"]["counters"]
    assert not _view(ps[0])["is_root"]


def test_root_resigns_when_the_electorate_falls_below_half_and_is_elected_again(tmp_path, procs):
    ps, ss, _ = _cluster(tmp_path, procs)
    ids = [p.node_id for p in ps]
    _wait_root(ps + ss, ids[0])
    wait_until(lambda: _view(ps[0])["electorate"] == 3, 30, "all three primaries active")
    ps[2].kill()
    wait_until(lambda: _view(ps[0])["electorate"] == 2, 30, "p0 sees p2 gone")
    assert _view(ps[0])["is_root"]             # 2 of 3 is at least half: it stays
    ps[1].kill()
    wait_until(lambda: not _view(ps[0])["is_root"], 30, "p0 resigns")
    v = _view(ps[0])
    assert v["root"] is None and v["electorate"] == 1 and "below half" in v["election"]["why"], v["election"]
    assert "this primary is no longer the root" in ps[0].stderr_text()
    _wait_root(ss, None, 30, "the secondaries know there is no root")
    # a primary returns: 2 of 3, and p0 (never restarted) is still the most senior
    ps[1].restart()
    _wait_root([ps[0], ps[1]] + ss, ids[0], 30, "p0 root again")
    assert _view(ps[0])["election"]["counters"].get("elected") == 2


def test_a_lone_primary_is_never_root_and_a_cut_off_secondary_never_becomes_root(tmp_path, procs):
    ps, ss, _ = _cluster(tmp_path, procs)
    ids = [p.node_id for p in ps]
    _wait_root(ps + ss, ids[0])
    for p in ps[1:]:
        p.kill()
    wait_until(lambda: _view(ps[0])["root"] is None, 30, "p0 resigned")
    ps[0].kill()
    _wait_root(ss, None, 30, "no root known to the secondaries")
    # observe: every round for three seconds, neither secondary takes the root or votes
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        for s in ss:
            v = _view(s)
            assert not v["is_root"] and v["root"] is None and v["election"]["vote"] is None, v["election"]
        time.sleep(0.2)
    for s in ss:
        assert "now the root" not in s.stderr_text()
        assert metric_by_label(_metrics(s), "lodestone_broker_cluster_root") == {"secondary": 0.0}
    # a primary started alone (the others down): active once its dials fail, never root (1 of 3)
    ps[2].restart()
    wait_until(lambda: _view(ps[2])["election"]["state"] == "active", 30, "p2 active")
    v = _view(ps[2])
    assert not v["is_root"] and v["root"] is None and v["electorate"] == 1
    assert "not more than half" in v["election"]["why"], v["election"]["why"]


@pytest.mark.skipif(available() is not None, reason=str(available()))
def test_a_root_cut_off_by_the_network_resigns_before_another_is_elected(tmp_path):
    """Three primaries, each in its own network namespace (tests/netns.py). The root's links are
    cut: packets vanish, so every side learns of it only by its idle time-out. Sampled every
    100 ms: the old root resigns, then p1 is elected — never two roots in one sample. Healed,
    the old root (never restarted: still the most senior) is root again, by the rule."""
    names = ["p0", "p1", "p2"]
    with Network(names) as net:
        started = []
        try:
            primaries = [f"amqp://{net.host(n)}:5672" for n in names]
            for n in names:
                node = start_node(tmp_path, n, net=net,
                                  extra={**FAST, "connection-ttl-ms": 2000, "connector": f"amqp://{net.host(n)}:5672",
                                         "primaries": primaries},
                                  config={"acceptors.amqp": {"host": net.host(n), "port": 5672},
                                          "management": {"host": net.host(n)}})
                started.append(node)
            ids = [p.node_id for p in started]
            _wait_root(started, ids[0], 60)
            wait_until(lambda: all(_view(p)["electorate"] == 3 for p in started), 30, "all active")
            samples: list[tuple[float, tuple[bool, ...]]] = []
            t0 = time.monotonic()
            net.isolate("p0")
            while time.monotonic() - t0 < 30:
                row = tuple(bool(_view(p)["is_root"]) for p in started)
                samples.append((time.monotonic() - t0, row))
                if row == (False, True, False) and _root_of(started[2]) == ids[1]:
                    break
                time.sleep(0.1)
            assert samples[-1][1] == (False, True, False), samples[-5:]
            both = [t for t, row in samples if sum(row) > 1]
            resigned = next(t for t, row in samples if not row[0])
            elected = next(t for t, row in samples if row[1])
            print(f"cut: old root resigned after {resigned:.2f} s, p1 elected after {elected:.2f} s, "
                  f"{len(samples)} samples, {len(both)} with two roots")
            assert not both, both
            assert resigned <= elected
            assert "lost the root" in started[1].stderr_text()
            net.heal()
            _wait_root(started, ids[0], 60, "p0, the most senior, root again after the heal")
        finally:
            for p in started:
                p.kill()


ROOT_ROUTER = {"acceptors.amqp": {"router": "toroot"},
               "routers.toroot": {"key-type": "CLIENT_ID", "root-target-filter": "critical-.*"},
               "routers.toroot.policy": {"name": "FIRST_ELEMENT"},
               "routers.toroot.pool": {"source": "cluster", "check-period": 200, "local-target-enabled": True}}


def test_a_brokers_router_sends_root_bound_clients_to_the_root_and_follows_a_new_one(tmp_path, procs):
    """Every broker's acceptor is routed by its own router with ``root-target-filter``: a client
    whose container id matches is redirected to the root — the process that says it is root
    (its own view, its own port), not what the router's API says — and stays when it is there.
    The root SIGKILLed: the redirect names the new root."""
    from router.client import _open_once
    ps, ss, _ = _cluster(tmp_path, procs, secondaries=1, config=ROOT_ROUTER)
    ids = [p.node_id for p in ps]
    _wait_root(ps + ss, ids[0])
    client = {"user": "app", "password": "app", "allowed_mechs": "PLAIN", "timeout": 20}

    def redirect(node, cid):
        conn, cond = _open_once(node.amqp_url, {**client, "container_id": cid})
        if conn is not None:
            conn.close()
            return None
        assert cond.name == "amqp:connection:redirect", cond
        return int(dict(cond.info)["port"])

    def the_root():
        return next(p for p in ps if p.proc.poll() is None and _view(p)["is_root"])

    root = the_root()
    assert root is ps[0]
    for node in (ps[1], ps[2], ss[0]):
        wait_until(lambda: redirect(node, "critical-feed") == root.port, 30, f"{node.workdir.name} redirects to the root")
    assert redirect(ps[0], "critical-feed") is None        # on the root: stays
    status, pool = http_json(ps[1].management_url + "/api/v1/routers/toroot/pool", auth=ADMIN, timeout_s=10)
    assert status == 200 and pool["root"] == ids[0]
    assert [t["node_id"] for t in pool["targets"] if t.get("root")] == [ids[0]]
    ps[0].kill()
    _wait_root(ps[1:] + ss, ids[1])
    root = the_root()
    assert root is ps[1]
    for node in (ps[2], ss[0]):
        wait_until(lambda: redirect(node, "critical-feed") == root.port, 30, f"{node.workdir.name} redirects to the new root")
    assert redirect(ps[1], "critical-feed") is None


def test_the_front_door_router_proxies_root_bound_clients_to_the_root(tmp_path, procs):
    """A router process (two workers) with a ``source = "cluster"`` pool seeded with a secondary's
    management URL only, ``root-target-filter = "critical-.*"``: a matching client is proxied to
    the broker that says it is root (found in that broker's own connection list), others by the
    policy; after the root's SIGKILL, to the new root."""
    from proton.utils import BlockingConnection
    from tests.routerproc import start_router, toml_str
    from tests.serverproc import REPO
    ps, ss, _ = _cluster(tmp_path, procs, secondaries=1)
    ids = [p.node_id for p in ps]
    _wait_root(ps + ss, ids[0])
    text = "\n".join([
        'name = "r"', f'users-file = {toml_str(str(REPO / "etc" / "users.toml"))}', "workers = 2",
        "[management]", "port = 0", 'user = "admin"', 'password = "admin"',
        "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
        "[routers.main]", 'key-type = "CLIENT_ID"', 'root-target-filter = "critical-.*"',
        "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
        "[routers.main.pool]", 'source = "cluster"', f"seed-connectors = [{toml_str(ss[0].management_url)}]",
        "check-period = 200", 'username = "admin"', 'password = "admin"']) + "\n"
    router = start_router(tmp_path / "router", text, expect=2)
    procs.append(router)

    def landed(key: str):
        conn = BlockingConnection(router.url("proxy"), container_id=key, user="app", password="app",
                                  allowed_mechs="PLAIN", allow_insecure_mechs=True, timeout=10)
        try:
            found = [p for p in ps + ss if p.proc.poll() is None
                     and any(c["container_id"] == key for c in p.management_get("/api/v1/connections")[1])]
            return found[0] if len(found) == 1 else None
        finally:
            conn.close()

    def pool():
        status, body = router.get("/api/v1/routers/main/pool")
        assert status == 200, body
        return body

    wait_until(lambda: pool().get("root") == ids[0] and pool()["ready"] == 4, 30, "the router knows the root")
    for i in range(6):   # both workers: every matching key lands on the root
        assert landed(f"critical-{i}") is ps[0]
    ps[0].kill()
    _wait_root(ps[1:] + ss, ids[1])
    wait_until(lambda: pool().get("root") == ids[1], 30, "the router knows the new root")
    wait_until(lambda: all(landed(f"critical-{i}") is ps[1] for i in range(6)), 30, "critical keys on the new root")
