"""A mirrored cluster (docs/broker-connections.md "Mirrored clusters"): A1+A2 form a cluster with
redistribution, A1 mirrors to B1 and A2 to B2 (a second cluster). Consumers alternate between A1
and A2, so messages move between them; the moves are mirrored as what they are — an
acknowledgement on the node a message left, a send on the node it reached — and the B side never
holds a message twice. Real processes, unmodified python-qpid-proton clients."""

from __future__ import annotations

import pytest

from tests.clusterproc import receive, send, start_node, wait_mesh
from tests.integration.test_broker_connections import depth, view as source_view
from tests.integration.test_mirror import browse
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ORDERS = {"addresses.orders": {"routing-types": ["anycast"]},
          "address-settings.orders": {"redistribution-delay-ms": 0}}


def test_a_mirrored_cluster_with_redistribution_holds_each_message_once_on_each_side(tmp_path, procs):
    b1 = start_node(tmp_path, "b1", config=ORDERS)
    procs.append(b1)
    b2 = start_node(tmp_path, "b2", static=[b1.amqp_url], config=ORDERS)
    procs.append(b2)
    a1 = start_node(tmp_path, "a1", config={**ORDERS, **_mirror_tables(b1)})
    procs.append(a1)
    a2 = start_node(tmp_path, "a2", static=[a1.amqp_url], config={**ORDERS, **_mirror_tables(b2)})
    procs.append(a2)
    wait_mesh([a1, a2])
    wait_mesh([b1, b2])
    for a in (a1, a2):
        wait_for(lambda: source_view(a)["mirror"]["attached"], 30, what=f"{a} mirror attached")
    sent = [f"m{i}" for i in range(100)]
    send(a1, "orders", sent)
    got = []
    for k in range(10):                                   # 10 at a time, A1, A2, A1, ...: they move
        got += receive(a1 if k % 2 == 0 else a2, "orders", 10)

        def settled():
            if any(source_view(a)["mirror"]["pending"] for a in (a1, a2)):
                return False
            on_a = sorted(browse(a1, "orders") + browse(a2, "orders"))
            on_b = sorted(browse(b1, "orders") + browse(b2, "orders"))
            return on_a == on_b and on_a == sorted(set(sent) - set(got))

        wait_for(settled, 60, what=f"after {len(got)} consumed: the B side holds what the A side holds, once")
    assert sorted(got) == sorted(sent) and len(set(got)) == 100     # each delivered once
    assert [depth(x, "orders") for x in (a1, a2, b1, b2)] == [0, 0, 0, 0]


def _mirror_tables(b) -> dict:
    return {"broker-connections.dr": {"uri": b.amqp_url, "user": "admin", "password": "admin",
                                      "retry-interval-ms": 200},
            "broker-connections.dr.mirror": {"queue-removal": True}}

