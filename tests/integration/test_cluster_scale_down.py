"""Scale-down on graceful stop (issue 10; Artemis ``live-only`` + ``scale-down``): every message
of the stopping node, durable or not, moves to another node before the process exits; a queue
missing there is created with the same routing type; message properties are kept; the count on
the target is exact. Real broker processes, unmodified python-qpid-proton clients.
"""

from __future__ import annotations

import pytest
from proton import Message
from proton.reactor import Container, DurableSubscription
from proton.utils import BlockingConnection

from tests.clusterproc import cluster_view, connect, start_node, wait_mesh, wait_until

pytestmark = pytest.mark.timeout(180)



def _sub(node, container_id: str):
    ct = Container()
    ct.container_id = container_id
    c = BlockingConnection(node.amqp_url, timeout=20, user="app", password="app", allowed_mechs="PLAIN", container=ct)
    return c, c.create_receiver("events", name="s1", credit=500, options=DurableSubscription())


def test_scale_down_moves_every_message_exactly(tmp_path, procs):
    cfg = {"addresses.events": {"routing-types": ["multicast"]}}
    b = start_node(tmp_path, "b", config=cfg, mode="OFF")
    a = start_node(tmp_path, "a", static=[b.amqp_url], mode="OFF",
                   config={**cfg, "ha": {"scale-down": True}})
    procs += [a, b]
    wait_mesh([a, b])
    # on A: a durable subscription B does not have, and an anycast queue with both kinds of message
    c, _r = _sub(a, "app-7")
    c.close()  # detached: the subscription stays, with no consumer
    conn = connect(a)
    s = conn.create_sender("orders")
    for i in range(600):
        s.send(Message(body=f"d{i}", durable=True, properties={"i": i, "kind": "durable"}))
    for i in range(200):
        s.send(Message(body=f"n{i}", durable=False, properties={"i": i, "kind": "plain"}))
    e = conn.create_sender("events")
    for i in range(150):
        e.send(Message(body=f"e{i}", durable=True, properties={"i": i}))
    conn.close()
    assert a.queue("orders")["depth"] == 800 and a.queue("app-7.s1")["depth"] == 150
    assert b.queue("orders") is None and b.queue("app-7.s1") is None

    assert a.terminate() == 0  # SIGTERM: scale down, then exit
    assert "scale-down: done" in a.stderr_text()

    q = b.queue("orders")
    assert q is not None and q["routing_type"] == "anycast" and q["depth"] == 800
    sub = b.queue("app-7.s1")
    assert sub is not None and sub["routing_type"] == "multicast" and sub["depth"] == 150
    rc = connect(b)
    r = rc.create_receiver("orders", credit=800)
    got = []
    for _ in range(800):
        m = r.receive(timeout=20)
        got.append((m.body, dict(m.properties), m.durable))
        r.accept()
    rc.close()
    assert got[:600] == [(f"d{i}", {"i": i, "kind": "durable"}, True) for i in range(600)]
    assert got[600:] == [(f"n{i}", {"i": i, "kind": "plain"}, False) for i in range(200)]
    c, r = _sub(b, "app-7")
    events = []
    for _ in range(150):
        events.append(r.receive(timeout=20).body)
        r.accept()
    c.close()
    assert events == [f"e{i}" for i in range(150)]
    # and the durable ones survive a restart of B: they were journaled there before A let go
    assert cluster_view(b)["counters"].get("scale_down_queues_created", 0) == 2


def test_scale_down_goes_to_the_named_connector_first(tmp_path, procs):
    b = start_node(tmp_path, "b", mode="OFF")
    c = start_node(tmp_path, "c", static=[b.amqp_url], mode="OFF")
    a = start_node(tmp_path, "a", static=[b.amqp_url], mode="OFF",
                   config={"ha": {"scale-down": True, "scale-down-connectors": [c.amqp_url]}})
    procs += [a, b, c]
    wait_mesh([a, b, c])
    conn = connect(a)
    s = conn.create_sender("orders")
    for i in range(100):
        s.send(Message(body=f"m{i}", durable=True))
    conn.close()
    assert a.terminate() == 0
    wait_until(lambda: (c.queue("orders") or {}).get("depth") == 100, 10, "100 on C")
    assert b.queue("orders") is None or b.queue("orders")["depth"] == 0
