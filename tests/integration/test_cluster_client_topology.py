"""Topology to clients (issue 11, part 2), against real broker processes (tests/clusterproc.py).

A cluster node lists the live members in the Open property ``lodestone:cluster-members``
(read here with an unmodified python-qpid-proton BlockingConnection); ``router.client``'s
ClusterConnector, given one broker's URL, learns the others from it and spreads new
connections over them. Where each connection landed is read from each broker's
``GET /api/v1/connections`` (container ids), not from the client's own bookkeeping. Every wait
is on what the management API shows.
"""

from __future__ import annotations

import collections
import random
import socket

import pytest
from proton.utils import BlockingConnection

from broker.wire.frames import CLUSTER_MEMBERS
from router.client import ClusterConnector, NoBrokerReachable
from tests.brokerproc import start_broker
from tests.clusterproc import cluster_view, connect, start_cluster, start_node, wait_mesh, wait_until

pytestmark = pytest.mark.timeout(180)

CREDS = {"user": "app", "password": "app", "allowed_mechs": "PLAIN", "timeout": 20}


@pytest.fixture
def cluster(tmp_path):
    made = []

    def make(n):
        nodes = start_cluster(tmp_path, n)
        made.extend(nodes)
        return nodes
    make.more = made
    yield make
    for n in made:
        if n.proc is not None and n.proc.poll() is None:
            n.kill()


def open_members(conn: BlockingConnection) -> list[dict]:
    props = conn.conn.remote_properties
    return [dict(e) for e in props[CLUSTER_MEMBERS]]


def landed(nodes, prefix: str) -> dict[str, int]:
    """How many connections whose container id starts with ``prefix`` each broker has open."""
    out = {}
    for n in nodes:
        status, conns = n.management_get("/api/v1/connections")
        assert status == 200, conns
        out[n.node_id] = sum(1 for c in conns if (c.get("container_id") or "").startswith(prefix))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_open_lists_the_live_members_unmodified_proton(cluster, tmp_path):
    nodes = cluster(3)
    wait_mesh(nodes)
    conn = connect(nodes[1])            # a plain BlockingConnection
    try:
        members = open_members(conn)
        props = conn.conn.remote_properties
        assert props["node-id"] == nodes[1].node_id and props["started-ms"] > 0
    finally:
        conn.close()
    # the answering node first, its own connector (the port it got), then the others by node id
    assert members[0] == {"node-id": nodes[1].node_id, "connector": nodes[1].amqp_url}
    others = sorted(((n.node_id, n.amqp_url) for n in (nodes[0], nodes[2])))
    assert [(m["node-id"], m["connector"]) for m in members[1:]] == others

    # a member that is gone is not live: once node 2's bridges are down, the Open leaves it out
    nodes[2].kill()
    gone = nodes[2].node_id
    wait_until(lambda: not any(b["connected"] for b in cluster_view(nodes[0])["bridges"] if b["to"] == gone),
               what="node 0's bridge to the killed node down")
    conn = connect(nodes[0])
    try:
        assert {m["node-id"] for m in open_members(conn)} == {nodes[0].node_id, nodes[1].node_id}
    finally:
        conn.close()

    # a node without [cluster] says nothing of the kind
    alone = start_broker(tmp_path, name="alone")
    cluster.more.append(alone)
    conn = BlockingConnection(alone.amqp_url, **CREDS)
    try:
        assert CLUSTER_MEMBERS not in (conn.conn.remote_properties or {})
    finally:
        conn.close()


def test_client_learns_the_cluster_and_round_robins_new_connections(cluster, tmp_path):
    nodes = cluster(3)
    wait_mesh(nodes)
    ids = [n.node_id for n in nodes]
    connector = ClusterConnector(nodes[1].amqp_url, policy="round-robin", rng=random.Random(4), **CREDS)
    opened = []
    try:
        first = connector.connect(container_id="topo-learn")
        opened.append(first)
        assert first.lodestone_node_id == ids[1]          # the only broker it knew
        assert sorted(m.node_id for m in connector.members) == sorted(ids)
        assert sorted(m.url for m in connector.members) == sorted(n.amqp_url for n in nodes)

        for i in range(12):
            opened.append(connector.connect(container_id=f"topo-a-{i}"))
        # exactly even, as each broker sees it
        assert landed(nodes, "topo-a-") == {i: 4 for i in ids}
        assert collections.Counter(c.lodestone_node_id for c in opened[1:]) == {i: 4 for i in ids}
        # and in rotation: consecutive connections go to different brokers
        picks = [c.lodestone_node_id for c in opened[1:]]
        assert all(picks[k] != picks[k + 1] for k in range(len(picks) - 1))

        # a fourth node joins; the client hears of it on its next connection
        d = start_node(tmp_path, "node3", static=[nodes[0].amqp_url])
        cluster.more.append(d)
        nodes4 = nodes + [d]
        wait_mesh(nodes4)
        opened.append(connector.connect(container_id="topo-learn-2"))
        assert sorted(m.node_id for m in connector.members) == sorted(n.node_id for n in nodes4)
        for i in range(8):
            opened.append(connector.connect(container_id=f"topo-b-{i}"))
        assert landed(nodes4, "topo-b-") == {n.node_id: 2 for n in nodes4}
        assert landed(nodes4, "topo-a-") == {**{i: 4 for i in ids}, d.node_id: 0}
    finally:
        for c in opened:
            c.close()


def test_client_skips_a_dead_member_and_falls_back_to_its_starting_urls(cluster):
    nodes = cluster(2)
    wait_mesh(nodes)
    dead = f"amqp://127.0.0.1:{free_port()}"
    # Artemis's list syntax; the first URL does not answer
    connector = ClusterConnector(f"({dead},{nodes[0].amqp_url})", policy="first-element", **CREDS)
    c = connector.connect(container_id="topo-fb-0")
    try:
        assert c.lodestone_url == nodes[0].amqp_url
        assert len(connector.members) == 2
    finally:
        c.close()

    # the member the policy picks is killed: the next one takes the connection
    first = connector.members[0]
    victim = next(n for n in nodes if n.node_id == first.node_id)
    survivor = next(n for n in nodes if n is not victim)
    victim.kill()
    c = connector.connect(container_id="topo-fb-1")
    try:
        assert c.lodestone_node_id == survivor.node_id
    finally:
        c.close()

    # nothing answers at all: every attempt is reported, the starting URLs included
    survivor.kill()
    with pytest.raises(NoBrokerReachable) as err:
        connector.connect(timeout=5)
    assert {dead, nodes[0].amqp_url, survivor.amqp_url} <= set(err.value.urls)
    assert len(err.value.urls) == len(set(err.value.urls))
