"""Duplicate-id detection (``_AMQ_DUPL_ID``) in a cluster of real broker processes: the node a
producer sent to checks the id, and so does the node that stores a forwarded copy (a resend
through another node is caught where the first copy went, also after a kill -9 of that node);
messages moved by redistribution and scale-down are never dropped for an id the target already
knows, and the target remembers their ids. Unmodified python-qpid-proton clients."""

from __future__ import annotations

import pytest
from proton import Message

from tests.clusterproc import (connect, drain, receive, restart_same_port, start_cluster, start_node,
                               wait_known_consumers, wait_mesh, wait_until)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
DUP = "_AMQ_DUPL_ID"


def send_ids(node, address, ids, *, prefix="m"):
    c = connect(node)
    try:
        s = c.create_sender(address)
        for i in ids:
            s.send(Message(body=f"{prefix}-{i}", durable=True, properties={DUP: i}))
    finally:
        c.close()


def dropped(node, address) -> int:
    status, addrs = node.management_get("/api/v1/addresses")
    assert status == 200
    return next((a["duplicates_dropped"] for a in addrs if a["name"] == address), 0)


def depth(node, queue) -> int:
    q = node.queue(queue)
    return 0 if q is None else q["depth"]


@pytest.fixture
def nodes_made():
    made = []
    yield made
    for n in made:
        if n.proc is not None and n.proc.poll() is None:
            n.kill()


def test_a_resend_through_another_node_is_caught_where_the_first_copy_went(tmp_path, nodes_made):
    a, b = start_cluster(tmp_path, 2, config={"addresses.orders": {"routing-types": ["anycast"]}})
    nodes_made += [a, b]
    wait_mesh([a, b])
    cb = connect(b)
    r = cb.create_receiver("orders", credit=0)          # a consumer on B only: ON_DEMAND forwards there
    wait_known_consumers(a, "orders", 1)
    ids = [f"k{i}" for i in range(10)]
    send_ids(a, "orders", ids)                           # stored on B, remembered by A and by B
    wait_until(lambda: depth(b, "orders") == 10, 20, "10 forwarded to B")
    send_ids(a, "orders", ids, prefix="again-a")         # A's cache
    send_ids(b, "orders", ids, prefix="again-b")         # B's cache, learned from the forwards
    assert depth(a, "orders") == 0 and depth(b, "orders") == 10
    assert dropped(a, "orders") == 10 and dropped(b, "orders") == 10
    r.flow(20)
    got = []
    for _ in range(10):
        got.append(r.receive(timeout=20).body)
        r.accept()
    cb.close()
    assert got == [f"m-k{i}" for i in range(10)]
    # B's ids were journaled with the forwarded messages: a kill -9 keeps them
    b.kill()
    b = restart_same_port(b)
    nodes_made.append(b)
    wait_mesh([a, b])
    before = depth(b, "orders")      # (acknowledgements not yet synced may bring some back)
    send_ids(b, "orders", ids, prefix="after-kill")
    assert depth(b, "orders") == before and dropped(b, "orders") == 10
    assert not any(body.startswith("after-kill") for body in drain(b, "orders"))


def test_redistribution_back_and_forth_moves_messages_whose_ids_both_nodes_know(tmp_path, nodes_made):
    """A message sent to A is stored on B (both remember its id); it moves B → A and back A → B
    with its consumer, and arrives once — a moved message is not checked again."""
    a, b = start_cluster(tmp_path, 2, config={"addresses.orders": {"routing-types": ["anycast"]},
                                              "address-settings.orders": {"redistribution-delay-ms": 0}})
    nodes_made += [a, b]
    wait_mesh([a, b])
    n = 50
    ids = [f"r{i}" for i in range(n)]
    cb = connect(b)
    cb.create_receiver("orders", credit=0)
    wait_known_consumers(a, "orders", 1)
    send_ids(a, "orders", ids)
    wait_until(lambda: depth(b, "orders") == n, 20, "stored on B")
    cb.close()                                            # nobody on B now
    ca = connect(a)
    ca.create_receiver("orders", credit=0)                # a consumer on A: B's messages move to A
    wait_until(lambda: depth(a, "orders") == n and depth(b, "orders") == 0, 30, "moved to A")
    ca.close()
    assert receive(b, "orders", n) == [f"m-r{i}" for i in range(n)]    # moved back to B, each once
    assert drain(a, "orders") == [] and drain(b, "orders") == []
    assert dropped(a, "orders") == 0 and dropped(b, "orders") == 0
    send_ids(a, "orders", ids, prefix="x")               # still remembered on both
    send_ids(b, "orders", ids, prefix="x")
    assert depth(a, "orders") == 0 and depth(b, "orders") == 0


def test_scale_down_moves_messages_whose_ids_the_target_knows_and_the_target_remembers_them(tmp_path, nodes_made):
    cfg = {"addresses.orders": {"routing-types": ["anycast"]}}
    b = start_node(tmp_path, "b", config=cfg, mode="OFF")
    a = start_node(tmp_path, "a", static=[b.amqp_url], mode="OFF", config={**cfg, "ha": {"scale-down": True}})
    nodes_made += [a, b]
    wait_mesh([a, b])
    known = [f"s{i}" for i in range(10)]
    only_a = [f"t{i}" for i in range(10)]
    send_ids(b, "orders", known, prefix="on-b")          # B remembers these
    send_ids(a, "orders", known + only_a, prefix="on-a")  # mode OFF: A stores its own copies
    assert depth(a, "orders") == 20 and depth(b, "orders") == 10
    assert a.terminate() == 0                            # SIGTERM: scale down to B, then exit
    assert "scale-down: done" in a.stderr_text()
    assert depth(b, "orders") == 30                      # nothing dropped for an id B knew
    assert dropped(b, "orders") == 0
    send_ids(b, "orders", only_a, prefix="resend")       # B learned the moved messages' ids
    assert depth(b, "orders") == 30 and dropped(b, "orders") == 10
    got = drain(b, "orders")
    assert sorted(got) == sorted([f"on-b-{i}" for i in known] + [f"on-a-{i}" for i in known + only_a])
