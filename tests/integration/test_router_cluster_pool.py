"""``[routers.<r>.pool] source = "cluster"``: a real router process follows a real broker cluster
(``tests/clusterproc.py``) seeded with ONE broker's management URL. Clients are unmodified
python-qpid-proton connections through the router's proxy acceptor; where a connection landed is
read from the brokers' own management APIs."""

from __future__ import annotations

import pytest
from proton.utils import BlockingConnection

from tests.clusterproc import cluster_view, start_cluster, start_node, wait_mesh
from tests.routerproc import start_router, toml_str
from tests.serverproc import REPO
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

LEAVE_AFTER_MS = 3000


def _router_toml(seed: str, *, workers: int = 1) -> str:
    return "\n".join([
        'name = "r"', f'users-file = {toml_str(str(REPO / "etc" / "users.toml"))}', f"workers = {workers}",
        "[management]", "port = 0", 'user = "admin"', 'password = "admin"',
        "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
        "[routers.main]", 'key-type = "CLIENT_ID"',
        "[routers.main.policy]", 'name = "CONSISTENT_HASH"',
        "[routers.main.cache]", 'fail-back = "return"',
        "[routers.main.pool]", 'source = "cluster"', f"seed-connectors = [{toml_str(seed)}]",
        f"leave-after-ms = {LEAVE_AFTER_MS}", "check-period = 200", "quorum-timeout = 0",
        'username = "admin"', 'password = "admin"']) + "\n"


def _pool(router) -> dict:
    status, body = router.get("/api/v1/routers/main/pool")
    assert status == 200, body
    return body


def _ready_ids(router) -> set[str]:
    return {t["node_id"] for t in _pool(router)["targets"] if t["ready"]}


def _member_ids(router) -> set[str]:
    return {t["name"] for t in _pool(router)["targets"]}


def _landed(nodes, router, key: str) -> str:
    """Connect through the proxy acceptor with container-id ``key``; the node id of the broker
    whose management API lists that connection."""
    conn = BlockingConnection(router.url("proxy"), container_id=key, user="app", password="app",
                              allowed_mechs="PLAIN", allow_insecure_mechs=True, timeout=10)
    try:
        def where():
            found = [n.node_id for n in nodes if n.proc.poll() is None
                     and any(c["container_id"] == key for c in n.management_get("/api/v1/connections")[1])]
            return found or None
        found = wait_for(where, 10)
        assert len(found) == 1
        return found[0]
    finally:
        conn.close()


def _cached(router, key: str) -> str | None:
    status, page = router.get("/api/v1/routers/main/cache?limit=1000")
    assert status == 200, page
    return next((e["node_id"] for e in page["entries"] if e["key"] == key), None)


def test_cluster_pool_follows_the_cluster(tmp_path):
    nodes = start_cluster(tmp_path, 3)
    router = None
    try:
        wait_mesh(nodes)
        ids = [n.node_id for n in nodes]
        router = start_router(tmp_path / "router", _router_toml(nodes[0].management_url), expect=2)
        # seeded with node0 only: the pool holds all three, named by node id, probed ready
        wait_for(lambda: _ready_ids(router) == set(ids), 15)
        assert _member_ids(router) == set(ids)
        pool = _pool(router)
        assert pool["membership"]["last_error"] is None
        assert {t["port"] for t in pool["targets"]} == {n.port for n in nodes}

        # clients reach every broker
        landed: dict[str, str] = {}
        for i in range(60):
            landed[f"k{i}"] = _landed(nodes, router, f"k{i}")
            if set(landed.values()) == set(ids):
                break
        assert set(landed.values()) == set(ids), landed

        # a broker that starts later joins the pool and gets clients
        late = start_node(tmp_path, "node3", static=[nodes[1].amqp_url])
        nodes.append(late)
        wait_for(lambda: _ready_ids(router) == set(ids) | {late.node_id}, 20)
        for i in range(60, 200):
            landed[f"k{i}"] = _landed(nodes, router, f"k{i}")
            if landed[f"k{i}"] == late.node_id:
                break
        assert late.node_id in landed.values()

        # the seed is killed: health takes it out of routing at once; the others still list it
        # (connected = false), so it leaves the pool only after leave-after-ms without a view
        # showing it alive; meanwhile the router reads the cluster from the other members
        gone = nodes[0]
        key = next(k for k, v in landed.items() if v == gone.node_id)
        gone.kill()
        wait_for(lambda: gone.node_id not in _ready_ids(router), 10)
        assert gone.node_id in _member_ids(router)
        assert _landed(nodes, router, key) != gone.node_id          # a ready broker takes it
        assert _cached(router, key) == gone.node_id                 # fail-back = return keeps it
        n = 0

        def left():
            nonlocal n  # clients keep being routed while the dead node is still a member
            n += 1
            assert _landed(nodes, router, f"during-{n}") != gone.node_id
            return gone.node_id not in _member_ids(router)
        wait_for(left, LEAVE_AFTER_MS / 1000 + 15)
        assert any(m["node_id"] == gone.node_id and not m["connected"]
                   for m in cluster_view(nodes[1])["members"])
        pool = _pool(router)
        assert pool["membership"]["last_read_from"] != gone.management_url.rstrip("/")
        assert _ready_ids(router) == set(ids[1:]) | {late.node_id}
        # it left for good: its cache entry is not kept any more; the key's next connection
        # goes to a ready broker and the entry names that broker
        where = _landed(nodes, router, key)
        assert where != gone.node_id and _cached(router, key) == where
        # and it stays out: the views still list it (disconnected), which is no reason to rejoin
        assert gone.node_id not in _member_ids(router)
    finally:
        if router is not None:
            router.terminate()
        for n in nodes:
            n.kill()


def test_every_worker_follows_the_cluster(tmp_path):
    nodes = start_cluster(tmp_path, 2)
    router = None
    try:
        wait_mesh(nodes)
        router = start_router(tmp_path / "router", _router_toml(nodes[1].management_url, workers=2),
                              expect=2)
        wait_for(lambda: _ready_ids(router) == {n.node_id for n in nodes}, 15)
        late = start_node(tmp_path, "node2", static=[nodes[0].amqp_url])
        nodes.append(late)
        wait_for(lambda: late.node_id in _ready_ids(router), 20)
        # keys the supervisor (management lookup, the shared cache's owner) puts on the new
        # broker: a worker that did not hold it as a ready member would re-decide them elsewhere
        keys = []
        for i in range(400):
            status, body = router.get(f"/api/v1/routers/main/target?key=w{i}")
            assert status == 200, body
            if body["target"] and body["target"]["node_id"] == late.node_id:
                keys.append(f"w{i}")
            if len(keys) == 16:
                break
        assert len(keys) == 16
        for k in keys:
            assert _landed(nodes, router, k) == late.node_id, k
        status, counters = router.get("/api/v1/counters")
        assert status == 200, counters
        per = {w["worker"]: w["routers"]["main"]["route_ok"] for w in counters["per_worker"]}
        assert all(per[w] > 0 for w in (0, 1)), per  # both workers routed some of them
        assert all(w["routers"]["main"]["probe_rounds"] == 0 for w in counters["per_worker"])
    finally:
        if router is not None:
            router.terminate()
        for n in nodes:
            n.kill()
