"""A router's discovery pool forms an HA pair from a broker's announced backup: real broker
processes (a replicated pair, tests/haproc.py), a real router process, unmodified
python-qpid-proton clients, inside a network namespace that routes multicast on loopback
(tests/netns.py). The scenario runs in that namespace (this module run as a script):

* the replication primary and its backup both have a broadcast group; only the active one
  announces (a passive backup serves nothing), the primary with its backup in the packet's
  backups section (``ClusterNode.own_backups``);
* the router's pool, ``source = "discovery"`` on the same group, holds both as one pair: the
  primary named by the node id, the backup ``<node id>@127.0.0.1:<port>`` with ``backup =
  true``, probed through the management URL the announcement names;
* after the primary is SIGKILLed and the backup has taken the node id over (``GET
  /api/v1/ha``: active), a new client is proxied to the backup's address (routing log:
  ``target_address``; the backup's own connection list), and the backup, which now announces
  the node id from its own address, keeps its slot as the node's member (no longer a backup).

    python -m tests.integration.test_router_discovery_pairs <work dir>
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(260)]

GROUP, PORT = "231.7.7.7", 9876
PERIOD_MS = 200
# longer than a takeover: the backup's first announcement changes the primary's entry (the
# slots follow it) instead of arriving after the entry expired
REFRESH_MS = 10_000
QUORUM_TIMEOUT_MS = 20_000
FAST_VOTES = {"vote-retries": 2, "vote-retry-wait-ms": 200, "quorum-vote-wait-s": 5}
CLIENT = {"user": "app", "password": "app", "allowed_mechs": "PLAIN", "allow_insecure_mechs": True}


def test_a_discovery_pool_pairs_an_announced_backup_and_follows_the_failover(tmp_path):
    from tests.netns import network_namespace, run_in
    from tests.serverproc import REPO

    with network_namespace() as ns:
        done = run_in(ns, [sys.executable, "-m", "tests.integration.test_router_discovery_pairs", str(tmp_path)],
                      cwd=str(REPO), timeout_s=200)
    assert done.returncode == 0, f"scenario failed:\n{done.stdout}\n{done.stderr[-8000:]}"
    assert "paired" in done.stdout and "routed to the backup" in done.stdout, done.stdout
    print(done.stdout)


def _router_toml(work: Path) -> str:
    from tests.brokerproc import USERS_FILE
    from tests.routerproc import toml_str

    return "\n".join([
        'name = "r"', f"users-file = {toml_str(str(USERS_FILE))}",
        "[management]", "port = 0", 'user = "admin"', 'password = "admin"',
        "[routing-log]", f"path = {toml_str(str(work / 'logs' / 'routing.log'))}",
        "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
        "[routers.main]", 'key-type = "CLIENT_ID"',
        "[routers.main.policy]", 'name = "CONSISTENT_HASH"',
        "[routers.main.pool]", 'source = "discovery"', "check-period = 200",
        f"quorum-timeout = {QUORUM_TIMEOUT_MS}", 'username = "admin"', 'password = "admin"',
        "[routers.main.pool.discovery-group]", f'group-address = "{GROUP}"', f"group-port = {PORT}",
        f"refresh-timeout-ms = {REFRESH_MS}", "initial-wait-timeout-ms = 5000",
        'cluster = "test-cluster"']) + "\n"


def scenario(work: Path) -> None:
    from proton.utils import BlockingConnection

    from tests.clusterproc import wait_until
    from tests.haproc import broker_info, ha_view, start_replica, wait_active, wait_phase
    from tests.routerproc import start_router

    bg = {"broadcast-groups.bg": {"group-address": GROUP, "group-port": PORT, "local-bind-address": "127.0.0.1",
                                  "broadcast-period-ms": PERIOD_MS}}
    made = []
    router = None
    try:
        primary = start_replica(work, "primary", "primary", config=bg)
        made.append(primary)
        wait_active(primary)
        backup = start_replica(work, "backup", "backup", static=[primary.amqp_url], ha=FAST_VOTES, config=bg)
        made.append(backup)
        assert wait_phase(backup, "in-sync")["node_id"] == primary.node_id
        node_id = primary.node_id
        backup_slot = f"{node_id}@127.0.0.1:{backup.port}"

        router = start_router(work / "router", _router_toml(work / "router"), expect=2)

        def pool() -> dict:
            status, body = router.get("/api/v1/routers/main/pool")
            assert status == 200, body
            return body

        def targets() -> dict:
            return {t["name"]: t for t in pool()["targets"]}

        def paired():
            p = pool()
            ts = {t["name"]: t for t in p["targets"]}
            pairs = p.get("pairs") or []
            if set(ts) != {node_id, backup_slot} or len(pairs) != 1 or pairs[0]["serving"] != node_id:
                return None
            return p

        p = wait_until(paired, 30, "the pool holds the primary and its announced backup as one pair, served")
        ts = {t["name"]: t for t in p["targets"]}
        prim, back = ts[node_id], ts[backup_slot]
        assert (prim["pair"], prim["backup"], prim["port"], prim["ready"]) == (node_id, False, primary.port, True), prim
        assert (back["pair"], back["backup"], back["port"], back["ready"]) == (node_id, True, backup.port, False), back
        assert prim["management_url"] == primary.management_url, prim
        assert back["management_url"] == backup.management_url, back        # probed through its own URL
        assert back["last_error"], back                                     # passive: its probe says not active
        (pair,) = p["pairs"]
        assert pair["name"] == node_id and pair["members"] == [node_id, backup_slot], pair
        assert pair["backups"] == [backup_slot] and pair["state"] == "serving", pair
        assert p["total"] == 1, p                                            # one routing identity
        m = p["membership"]
        assert m["members"] == [node_id] and m["slots"] == {node_id: [node_id, backup_slot]}, m
        assert m["backups"] == {node_id: [{"connector": backup.amqp_url, "management_url": backup.management_url,
                                           "in_sync": True}]}, m
        print(f"paired: {node_id} at {primary.port}, backup {backup_slot}")

        def route(key: str, broker) -> dict:
            """A proxied connection with container-id ``key``, seen by ``broker`` while open; its
            routing log line."""
            conn = BlockingConnection(router.url("proxy"), container_id=key, timeout=QUORUM_TIMEOUT_MS / 1000 + 10,
                                      **CLIENT)
            try:
                status, conns = broker.management_get("/api/v1/connections")
                assert status == 200 and any(c["container_id"] == key for c in conns), (broker.workdir.name, conns)
            finally:
                conn.close()

            def logged():
                for path in sorted((work / "router" / "logs").glob("routing*.log")):
                    for line in path.read_text().splitlines():
                        if line.strip():
                            rec = json.loads(line)
                            if rec.get("event") == "route" and rec.get("key_filtered") == key:
                                return rec
                return None
            return wait_until(logged, 10, f"the routing log line of {key}")

        before = route("before-the-kill", primary)
        assert before["action"] == "proxied" and before["target_name"] == node_id, before
        assert before["target_address"] == f"127.0.0.1:{primary.port}", before

        primary.kill()
        killed = time.monotonic()
        view = wait_active(backup, 60)          # GET /api/v1/ha: phase active
        assert view["node_id"] == node_id
        wait_until(lambda: broker_info(backup)["active"] is True and ha_view(backup)["active"] is True, 30,
                   "the backup serves (GET /api/v1/broker and /api/v1/ha: active)")
        took_over = time.monotonic() - killed
        assert broker_info(backup)["node_id"] == node_id

        # a new client once the backup took over: the router sends it to the backup's address
        after = route("after-the-failover", backup)
        assert after["action"] == "proxied" and after["outcome"] == "OK", after
        assert after["target_address"] == f"127.0.0.1:{backup.port}", after
        assert after["target_name"] == backup_slot and after["target_node_id"] == node_id, after
        # it announces the node id from its own address now: its slot is the node's member; the dead
        # primary's slot is held, not ready, for PAIR_HOLD_S (the pair stays a pair while the new
        # member is probed; router.core.membership.DiscoveryMembership)
        def followed():
            ts = targets()
            t, old = ts.get(backup_slot), ts.get(node_id)
            return (set(ts) == {backup_slot, node_id} and t["ready"] and not t["backup"] and t["pair"] == node_id
                    and not old["ready"])
        wait_until(followed, 10, "the backup's slot follows its announcement (the node itself, ready)")
        m = pool()["membership"]
        assert m["slots"] == {node_id: [backup_slot, node_id]} and m["backups"] == {} and m["left"] == 0, m
        assert router.get("/api/v1/counters")[1]["routers"]["main"].get("failover_wait_timeouts", 0) == 0
        print(f"backup active {took_over:.2f} s after the SIGKILL; routed to the backup at "
              f"{after['target_address']}")
        assert router.terminate() == 0
        text = router.stderr_text()
        assert "Traceback" not in text, text[-4000:]
        assert f"{backup_slot} joined" in text and f"backup of node {node_id}" in text, text[-4000:]
        assert f"{backup_slot} is now announced as node {node_id} itself" in text, text[-4000:]
        router = None
    finally:
        if router is not None:
            router.kill()
        for mb in made:
            if mb.proc is not None and mb.proc.poll() is None:
                mb.kill()


if __name__ == "__main__":
    work_dir = Path(sys.argv[1])
    work_dir.mkdir(parents=True, exist_ok=True)
    scenario(work_dir)
