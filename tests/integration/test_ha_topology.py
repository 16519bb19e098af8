"""HA backups in the cluster's topology: every member lists every pair, not only the primary
(docs/ha.md "Topology"). Real broker processes (tests/haproc.py); where a backup serves is read
from its own process (its fixed port, its management URL), never from the view under test; a
router's cluster pool seeded with another node learns the pair before any failover, and a key of
the pair lands on the backup once it took over (the connection listed by the backup's own
management API)."""

from __future__ import annotations

import signal
import threading

import pytest
from proton.utils import BlockingConnection

from tests.brokerproc import ADMIN
from tests.haproc import CLIENT, start_clustered_primary, start_member, start_replica, wait_active, wait_phase
from tests.integration.test_ha_replication import FAST_VOTES, three_primaries
from tests.integration.test_router_cluster_pool import _landed, _pool, _router_toml
from tests.routerproc import start_router
from tests.serverproc import http_json
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _backups(member, node_id: str) -> list[dict]:
    status, view = http_json(member.management_url + "/api/v1/cluster", auth=ADMIN, timeout_s=10)
    assert status == 200, view
    return [m for m in view["members"] if m["node_id"] == node_id and m.get("role") == "backup"]


def _entry(backup, connected: bool = True) -> dict:
    # the oracle: where the backup process listens (its config's fixed ports), not a view
    return {"node_id": backup.expected_node_id, "role": "backup", "connector": backup.amqp_url,
            "management_url": backup.management_url, "connected": connected}


def _listed(member, backup, connected: bool = True):
    got = [{k: m[k] for k in ("node_id", "role", "connector", "management_url", "connected")}
           for m in _backups(member, backup.expected_node_id)]
    return got == [_entry(backup, connected)]


def _fsl(member) -> list[dict]:
    """Artemis's failover-server-list in ``member``'s Open, as unmodified proton reads it."""
    conn = BlockingConnection(member.amqp_url, **CLIENT)
    try:
        return [dict(m) for m in (conn.conn.remote_properties or {}).get("failover-server-list", [])]
    finally:
        conn.close()


def test_every_member_lists_a_replication_backup_and_a_router_pairs_it_before_the_failover(tmp_path, procs):
    p1, p2, p3 = three_primaries(tmp_path, procs)
    backup = start_replica(tmp_path, "backup", "backup", static=[p2.amqp_url, p3.amqp_url, p1.amqp_url],
                           ha={"group-name": "g1", **FAST_VOTES})
    procs.append(backup)
    backup.expected_node_id = p1.node_id
    wait_phase(backup, "in-sync")
    # not only p1 (its primary) but p2 and p3 list p1's backup, in sync
    for m in (p1, p2, p3):
        wait_for(lambda m=m: _listed(m, backup), 15)

    # a router whose cluster pool asks p2 only knows the pair before anything fails
    router = start_router(tmp_path / "router", _router_toml(p2.management_url), expect=2)
    procs.append(router)
    wait_for(lambda: any(pr["node_id"] == p1.node_id and pr["state"] == "serving" and len(pr["members"]) == 2
                         for pr in _pool(router).get("pairs", [])), 20)
    members = {t["name"]: t for t in _pool(router)["targets"]}
    slot = f"{p1.node_id}@127.0.0.1:{backup.port}"
    assert members[slot]["backup"] is True and not members[slot]["ready"]   # passive: probed, not ready
    # a key of p1's pair: placed by the router's hash on p1 while it serves
    keys = [f"k{i}" for i in range(40)]
    on_p1 = [k for k in keys if _landed([p1, p2, p3], router, k) == p1.node_id]
    assert on_p1, "no key of 40 landed on p1"

    # the backup is lost: every member stops listing it (p1 says so), and lists it again when it is back
    backup.kill()
    for m in (p1, p2, p3):
        wait_for(lambda m=m: not _backups(m, p1.node_id), 15)
    backup.start()
    wait_phase(backup, "in-sync", 60)
    for m in (p2, p3):
        wait_for(lambda m=m: _listed(m, backup), 15)

    # failover: the key of p1's pair lands on the backup (its own API lists the connection)
    p1.kill()
    wait_active(backup, 30)
    wait_for(lambda: _serving_port(router, p1.node_id) == backup.port, 20)
    assert _landed_on(backup, router, on_p1[0])
    # once it serves the node id, nobody lists it as a backup of itself
    for m in (p2, p3):
        wait_for(lambda m=m: not _backups(m, p1.node_id), 15)


def _serving_port(router, node_id: str) -> int | None:
    """The port of the member the router sends ``node_id``'s keys to (None: none ready)."""
    pool = _pool(router)
    ready = [t for t in pool["targets"] if t["node_id"] == node_id and t["ready"]]
    return ready[0]["port"] if len(ready) == 1 else None


def _landed_on(member, router, key: str) -> bool:
    """Connect through the router with container-id ``key``: does ``member``'s own management API
    list that connection?"""
    conn = BlockingConnection(router.url("proxy"), container_id=key, user="app", password="app",
                              allowed_mechs="PLAIN", allow_insecure_mechs=True, timeout=10)
    try:
        return bool(wait_for(lambda: any(c["container_id"] == key
                                         for c in member.management_get("/api/v1/connections")[1]), 10))
    finally:
        conn.close()


def test_a_shared_store_backup_is_listed_by_its_primary_and_the_cluster(tmp_path, procs):
    other, primary, cluster, shared = start_clustered_primary(tmp_path, procs)
    node_id = http_json(primary.management_url + "/api/v1/broker", auth=ADMIN)[1]["node_id"]
    assert not _backups(primary, node_id) and _fsl(primary) == []
    backup = start_member(tmp_path, "backup", shared, "backup", cluster=cluster)
    procs.append(backup)
    backup.expected_node_id = node_id
    wait_phase(backup, "waiting-for-live-lock")
    # the primary lists the backup waiting on its files, and tells the other member
    for m in (primary, other):
        wait_for(lambda m=m: _listed(m, backup), 15)
    # Artemis's failover-server-list in the primary's Open names it
    assert _fsl(primary) == [{"network-host": "127.0.0.1", "scheme": "amqp", "hostname": "127.0.0.1",
                              "port": backup.port}]
    # a backup that is gone (its lock freed) is listed by nobody, its stale backup.json ignored
    backup.kill()
    assert (shared / "backup.json").exists()
    for m in (primary, other):
        wait_for(lambda m=m: not _backups(m, node_id), 15)
    assert _fsl(primary) == []
    # back, then the failover: the backup serves the node id and is nobody's backup any more
    backup.start()
    wait_phase(backup, "waiting-for-live-lock")
    wait_for(lambda: _listed(other, backup), 15)
    primary.kill()
    wait_active(backup, 30)
    wait_for(lambda: not _backups(other, node_id) and any(
        m["node_id"] == node_id and m.get("role") != "backup" and m["connector"] == backup.amqp_url
        and m["connected"] for m in http_json(other.management_url + "/api/v1/cluster", auth=ADMIN)[1]["members"]),
        20)


def _embedded(extra: dict | None = None) -> dict:
    """A router inside each broker (docs/cluster.md "A router inside the broker"): CLIENT_ID,
    CONSISTENT_HASH over this broker's cluster, the broker itself the local target, a sticky
    cache; a cached key whose pair fails over waits up to quorum-timeout."""
    return {"acceptors.amqp": {"router": "gravity"},
            "routers.gravity": {"key-type": "CLIENT_ID"},
            "routers.gravity.policy": {"name": "CONSISTENT_HASH"},
            "routers.gravity.cache": {"max-entries": 1000},
            "routers.gravity.pool": {"source": "cluster", "check-period": 300, "quorum-timeout": 60000,
                                     "local-target-enabled": True},
            **(extra or {})}


def _embedded_pool(member) -> dict:
    status, pool = member.management_get("/api/v1/routers/gravity/pool")
    assert status == 200, pool
    return pool


def test_a_router_inside_a_broker_waits_for_a_failing_over_pair_instead_of_moving_its_keys(tmp_path, procs):
    from router.client import _open_once

    def open_once(member, key):
        return _open_once(member.amqp_url, {**CLIENT, "container_id": key})

    p1 = start_replica(tmp_path, "p1", "primary", ha={"group-name": "g1"}, config=_embedded())
    procs.append(p1)
    wait_active(p1)
    p2 = start_replica(tmp_path, "p2", "primary", static=[p1.amqp_url], ha={"group-name": "g2"}, config=_embedded())
    p3 = start_replica(tmp_path, "p3", "primary", static=[p1.amqp_url], ha={"group-name": "g3"}, config=_embedded())
    procs += [p2, p3]
    for p in (p2, p3):
        wait_active(p)
    backup = start_replica(tmp_path, "backup", "backup", static=[p1.amqp_url, p2.amqp_url, p3.amqp_url],
                           ha={"group-name": "g1", **FAST_VOTES}, config=_embedded())
    procs.append(backup)
    wait_phase(backup, "in-sync")
    # p2's embedded router holds p1's pair: p1 serving, its backup a passive member
    wait_for(lambda: any(pr["node_id"] == p1.node_id and pr["state"] == "serving" and len(pr["members"]) == 2
                         for pr in _embedded_pool(p2).get("pairs", [])), 20)
    # a key p2 sends to p1 (the redirect names p1's port: the oracle is p1's own listener)
    key = None
    for i in range(60):
        conn, cond = open_once(p2, f"pair-key-{i}")
        if conn is not None:
            conn.close()
            continue
        if cond.name == "amqp:connection:redirect" and dict(cond.info)["port"] == p1.port:
            key = f"pair-key-{i}"
            break
    assert key, "no key of 60 was sent to p1"

    # the backup cannot take over yet (stopped), p1 dies: p2 sees its pair failing over
    backup.proc.send_signal(signal.SIGSTOP)
    try:
        p1.kill()
        wait_for(lambda: not any(t["ready"] for t in _embedded_pool(p2)["targets"] if t["node_id"] == p1.node_id)
                 and any(t["node_id"] == p1.node_id and not t["backup"] for t in _embedded_pool(p2)["targets"]), 20)
        # a client of the pair's key now waits on p2 (its pair is failing over) instead of being
        # placed on p2 or p3
        result: dict = {}
        waiter = threading.Thread(target=lambda: result.update(r=open_once(p2, key)), daemon=True)
        waiter.start()
    finally:
        backup.proc.send_signal(signal.SIGCONT)
    wait_active(backup, 30)
    waiter.join(30)
    assert not waiter.is_alive()
    conn, cond = result["r"]
    assert conn is None and cond.name == "amqp:connection:redirect", (conn, cond)
    assert dict(cond.info)["port"] == backup.port       # sent to the backup, which now serves p1's node id
    # and the backup keeps it: its own router places the key on its own node id
    conn, cond = open_once(backup, key)
    assert conn is not None, cond
    conn.close()
