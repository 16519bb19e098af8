"""Long names and selectors cross the cluster (issue 10).

A binding notification the receiving node refuses cuts the cluster link off, and the sender's
snapshot repeats it after every reconnect: one client that attaches with a long selector, or to
a long address, would partition the cluster for as long as its consumer or queue lives. So
whatever a node accepts from clients must be accepted in a notification by the other nodes: a
selector up to the selector limit, an address and queue name up to the journal's.
"""

from __future__ import annotations

import pytest
from proton import Message
from proton.reactor import Selector

from tests.clusterproc import cluster_view, connect, start_node, wait_known_consumers, wait_mesh

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]



def _receive(r, n: int) -> list:
    got = []
    for _ in range(n):
        got.append(r.receive(timeout=20).body)
        r.accept()
    return got


@pytest.mark.parametrize("what", ["selector", "address"])
def test_a_consumer_with_a_long_name_on_one_node_is_served_from_the_other(tmp_path, procs, what):
    a = start_node(tmp_path, "a", config={"addresses.orders": {"routing-types": ["anycast"]}})
    procs.append(a)
    b = start_node(tmp_path, "b", static=[a.amqp_url], config={"addresses.orders": {"routing-types": ["anycast"]}})
    procs.append(b)
    wait_mesh([a, b])
    colour = "r" * 20_000
    address = "orders" if what == "selector" else "long-" + "x" * 1500
    cb = connect(b)
    try:
        if what == "selector":
            r = cb.create_receiver(address, credit=100, options=Selector(f"colour = '{colour}'"))
        else:
            r = cb.create_receiver(address, credit=100)
        wait_known_consumers(a, address, 1)
        c = connect(a)
        s = c.create_sender(address)
        for i in range(10):
            s.send(Message(body=f"m{i}", durable=True, properties={"colour": colour}))
        c.close()
        assert _receive(r, 10) == [f"m{i}" for i in range(10)]
    finally:
        cb.close()
    assert cluster_view(a)["counters"].get("bad_notifications", 0) == 0
    assert "bad notification" not in a.stderr_text()
    assert all(x["connected"] for x in cluster_view(a)["bridges"])
