"""Discovery scenarios, each run inside a network namespace that routes multicast on loopback
(tests/netns.py; tests/integration/test_cluster_discovery.py runs them). Real broker processes
(tests/clusterproc.py), ports from the OS; each scenario asserts and exits 0, or fails with the
reason on stderr.

    python -m tests.integration.discovery_scenarios <scenario> <work dir>
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from tests.clusterproc import (cluster_view, connect, send, start_node, wait_known_consumers, wait_mesh,
                               wait_until)

GROUP, PORT, OTHER_PORT = "231.7.7.7", 9876, 9877
PERIOD_MS, REFRESH_MS = 200, 1500


def groups(port: int = PORT, *, broadcast: bool = True, refresh_ms: int = REFRESH_MS) -> dict:
    cfg = {"discovery-groups.dg": {"group-address": GROUP, "group-port": port, "refresh-timeout-ms": refresh_ms,
                                   "initial-wait-timeout-ms": 1000}}
    if broadcast:
        cfg["broadcast-groups.bg"] = {"group-address": GROUP, "group-port": port, "local-bind-address": "127.0.0.1",
                                      "broadcast-period-ms": PERIOD_MS}
    return cfg


def node(work: Path, name: str, *, port: int = PORT, broadcast: bool = True, extra: dict | None = None,
         config: dict | None = None):
    return start_node(work, name, extra={"discovery-group": "dg", **(extra or {})},
                      config={**groups(port, broadcast=broadcast), **(config or {})})


def entries(n) -> dict:
    d = cluster_view(n)["discovery"]
    return {e["node_id"]: e for e in d["entries"]}


def counters(n) -> dict:
    return cluster_view(n)["discovery"]["counters"]


def see(work: Path) -> None:
    """A discovery group sees a broadcaster within the refresh timeout, nothing on another port,
    ignores its own node, and loses a stopped broadcaster only after the refresh timeout."""
    listener = node(work, "listener", broadcast=False)
    elsewhere = node(work, "elsewhere", port=OTHER_PORT, broadcast=False)
    t0 = time.monotonic()
    a = node(work, "a")
    try:
        wait_until(lambda: a.node_id in entries(listener), REFRESH_MS / 1000.0 + 2, "listener hears a")
        heard_after = time.monotonic() - t0
        wait_until(lambda: counters(a)["own"] >= 2, 10, "a hears its own broadcasts")
        assert a.node_id not in entries(a), "a group must ignore its own node"
        assert entries(elsewhere) == {} and counters(elsewhere)["received"] == 0, "another port hears nothing"
        wait_mesh([a, listener])  # discovery alone made the bridges
        # Expiry is measured from the last refresh the listener got (its entry's age), not from
        # when terminate() returns: a's broadcaster stops at the signal, before the node's
        # graceful shutdown (connections closed, journal flushed, interpreter exit), and under
        # load that shutdown alone takes longer than the slack one period gave.
        last_refresh = time.monotonic() - entries(listener)[a.node_id]["age_s"]

        def expired():
            nonlocal last_refresh
            asked = time.monotonic()
            e = entries(listener).get(a.node_id)
            if e is not None:  # asked <= the listener's now: never later than its last refresh
                last_refresh = asked - e["age_s"]
                return False
            return time.monotonic() - last_refresh
        a.terminate()
        gone_after = wait_until(expired, 10, "the entry expires")
        # no sooner than the refresh timeout after the last refresh (age_s is rounded to 1 ms)
        assert gone_after >= REFRESH_MS / 1000.0 - 0.001, f"expired too early: {gone_after:.3f} s"
        assert gone_after <= REFRESH_MS / 1000.0 + 1.5, f"expired too late: {gone_after:.2f} s"
        print(f"heard after {heard_after:.2f} s (start included); expired {gone_after:.2f} s after its last refresh")
    finally:
        for n in (a, listener, elsewhere):
            n.kill()


def balance(work: Path) -> None:
    """Three nodes found by discovery alone balance messages as with static connectors."""
    nodes = [node(work, f"n{i}", config={"addresses.orders": {"routing-types": ["anycast"]}}) for i in range(3)]
    try:
        wait_mesh(nodes)
        conns, receivers = [], []
        for n in nodes:
            c = connect(n)
            conns.append(c)
            receivers.append(c.create_receiver("orders", credit=300))
        wait_known_consumers(nodes[0], "orders", 2)
        send(nodes[0], "orders", [f"m{i}" for i in range(300)])
        counts = []
        seen = set()
        for r in receivers:
            got = []
            for _ in range(100):
                got.append(r.receive(timeout=20).body)
                r.accept()
            counts.append(len(got))
            seen.update(got)
        assert counts == [100, 100, 100] and len(seen) == 300, counts
        for c in conns:
            c.close()
        for n in nodes:
            assert n.queue("orders")["depth"] == 0
        print("300 messages: 100 / 100 / 100")
    finally:
        for n in nodes:
            n.kill()


def flood(work: Path) -> None:
    """Garbage, forged (unsigned, wrongly signed) and made-up announcements are counted and
    dropped; a group flooded with made-up members keeps its real ones."""
    from broker.wire.discovery import MAX_ENTRIES, Announcement, encode_announcement
    keyed = {"key": "the-cluster-key"}
    a = node(work, "a", extra=keyed)
    b = node(work, "b", extra=keyed)
    plain = node(work, "plain", port=OTHER_PORT)  # a cluster without a key, for the member flood
    try:
        wait_mesh([a, b])
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        s.bind(("127.0.0.1", 0))
        garbage = [b"", b"LDSc", os.urandom(64), b"LDSc\x01\x00" + os.urandom(40), b"x" * 2000]
        forged = [encode_announcement(Announcement("evil-node", "test-cluster", "", ("amqp://127.0.0.1:1",), 1)),
                  encode_announcement(Announcement("evil-node", "test-cluster", "", ("amqp://127.0.0.1:1",), 2),
                                      key="a-wrong-key")]
        before = counters(b)["garbage"]
        for pkt in garbage + forged:
            s.sendto(pkt, (GROUP, PORT))
        wait_until(lambda: counters(b)["garbage"] >= before + len(garbage) + len(forged), 10, "counted as garbage")
        assert "evil-node" not in entries(b)
        # a flood of made-up members on the keyless group: the table fills, the real one stays
        wait_until(lambda: len(entries(plain)) == 0 and counters(plain)["own"] > 0, 10, "plain hears itself")
        real = node(work, "real", port=OTHER_PORT)
        wait_until(lambda: real.node_id in entries(plain), 10, "plain hears real")
        # MAX_ENTRIES + 500 made-up members, sent again (a newer sequence: a refresh) until the
        # table is full: on a loaded machine the kernel drops part of each burst, and what did
        # arrive would otherwise expire before the rest came
        deadline = time.monotonic() + 30
        rounds = 0
        while counters(plain)["full"] == 0:
            assert time.monotonic() < deadline, f"the table never filled up ({len(entries(plain))} entries)"
            rounds += 1
            for i in range(MAX_ENTRIES + 500):
                s.sendto(encode_announcement(Announcement(f"fake-{i}", "test-cluster", "", ("amqp://127.0.0.1:9",),
                                                          rounds)), (GROUP, OTHER_PORT))
                if i % 50 == 49:
                    time.sleep(0.005)   # pacing, not a wait: a faster burst only overflows the buffer
        # the thing under test: a refresh timeout passes, and the real member has kept refreshing
        # its entry (one older than a refresh timeout would have expired)
        time.sleep(REFRESH_MS / 1000.0 + 0.5)
        ents = entries(plain)
        assert real.node_id in ents and ents[real.node_id]["age_s"] < REFRESH_MS / 1000.0, ents.get(real.node_id)
        assert len(ents) <= MAX_ENTRIES
        real.kill()
        print(f"garbage {counters(b)['garbage']}, full {counters(plain)['full']}")
    finally:
        for n in (a, b, plain):
            n.kill()


def router_pool(work: Path) -> None:
    """A router's discovery pool (source = "discovery") follows the brokers' signed broadcasts:
    both join and take clients through the proxy acceptor; a killed one leaves after the
    refresh timeout and clients keep being routed to the other."""
    from proton.utils import BlockingConnection

    from tests.waiting import wait_for
    from tests.routerproc import start_router, toml_str
    from tests.serverproc import REPO

    key = "the-cluster-key"
    nodes = [node(work, n, extra={"key": key}) for n in ("a", "b")]
    router = None
    try:
        ids = {n.node_id for n in nodes}
        router = start_router(work / "router", "\n".join([
            'name = "r"', f'users-file = {toml_str(str(REPO / "etc" / "users.toml"))}',
            "[management]", "port = 0", 'user = "admin"', 'password = "admin"',
            "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
            "[routers.main]", 'key-type = "CLIENT_ID"',
            "[routers.main.policy]", 'name = "CONSISTENT_HASH"',
            "[routers.main.pool]", 'source = "discovery"', "check-period = 200", "quorum-timeout = 0",
            'username = "admin"', 'password = "admin"',
            "[routers.main.pool.discovery-group]", f'group-address = "{GROUP}"', f"group-port = {PORT}",
            f"refresh-timeout-ms = {REFRESH_MS}", "initial-wait-timeout-ms = 5000",
            'cluster = "test-cluster"', f'key = "{key}"']) + "\n", expect=2)

        def pool() -> dict:
            status, body = router.get("/api/v1/routers/main/pool")
            assert status == 200, body
            return body

        def ready() -> set:
            return {t["node_id"] for t in pool()["targets"] if t["ready"]}

        def members() -> set:
            return {t["name"] for t in pool()["targets"]}

        def landed(k: str) -> str:
            conn = BlockingConnection(router.url("proxy"), container_id=k, user="app", password="app",
                                      allowed_mechs="PLAIN", allow_insecure_mechs=True, timeout=10)
            try:
                def where():
                    found = [n.node_id for n in nodes if n.proc.poll() is None
                             and any(c["container_id"] == k for c in n.management_get("/api/v1/connections")[1])]
                    return found or None
                found = wait_for(where, 10)
                assert len(found) == 1, found
                return found[0]
            finally:
                conn.close()

        wait_until(lambda: ready() == ids, 15, "both brokers join the pool, probed ready")
        p = pool()
        assert members() == ids, p
        assert {t["port"] for t in p["targets"]} == {n.port for n in nodes}, p
        m = p["membership"]
        assert m["source"] == "discovery" and m["members"] == sorted(ids) and m["last_error"] is None, m
        assert m["signed_only"] and m["joined"] == 2, m
        seen: dict[str, str] = {}
        for i in range(60):
            seen[f"k{i}"] = landed(f"k{i}")
            if set(seen.values()) == ids:
                break
        assert set(seen.values()) == ids, seen

        gone, stays = nodes[1], nodes[0]
        gone.kill()
        killed = time.monotonic()
        # the health probe takes it out of routing first; it stays a member until its entry expires
        wait_until(lambda: gone.node_id not in ready(), 10, "the killed broker is not ready")
        still_member = gone.node_id in members()
        n, wrong = 0, []

        def left():
            nonlocal n  # clients keep being routed while the dead broker is still a member
            n += 1
            try:
                where = landed(f"during-{n}")
            except AssertionError as exc:  # wait_until would retry it: record it instead
                where = f"not routed: {exc}"
            if where != stays.node_id:
                wrong.append(where)
            return (gone.node_id not in members()) and time.monotonic() - killed
        left_after = wait_until(left, REFRESH_MS / 1000.0 + 10, "the killed broker leaves the pool")
        assert not wrong, wrong
        assert still_member, "it left before the refresh timeout"
        # its last announcement came at most one period before the kill
        assert left_after >= (REFRESH_MS - PERIOD_MS) / 1000.0 - 0.05, f"left too early: {left_after:.2f} s"
        m = pool()["membership"]
        assert m["members"] == [stays.node_id] and m["left"] == 1, m
        assert ready() == members() == {stays.node_id}
        for k in list(seen)[:10]:
            assert landed(k) == stays.node_id
        print(f"both joined; {n} clients routed while it was leaving; left {left_after:.2f} s after the kill")
    finally:
        if router is not None:
            router.terminate()
        for n in nodes:
            n.kill()


def client_udp(work: Path) -> None:
    """A client given only udp://group:port hears two brokers (broadcast groups, no cluster) and
    spreads its connections over them round-robin; a garbage datagram changes nothing."""
    from router.client import ClusterConnector
    bg = {"broadcast-groups.bg": groups()["broadcast-groups.bg"]}
    from tests.brokerproc import BrokerProcess, write_config
    brokers = []
    for name in ("b1", "b2"):
        path = write_config(work / name, name=name, config=bg)
        brokers.append(BrokerProcess(work / name, path).start())
    connector = ClusterConnector(f"udp://{GROUP}:{PORT}?refresh-timeout={REFRESH_MS}&initial-wait-timeout=5000",
                                 user="app", password="app", timeout=10, allowed_mechs="PLAIN")
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        s.sendto(b"not an announcement", (GROUP, PORT))
        wait_until(lambda: len(connector.discoverer.members(wait=True)) == 2, 10, "the client hears both brokers")
        assert connector.discoverer.group.counters["garbage"] >= 1
        conns = [connector.connect(container_id=f"udp-client-{i}") for i in range(4)]
        where = sorted(c.lodestone_url for c in conns)
        assert where == sorted([b.amqp_url for b in brokers] * 2), where
        for b in brokers:
            status, cs = b.management_get("/api/v1/connections")
            assert sum(1 for c in cs if (c["container_id"] or "").startswith("udp-client-")) == 2, cs
        for c in conns:
            c.close()
        print("4 connections: 2 / 2")
    finally:
        connector.close()
        for b in brokers:
            b.kill()


if __name__ == "__main__":
    scenario, work = sys.argv[1], Path(sys.argv[2])
    work.mkdir(parents=True, exist_ok=True)
    {"see": see, "balance": balance, "flood": flood, "router_pool": router_pool, "client_udp": client_udp}[scenario](work)
