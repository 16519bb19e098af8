"""Message load balancing across real broker processes (issue 10): ON_DEMAND, STRICT, OFF, a
5-node mesh, max-hops on a chain, the cluster address filter, multicast across nodes.

Every node is a real ``python -m broker`` process (tests/clusterproc.py), every client an
unmodified python-qpid-proton BlockingConnection. Counts are exact; the tests wait on what the
management API shows (bridges connected, remote consumers known), never on a fixed sleep.
"""

from __future__ import annotations

import collections
import json

import pytest

from broker.activity import CLUSTER_FIELDS

from tests.clusterproc import (cluster_view, connect, known_bindings, receive, remote_consumers, send,
                               start_cluster, wait_known_consumers, wait_mesh, wait_remote_bindings,
                               wait_remote_consumers, wait_until)

pytestmark = pytest.mark.timeout(180)


def take(r, n: int) -> list:
    """Receive ``n`` messages on a BlockingReceiver, accepting each."""
    out = []
    for _ in range(n):
        out.append(r.receive(timeout=20).body)
        r.accept()
    return out


def stop_all(nodes) -> None:
    for n in nodes:
        if n.proc is not None and n.proc.poll() is None:
            n.kill()


@pytest.fixture
def nodes_factory(tmp_path):
    made = []

    def make(n, **kw):
        nodes = start_cluster(tmp_path, n, **kw)
        made.extend(nodes)
        return nodes
    yield make
    stop_all(made)


def test_on_demand_producer_on_a_meets_consumer_on_b(nodes_factory):
    a, b = nodes_factory(2)
    wait_mesh([a, b])
    cb = connect(b)
    r = cb.create_receiver("orders", credit=500)
    # A has no queue "orders" yet: it learns B's binding from the cluster all the same
    wait_known_consumers(a, "orders", 1)
    bodies = [f"m{i}" for i in range(200)]
    send(a, "orders", bodies)
    got = take(r, 200)
    assert got == bodies  # every message, once, in the producer's order
    cb.close()
    view = cluster_view(a)
    (bridge,) = view["bridges"]
    assert bridge["to"] == b.node_id and bridge["forwarded"] == 200
    wait_until(lambda: cluster_view(a)["bridges"][0]["acked"] == 200, 10, "all forwards acknowledged")
    assert a.queue("orders")["depth"] == 0
    # the activity log (flushed every second here): "forward" on A, "forward-in" on B, never "produce" on B
    size = len(bodies[0].encode())  # the records count encoded message bytes; compare per-message counts

    def records(node, direction):
        path = node.data_dir / "activity.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return [x for x in lines if x["direction"] == direction and x["address"] == "orders"]
    wait_until(lambda: sum(x["messages"] for x in records(a, "forward")) == 200
               and sum(x["messages"] for x in records(b, "forward-in")) == 200, 20, "forward records")
    assert all(list(x) == list(CLUSTER_FIELDS) for x in records(a, "forward") + records(b, "forward-in"))
    assert {x["peer_node_id"] for x in records(a, "forward")} == {b.node_id}
    assert {x["peer_node_id"] for x in records(b, "forward-in")} == {a.node_id}
    assert records(b, "produce") == []
    assert sum(x["messages"] for x in records(a, "produce")) == 200
    assert sum(x["bytes"] for x in records(a, "forward")) == sum(x["bytes"] for x in records(b, "forward-in")) \
        == sum(x["bytes"] for x in records(a, "produce")) > 200 * size


def _declare(name: str, routing: str = "anycast", **extra) -> dict:
    return {f"addresses.{name}": {"routing-types": [routing], **extra}}


def test_strict_alternates_exactly_consumers_or_not(nodes_factory):
    a, b = nodes_factory(2, mode="STRICT", config=_declare("orders"))
    wait_mesh([a, b])
    wait_remote_bindings(a, "orders", 1)
    send(a, "orders", [f"m{i}" for i in range(20)])
    wait_until(lambda: b.queue("orders")["depth"] == 10, 20, "10 messages on B")
    assert a.queue("orders")["depth"] == 10
    # the rotation starts with the local queue, as Artemis's does
    assert receive(a, "orders", 10) == [f"m{i}" for i in range(0, 20, 2)]
    assert receive(b, "orders", 10) == [f"m{i}" for i in range(1, 20, 2)]


def test_off_keeps_every_message_local(nodes_factory):
    a, b = nodes_factory(2, mode="OFF", config=_declare("orders"))
    wait_mesh([a, b])
    cb = connect(b)
    cb.create_receiver("orders", credit=100)
    wait_remote_consumers(a, "orders", 1)
    send(a, "orders", [f"m{i}" for i in range(30)])
    wait_until(lambda: a.queue("orders")["depth"] == 30, 20, "30 messages kept on A")
    assert cluster_view(a)["bridges"][0]["forwarded"] == 0
    assert b.queue("orders")["depth"] == 0
    cb.close()
    assert receive(a, "orders", 30) == [f"m{i}" for i in range(30)]


def test_five_node_mesh_spreads_messages_evenly_and_exactly(nodes_factory):
    nodes = nodes_factory(5, config=_declare("orders"))
    wait_mesh(nodes)
    conns, receivers = [], []
    for n in nodes:
        c = connect(n)
        conns.append(c)
        receivers.append(c.create_receiver("orders", credit=500))
    wait_remote_consumers(nodes[0], "orders", 4)
    n_msgs = 500
    send(nodes[0], "orders", [f"m{i}" for i in range(n_msgs)])
    per_node = []
    for r in receivers:
        got = take(r, n_msgs // 5)
        per_node.append(got)
    seen = collections.Counter(m for got in per_node for m in got)
    assert len(seen) == n_msgs and set(seen.values()) == {1}
    # each node's share is in the producer's order
    for got in per_node:
        assert got == sorted(got, key=lambda s: int(s[1:]))
    for c in conns:
        c.close()
    for n in nodes:
        assert n.queue("orders")["depth"] == 0


@pytest.mark.parametrize("max_hops, reaches_end", [(2, True), (1, False)])
def test_chain_honours_max_hops(nodes_factory, max_hops, reaches_end):
    # node0 -> node1 -> node2, each dialling only the next (allow-direct-connections-only)
    n0, n1, n2 = nodes_factory(3, chain=True, extra={"max-hops": max_hops}, config=_declare("orders"))
    wait_until(lambda: all(b["connected"] for b in cluster_view(n0)["bridges"]) and cluster_view(n0)["bridges"],
               20, "node0's bridge to node1")
    c2 = connect(n2)
    r2 = c2.create_receiver("orders", credit=200)
    wait_remote_consumers(n1, "orders", 1)
    if reaches_end:
        wait_until(lambda: remote_consumers(n0, "orders").get(n2.node_id) == 1, 20, "node0 learns node2's consumer")
    else:
        # node1 passes node2's binding on, but one hop is too few for node0 to keep it
        wait_until(lambda: n1.node_id in remote_consumers(n0, "orders"), 20, "node0 learns node1's queue")
        assert n2.node_id not in remote_consumers(n0, "orders")
    send(n0, "orders", [f"m{i}" for i in range(50)])
    if reaches_end:
        got = take(r2, 50)
        assert got == [f"m{i}" for i in range(50)]
        assert n0.queue("orders")["depth"] == 0
    else:
        wait_until(lambda: n0.queue("orders")["depth"] == 50, 20, "messages kept home on node0")
        assert n2.queue("orders")["depth"] == 0
        assert cluster_view(n0)["bridges"][0]["forwarded"] == 0
    c2.close()


def test_cluster_address_filter_with_exclusion(nodes_factory):
    a, b = nodes_factory(2, extra={"address": "orders,!orders.secret"},
                         config={**_declare("orders.public"), **_declare("orders.secret"), **_declare("other")})
    wait_mesh([a, b])
    cb = connect(b)
    rp = cb.create_receiver("orders.public", credit=100)
    cb.create_receiver("orders.secret", credit=100)
    cb.create_receiver("other", credit=100)
    wait_remote_consumers(a, "orders.public", 1)
    # the excluded and the unlisted addresses are not clustered: A never learns those bindings
    assert remote_consumers(a, "orders.secret") == {}
    assert remote_consumers(a, "other") == {}
    for addr in ("orders.public", "orders.secret", "other"):
        send(a, addr, [f"{addr}-{i}" for i in range(10)])
    got = take(rp, 10)
    assert got == [f"orders.public-{i}" for i in range(10)]
    wait_until(lambda: a.queue("orders.secret")["depth"] == 10 and a.queue("other")["depth"] == 10, 20,
               "excluded addresses kept on A")
    cb.close()


def test_multicast_subscriptions_on_several_nodes_each_get_every_message_once(nodes_factory):
    nodes = nodes_factory(3, config=_declare("events", "multicast"))
    wait_mesh(nodes)
    conns, subs = [], []
    for n in nodes + [nodes[2]]:  # node2 has two subscriptions
        c = connect(n)
        conns.append(c)
        subs.append(c.create_receiver("events", credit=500))
    # node0 knows the other nodes' three subscription queues (each its own binding)
    wait_until(lambda: len(known_bindings(nodes[0], "events")) == 3, 20, "node0 knows 3 remote subscriptions")
    send(nodes[0], "events", [f"e{i}" for i in range(100)])
    for r in subs:
        got = take(r, 100)
        assert got == [f"e{i}" for i in range(100)]
    # one copy per node crossed each bridge, however many subscriptions that node has
    bridges = cluster_view(nodes[0])["bridges"]
    assert sorted(b["forwarded"] for b in bridges) == [100, 100]
    for c in conns:
        c.close()


def test_a_wildcard_subscription_on_another_node_gets_exactly_the_matching_messages(nodes_factory):
    """Wildcard subscriptions on node b only (events.stock.* and events.#) and one exact
    subscription on a: a producer on a sends to five addresses; each subscription gets exactly
    the messages whose address its pattern matches (worked out by hand below), once, in order —
    as on a single node (test_broker_amqp_features) and as Artemis binds remote wildcard queues."""
    from proton import Timeout, symbol
    from proton.reactor import LinkOption

    class Topic(LinkOption):
        def apply(self, link):
            link.source.capabilities.put_object(symbol("topic"))

    a, b = nodes_factory(2)
    wait_mesh([a, b])
    cb, ca = connect(b), connect(a)
    one = cb.create_receiver("events.stock.*", options=Topic(), credit=500)
    many = cb.create_receiver("events.#", options=Topic(), credit=500)
    exact = ca.create_receiver("events.stock.ibm", options=Topic(), credit=500)
    wait_until(lambda: len(known_bindings(a, "events.stock.*")) == 1 and len(known_bindings(a, "events.#")) == 1,
               20, "a knows b's two wildcard subscriptions")
    sent = ["events.stock.ibm", "events.stock.ibm.nyse", "events.bond.x", "events.stock", "other.stock.ibm"]
    for i in range(3):
        for address in sent:
            send(a, address, [f"{address}/{i}"])
    assert take(one, 3) == [f"events.stock.ibm/{i}" for i in range(3)]
    assert take(many, 12) == [f"{x}/{i}" for i in range(3) for x in
                              ("events.stock.ibm", "events.stock.ibm.nyse", "events.bond.x", "events.stock")]
    assert take(exact, 3) == [f"events.stock.ibm/{i}" for i in range(3)]
    for r in (one, many, exact):
        with pytest.raises(Timeout):   # nothing more for anyone
            r.receive(timeout=0.5)
    # one copy per message crossed the bridge to b, however many of b's subscriptions match it
    assert [br["forwarded"] for br in cluster_view(a)["bridges"]] == [12]
    cb.close()
    ca.close()
