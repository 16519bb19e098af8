"""The job on logs written by the real producers: three real broker processes in one cluster
(tests/clusterproc.py, ON_DEMAND), a real router following them (tests/routerproc.py, proxy
acceptor, CLIENT_ID keys, a routing log rotated every few lines), unmodified python-qpid-proton
clients. The oracles are independent of the job: where each connection landed is read from the
brokers' own management APIs, message sizes from proton's own encoder; the pins the job writes are
then loaded by the real router, and the moved key's next connection lands where they say."""

from __future__ import annotations

import json
import shutil

import pytest
from proton import Message
from proton.utils import BlockingConnection

from spark.jobs.gravity import parse_args, run
from tests.clusterproc import start_cluster, wait_known_consumers, wait_mesh
from tests.routerproc import start_router, toml_str
from tests.serverproc import REPO
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.spark]

N = 20
BODY = "x" * 1000


def _router_toml(seed: str, workdir) -> str:
    return "\n".join([
        'name = "r"', f'users-file = {toml_str(str(REPO / "etc" / "users.toml"))}',
        "[management]", "port = 0", 'user = "admin"', 'password = "admin"',
        "[routing-log]", f"path = {toml_str(str(workdir / 'routing.log'))}", "max-bytes = 3000", "backups = 50",
        "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
        "[routers.main]", 'key-type = "CLIENT_ID"',
        "[routers.main.policy]", 'name = "CONSISTENT_HASH"',
        "[routers.main.cache]", 'fail-back = "return"',
        "[routers.main.pool]", 'source = "cluster"', f"seed-connectors = [{toml_str(seed)}]",
        "check-period = 200", "quorum-timeout = 0", 'username = "admin"', 'password = "admin"',
        "[routers.main.pins]", f"file = {toml_str(str(workdir / 'pins.jsonl'))}"]) + "\n"


def _connect(router, key: str) -> BlockingConnection:
    return BlockingConnection(router.url("proxy"), container_id=key, user="app", password="app",
                              allowed_mechs="PLAIN", allow_insecure_mechs=True, timeout=20)


def _where(nodes, key: str) -> str:
    """The node id of the broker whose management API lists a connection of ``key``."""
    def found():
        hits = [n.node_id for n in nodes
                if any(c["container_id"] == key for c in n.management_get("/api/v1/connections")[1])]
        return hits or None
    hits = wait_for(found, 10)
    assert len(hits) == 1, hits
    return hits[0]


def _keys_on(router, prefix: str, want_same: bool) -> tuple[str, str, str, str]:
    """A producer and a consumer key the router puts on different (or the same) brokers."""
    for i in range(200):
        p, c = f"{prefix}-p{i}", f"{prefix}-c{i}"
        np_ = router.target_for("main", p)["target"]["node_id"]
        nc = router.target_for("main", c)["target"]["node_id"]
        if (np_ == nc) == want_same:
            return p, c, np_, nc
    raise AssertionError("no such keys")


def _records(paths) -> list[dict]:
    return [json.loads(line) for p in paths for line in p.read_text().splitlines() if line.strip()]


def _logs_written(rdir, nodes, flows: list[tuple[str, str, str]], address: str, nbytes: int) -> bool:
    """What the job will read is on disk: for every (producer key, consumer key, address) of
    ``flows`` its ``nbytes`` produced and consumed (activity records), both connections' close
    lines (routing log), and ``address``'s ``nbytes`` forwarded and received over the cluster (the
    bridges' forward / forward-in records)."""
    routing = _records(sorted(rdir.glob("routing.log*")))
    closed = {r["container_id"] for r in routing if r["event"] == "close"}
    activity = _records([n.data_dir / "activity.jsonl" for n in nodes])

    def total(direction: str, *, key: str | None = None, addr: str) -> int:
        return sum(r["bytes"] for r in activity if r["direction"] == direction and r["address"] == addr
                   and (key is None or r["container_id"] == key))
    return (all(total("produce", key=p, addr=a) == nbytes and total("consume", key=c, addr=a) == nbytes
                and {p, c} <= closed for p, c, a in flows)
            and total("forward", addr=address) == nbytes and total("forward-in", addr=address) == nbytes)


def test_job_on_logs_of_real_brokers_and_router(spark, tmp_path):
    nodes = start_cluster(tmp_path, 3)
    router = None
    try:
        wait_mesh(nodes)
        rdir = tmp_path / "router"
        router = start_router(rdir, _router_toml(nodes[0].management_url, rdir), expect=2)
        wait_for(lambda: sum(t["ready"] for t in router.get("/api/v1/routers/main/pool")[1]["targets"]) == 3, 20)
        by_id = {n.node_id: n for n in nodes}
        apart = _keys_on(router, "orders", want_same=False)   # producer and consumer on two brokers
        together = _keys_on(router, "audit", want_same=True)  # both on one broker
        size = len(Message(body=BODY).encode())               # the broker counts encoded message bytes
        for (p, c, np_, nc), address in ((apart, "orders"), (together, "audit")):
            cc = _connect(router, c)
            try:
                rcv = cc.create_receiver(address, credit=N)
                assert _where(nodes, c) == nc
                if np_ != nc:
                    wait_known_consumers(by_id[np_], address, 1)
                pc = _connect(router, p)
                try:
                    assert _where(nodes, p) == np_
                    snd = pc.create_sender(address)
                    for _ in range(N):
                        snd.send(Message(body=BODY))
                finally:
                    pc.close()
                for _ in range(N):
                    assert rcv.receive(timeout=20).body == BODY
                    rcv.accept()
            finally:
                cc.close()
        # the bridges' forward records (1 s windows), the activity records and the routing log
        # (flushed every 0.5 s) are written; a line being appended is not read yet (ValueError)
        flows = [(apart[0], apart[1], "orders"), (together[0], together[1], "audit")]
        wait_for(lambda: _logs_written(rdir, nodes, flows, "orders", N * size), 20, interval_s=0.1,
                 ignore=(OSError, ValueError), what="the activity records and the routing log on disk")

        routing = sorted(rdir.glob("routing.log*"))
        assert len(routing) >= 2, routing                     # the routing log rotated
        activity = [n.data_dir / "activity.jsonl" for n in nodes]
        opts = parse_args([str(rdir), *map(str, activity), "--out", str(tmp_path / "out"), "--max-skew", "2",
                           "--quiet", *[f"--broker={b}" for b in by_id]])
        assert opts.files == sorted(map(str, routing)) + list(map(str, activity))  # stderr logs not read
        s = run(spark, opts)

        assert s["lines_malformed"] == 0 and s["lines_read"] > 0
        assert s["key_type"] == "CLIENT_ID" and sorted(s["brokers"]) == sorted(by_id)
        rows = {r["key"]: r for r in s["per_key"]}
        p, c, np_, nc = apart
        assert rows[p]["current_node_id"] == np_ and rows[c]["current_node_id"] == nc
        assert rows[p]["produce_bytes"] == N * size and rows[c]["consume_bytes"] == N * size
        assert rows[p]["gravity_score"] == 1.0 and rows[c]["gravity_score"] == 0.0
        homes = {a["address"]: a["home_node_id"] for a in s["addresses"]}
        assert homes["orders"] == np_
        # every message of orders crossed once, from the producer's broker to the consumer's
        assert {(m["from"], m["to"]): m["bytes"] for m in s["bytes_moved"]} == {(np_, nc): N * size}
        assert s["cross_broker_bytes"] == N * size
        ap, ac, an, _ = together
        assert rows[ap]["gravity_score"] == 1.0 and rows[ac]["gravity_score"] == 1.0 and homes["audit"] == an
        # the recommendation puts orders' producer and consumer together: nothing crosses
        assert rows[p]["recommended_node_id"] == rows[c]["recommended_node_id"]
        assert s["recommended_cross_broker_bytes"] == 0

        # close the loop: the router re-reads its pins file every check-period
        pins = [json.loads(line) for line in (tmp_path / "out" / "pins.jsonl").read_text().splitlines()]
        assert {x["key"] for x in pins} == set(rows)
        moved = next(k for k in (p, c) if rows[k]["moved"])
        def reloads() -> int:
            return router.get("/api/v1/counters")[1]["routers"]["main"]["pins_reloads"]
        before = reloads()
        shutil.copy(tmp_path / "out" / "pins.jsonl", rdir / "pins.jsonl")
        wait_for(lambda: reloads() > before, 10)
        conn = _connect(router, moved)
        try:
            assert _where(nodes, moved) == rows[moved]["recommended_node_id"]
        finally:
            conn.close()
    finally:
        if router is not None:
            router.terminate()
        for n in nodes:
            n.kill()
