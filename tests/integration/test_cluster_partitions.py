"""The cluster across real network partitions (issue 10): three brokers, each in its own network
namespace with a link to each other one (tests/netns.py). A cut link drops every packet
silently: a bridge learns of it only by its idle time-out (`connection-ttl-ms`), and the
messages it had in flight are neither refused nor confirmed. Exact counts after the link heals:
every acknowledged message delivered once, in order."""

from __future__ import annotations

import threading
import time

import pytest
from proton import Message

from tests.clusterproc import cluster_view, connect, start_node, wait_known_consumers, wait_mesh, wait_until
from tests.netns import Network, available

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(available() is not None, reason=str(available()))]

FAST = {"connection-ttl-ms": 2000, "call-timeout-ms": 2000}
CONFIG = {"amqp": {"idle-timeout-s": 2.0}, "address-settings.orders": {"redistribution-delay-ms": 0}}


@pytest.fixture
def net():
    n = Network(["a", "b", "c"])
    n.started = []
    yield n
    for m in n.started:
        if m.proc is not None and m.proc.poll() is None:
            m.kill()
    n.close()


def _bridge_up(node, to_node) -> bool:
    return any(b["to"] == to_node.node_id and b["connected"] for b in cluster_view(node)["bridges"])


def test_forwarding_across_a_silently_cut_link_delivers_every_message_once(tmp_path, net):
    """A producer on a sends 1,200 durable messages; the only consumer is on b. At the 300th the
    link a–b is cut (c still sees both): a's bridge to b stalls mid-batch, notices after the
    idle time-out, and what a accepts meanwhile waits in its store-and-forward queue. The link
    heals; the bridge reconnects and resends what b never confirmed; b's duplicate-id cache
    drops what it already had. The consumer gets all 1,200, once, in order."""
    a = start_node(tmp_path, "a", extra=FAST, config=CONFIG, net=net)
    net.started.append(a)
    b = start_node(tmp_path, "b", static=[a.amqp_url], extra=FAST, config=CONFIG, net=net)
    net.started.append(b)
    c = start_node(tmp_path, "c", static=[a.amqp_url], extra=FAST, config=CONFIG, net=net)
    net.started.append(c)
    wait_mesh([a, b, c], 60)

    n = 1200
    got: list[str] = []
    consumer_done = threading.Event()

    def consume() -> None:
        conn = connect(b)
        try:
            r = conn.create_receiver("orders", credit=200)
            while len(got) < n:
                m = r.receive(timeout=120)
                got.append(m.body)
                r.accept()
        finally:
            conn.close()
            consumer_done.set()

    tc = threading.Thread(target=consume, daemon=True)
    tc.start()
    wait_known_consumers(a, "orders", 1, 60)
    cut_seen = threading.Event()
    acked: list[str] = []

    def produce() -> None:
        conn = connect(a)
        try:
            s = conn.create_sender("orders")
            for i in range(n):
                if i == 300:
                    net.cut("a", "b")
                    cut_seen.set()
                s.send(Message(body=f"m{i}", durable=True))
                acked.append(f"m{i}")
        finally:
            conn.close()

    tp = threading.Thread(target=produce, daemon=True)
    tp.start()
    tp.join(120)
    assert not tp.is_alive() and len(acked) == n      # a kept accepting: its store-and-forward queue holds them
    # a noticed the silent cut (its bridge to b is down) while c still sees both
    wait_until(lambda: not _bridge_up(a, b), 30, "a's bridge to b noticing the cut")
    assert _bridge_up(c, a) and _bridge_up(c, b)
    before_heal = len(got)
    assert before_heal < n, "everything arrived although the link was cut"
    net.heal()
    assert consumer_done.wait(120), f"received {len(got)} of {n}"
    tc.join(10)
    assert got == [f"m{i}" for i in range(n)], (len(got), len(set(got)))
    # nothing left anywhere: the store-and-forward queues are empty and no copy waits on a or c
    wait_until(lambda: all(sum(q["depth"] for q in node.management_get("/api/v1/queues")[1]
                               if q["name"] == "orders" or q["name"].startswith("$lodestone.sf.")) == 0
                           for node in (a, b, c)), 30, "every queue empty")
