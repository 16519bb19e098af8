"""A connection router inside the broker (issue 11, part 4), against real broker processes.

Three cluster nodes, each with its only acceptor routed by an embedded router (``[acceptors.amqp]
router = "gravity"``): key CLIENT_ID, CONSISTENT_HASH over a pool taken from the cluster, the
node itself as the local target (``local-target-enabled``) and ``local-.*`` kept local.

Oracles independent of the router under test: the node a redirect names is looked up in the
*cluster's* processes (each broker's own port and node id, from its banner and its own
``/api/v1/broker``); a connection that stays is found in that broker's ``/api/v1/connections``;
the unmodified python-qpid-proton client (``router.client._open_once``: one hop, no following)
sees the Close condition and its info exactly as a proton client of Artemis would. The cluster
still forms through routed acceptors (its own connections are exempt), and forwards messages.
"""

from __future__ import annotations

import json
import uuid

import pytest

from router.client import _open_once
from tests.brokerproc import ADMIN
from tests.clusterproc import CLUSTER_PASSWORD, start_cluster, start_node, wait_mesh, wait_until
from tests.serverproc import http_json

pytestmark = pytest.mark.timeout(240)

CLIENT = {"user": "app", "password": "app", "allowed_mechs": "PLAIN", "timeout": 20}


def router_config(*, local_enabled: bool = True, policy: str = "CONSISTENT_HASH",
                  extra_pool: dict | None = None) -> dict:
    return {"acceptors.amqp": {"router": "gravity"},
            "routers.gravity": {"key-type": "CLIENT_ID", "local-target-filter": "local-.*"},
            "routers.gravity.policy": {"name": policy},
            "routers.gravity.pool": {"source": "cluster", "check-period": 300,
                                     "local-target-enabled": local_enabled, **(extra_pool or {})},
            "routing-log": {"path": "routing.log"}}


@pytest.fixture
def nodes(tmp_path):
    made = start_cluster(tmp_path, 3, config=router_config())
    yield made
    for n in made:
        if n.proc is not None and n.proc.poll() is None:
            n.kill()


def api(node, path: str, method: str = "GET", body=None):
    status, out = http_json(node.management_url + path, method=method, body=body, auth=ADMIN, timeout_s=10)
    return status, out


def pool_ready(node) -> int:
    status, pool = api(node, "/api/v1/routers/gravity/pool")
    assert status == 200, pool
    return pool["ready"]


def open_connections(node, container_id: str) -> int:
    status, conns = api(node, "/api/v1/connections")
    assert status == 200, conns
    return sum(1 for c in conns if c.get("container_id") == container_id)


def route_lines(node) -> list[dict]:
    path = node.workdir / "routing.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def try_connect(node, container_id: str):
    """(connection, None) when it stayed on ``node``, (None, condition) when redirected."""
    return _open_once(node.amqp_url, {**CLIENT, "container_id": container_id})


def test_local_keys_stay_and_the_others_are_redirected_where_the_api_says(nodes):
    wait_mesh(nodes)   # the cluster formed through routed acceptors: its own connections are exempt
    by_id = {n.node_id: n for n in nodes}
    a = nodes[0]
    wait_until(lambda: pool_ready(a) == 3, 20, "node0's pool: itself and both members ready")

    # a key matching the local-target-filter stays on this node, and is served there
    conn, cond = try_connect(a, "local-orders-1")
    assert cond is None
    try:
        assert open_connections(a, "local-orders-1") == 1
        snd = conn.create_sender("gravity-q")
        from proton import Message
        snd.send(Message(body="stays here"))
    finally:
        conn.close()

    where: dict[str, list[str]] = {n.node_id: [] for n in nodes}
    for i in range(40):
        cid = f"app-{i}-{uuid.uuid4().hex[:6]}"
        status, named = api(a, f"/api/v1/routers/gravity/target?key={cid}")
        assert status == 200 and named["outcome"] == "OK", named
        conn, cond = try_connect(a, cid)
        if named["local"]:
            assert named["nodeID"] == a.node_id and named["connector"] is None
            assert cond is None, f"{cid}: the API says local, the broker redirected: {cond}"
            assert open_connections(a, cid) == 1
            conn.close()
        else:
            assert conn is None, f"{cid}: the API names {named['nodeID']}, the client stayed on node0"
            assert cond.name == "amqp:connection:redirect"
            target = by_id[named["nodeID"]]            # the real process with that node id
            assert dict(cond.info) == {"network-host": "127.0.0.1", "port": target.port}
            assert cond.description == f"Connection router gravity redirected this connection to 127.0.0.1:{target.port}"
            assert named["connector"]["params"] == {"host": "127.0.0.1", "port": str(target.port)}
            # following it by hand: the target's own router keeps the key (same pool, same hash)
            conn2, cond2 = try_connect(target, cid)
            assert cond2 is None, cond2
            assert open_connections(target, cid) == 1
            conn2.close()
        where[named["nodeID"]].append(cid)
    assert all(where.values()), {k[:8]: len(v) for k, v in where.items()}  # every node got keys

    # the routing log says the same, line for line
    lines = {ln["container_id"]: ln for ln in wait_until(
        lambda: (lambda ls: ls if len(ls) >= 41 else None)(route_lines(a)), 10, "41 route lines")}
    for node_id, cids in where.items():
        for cid in cids:
            ln = lines[cid]
            assert ln["target_node_id"] == node_id
            assert ln["action"] == ("local" if node_id == a.node_id else "redirected")
            assert (ln["router"], ln["acceptor"], ln["key_type"]) == ("gravity", "amqp", "CLIENT_ID")
    assert lines["local-orders-1"]["action"] == "local" and lines["local-orders-1"]["local"] is True

    # and the cluster still works through routed acceptors: a producer kept on node1 reaches a
    # consumer kept on node2 (both keys local to where they connected)
    from proton import Message
    from proton.utils import BlockingConnection
    rc = BlockingConnection(nodes[2].amqp_url, container_id="local-consumer", **{
        k: v for k, v in CLIENT.items()})
    try:
        rcv = rc.create_receiver("gravity-forwarded", credit=10)
        wait_until(lambda: any(b["queue"] == "gravity-forwarded" and b["consumers"]
                               for b in api(nodes[1], "/api/v1/cluster")[1]["remote_bindings"]), 20,
                   "node1 knows the consumer on node2")
        pc = BlockingConnection(nodes[1].amqp_url, container_id="local-producer", **CLIENT)
        try:
            snd = pc.create_sender("gravity-forwarded")
            for k in range(10):
                snd.send(Message(body=f"m{k}", durable=True))
        finally:
            pc.close()
        got = [rcv.receive(timeout=20).body for _ in range(10)]
        rcv.accept()
        assert got == [f"m{k}" for k in range(10)]
    finally:
        rc.close()


def test_a_killed_member_leaves_the_pool_and_its_keys_go_to_a_ready_broker(nodes):
    wait_mesh(nodes)
    a, b, c = nodes
    wait_until(lambda: pool_ready(a) == 3, 20, "node0's pool ready")
    keys_on_c = []
    i = 0
    while len(keys_on_c) < 3:
        cid = f"k-{i}"
        i += 1
        status, named = api(a, f"/api/v1/routers/gravity/target?key={cid}")
        if named["nodeID"] == c.node_id:
            keys_on_c.append(cid)
    c.kill()
    wait_until(lambda: pool_ready(a) == 2, 10, "node2 out of node0's pool")
    status, pool = api(a, "/api/v1/routers/gravity/pool")
    assert c.node_id not in {t["node_id"] for t in pool["targets"]}, pool
    for cid in keys_on_c:
        conn, cond = try_connect(a, cid)
        status, named = api(a, f"/api/v1/routers/gravity/target?key={cid}")
        assert named["nodeID"] in (a.node_id, b.node_id), named
        if named["local"]:
            assert cond is None
            conn.close()
        else:
            assert dict(cond.info) == {"network-host": "127.0.0.1", "port": b.port}


def test_refusals_are_artemis_conditions_and_bad_handshakes_close_one_client(tmp_path):
    # no pool, no policy: every key but a local one is refused (REFUSED_USE_ANOTHER), as Artemis
    node = start_node(tmp_path, "solo", config={
        "acceptors.amqp": {"router": "only-local"},
        "routers.only-local": {"key-type": "USER_NAME", "local-target-filter": "admin"}})
    try:
        with pytest.raises(Exception) as info:
            try_connect(node, "x")   # user app: not local, nowhere else to go
        text = str(info.value)
        assert "amqp:connection:forced" in text and "Connection router only-local rejected this connection" in text
        conn, cond = _open_once(node.amqp_url, {"user": "admin", "password": "admin", "allowed_mechs": "PLAIN",
                                                "timeout": 20, "container_id": "x"})
        assert cond is None
        conn.close()
        # garbage where the Open should be: this client alone gets a framing error
        import socket
        from broker.wire.frames import AMQP_HEADER, SASL_HEADER, encode_frame, FRAME_SASL
        from broker.wire.frames import SaslInit
        from broker.wire.codec import Symbol
        from proton import symbol  # noqa: F401  (the client library is installed)
        host, port = "127.0.0.1", node.port
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit(Symbol("PLAIN"), b"\0app\0app"))
                      + AMQP_HEADER + b"\x00\x00\x00\x10\x02\x00\x00\x00garbage!")
            got = b""
            s.settimeout(10)
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        assert b"amqp:connection:framing-error" in got or b"amqp:decode-error" in got, got
        status, br = http_json(node.management_url + "/api/v1/broker", auth=ADMIN)
        assert status == 200 and br["active"] is True
        status, routers = http_json(node.management_url + "/api/v1/routers", auth=ADMIN)
        assert status == 200 and routers[0]["name"] == "only-local", routers
        # the cluster user (what a cluster pool probes with) may read the broker, nothing else
        cluster_user = ("cluster-user", CLUSTER_PASSWORD)
        assert http_json(node.management_url + "/api/v1/broker", auth=cluster_user)[0] == 200
        assert http_json(node.management_url + "/api/v1/connections", auth=cluster_user)[0] == 403
        assert http_json(node.management_url + "/api/v1/broker", auth=("cluster-user", "wrong"))[0] == 401
    finally:
        node.kill()
