"""Duplicate-id detection (``_AMQ_DUPL_ID``) in a cluster of real broker processes: the node a
producer sent to checks the id, and so does the node that stores a forwarded copy (a resend
through another node is caught where the first copy went, also after a kill -9 of that node);
a message moved by redistribution or scale-down is dropped only where its queue already holds a
copy of the same id (the producer's resend, stored on another node first — also after a kill -9
of the target), never for an id the target only passed on, and the target remembers its id.
Unmodified python-qpid-proton clients."""

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


def test_scale_down_drops_only_the_copies_the_target_holds_and_the_target_remembers_the_rest(tmp_path, nodes_made):
    """Mode OFF: each node stores what is sent to it. B holds its own copy of the ``known`` ids
    (the producer's resends, sent to B); A holds ``known`` and ``only_a``. A scales down to B:
    A's copies of ``known`` are second copies of messages B's queue holds (dropped, counted);
    ``only_a`` arrives, and B remembers those ids."""
    cfg = {"addresses.orders": {"routing-types": ["anycast"]}}
    b = start_node(tmp_path, "b", config=cfg, mode="OFF")
    a = start_node(tmp_path, "a", static=[b.amqp_url], mode="OFF", config={**cfg, "ha": {"scale-down": True}})
    nodes_made += [a, b]
    wait_mesh([a, b])
    known = [f"s{i}" for i in range(10)]
    only_a = [f"t{i}" for i in range(10)]
    send_ids(b, "orders", known, prefix="on-b")          # B holds these
    send_ids(a, "orders", known + only_a, prefix="on-a")  # mode OFF: A stores its own copies
    assert depth(a, "orders") == 20 and depth(b, "orders") == 10
    assert a.terminate() == 0                            # SIGTERM: scale down to B, then exit
    assert "scale-down: done" in a.stderr_text()
    assert depth(b, "orders") == 20                      # the 10 second copies were dropped
    assert dropped(b, "orders") == 10
    send_ids(b, "orders", only_a, prefix="resend")       # B learned the moved messages' ids
    assert depth(b, "orders") == 20 and dropped(b, "orders") == 20
    got = drain(b, "orders")
    assert sorted(got) == sorted([f"on-b-{i}" for i in known] + [f"on-a-{i}" for i in only_a])


def _first_on_one_resend_on_other(tmp_path, nodes_made, first, resend, n):
    """Each of ``n`` ids sent to ``first`` (stored there: no consumer anywhere), then resent to
    ``resend`` (which has not seen them: stored there too) — a producer whose accepts were lost
    with its connection, resending through another node."""
    ids = [f"d{i}" for i in range(n)]
    send_ids(first, "orders", ids, prefix="first")
    send_ids(resend, "orders", ids, prefix="resend")
    assert depth(first, "orders") == n and depth(resend, "orders") == n
    return ids


def test_a_copy_moved_to_the_node_holding_its_resend_is_dropped_there(tmp_path, nodes_made):
    """The first send stored on B, the resend on A; a consumer comes to A, so B's copies move to A
    (redistribution): A's queue holds the resend of each, so each moved copy is dropped — the
    consumer gets every message once."""
    a, b = start_cluster(tmp_path, 2, config={"addresses.orders": {"routing-types": ["anycast"]},
                                              "address-settings.orders": {"redistribution-delay-ms": 0}})
    nodes_made += [a, b]
    wait_mesh([a, b])
    n = 20
    ids = _first_on_one_resend_on_other(tmp_path, nodes_made, b, a, n)
    ca = connect(a)
    ca.create_receiver("orders", credit=0)               # B's copies now move to A
    wait_until(lambda: depth(b, "orders") == 0 and dropped(a, "orders") == n, 30, "B's copies moved and dropped")
    ca.close()
    assert depth(a, "orders") == n
    assert receive(a, "orders", n) == [f"resend-d{i}" for i in range(n)]
    assert drain(a, "orders") == [] and drain(b, "orders") == []
    send_ids(b, "orders", ids, prefix="x")               # both still remember them
    send_ids(a, "orders", ids, prefix="x")
    assert depth(a, "orders") == 0 and depth(b, "orders") == 0


def test_after_a_kill_the_recovered_copies_still_drop_their_moved_duplicates(tmp_path, nodes_made):
    """As above with the roles turned and B killed -9 and restarted in between: which of B's
    queues hold which id is rebuilt from its journal, so A's resends moving to B are dropped."""
    a, b = start_cluster(tmp_path, 2, config={"addresses.orders": {"routing-types": ["anycast"]},
                                              "address-settings.orders": {"redistribution-delay-ms": 0}})
    nodes_made += [a, b]
    wait_mesh([a, b])
    n = 20
    _first_on_one_resend_on_other(tmp_path, nodes_made, b, a, n)
    b.kill()
    b = restart_same_port(b)
    nodes_made.append(b)
    wait_mesh([a, b])
    assert depth(b, "orders") == n
    cb = connect(b)
    cb.create_receiver("orders", credit=0)               # A's copies now move to B
    wait_until(lambda: depth(a, "orders") == 0 and dropped(b, "orders") == n, 30, "A's copies moved and dropped")
    cb.close()
    assert receive(b, "orders", n) == [f"first-d{i}" for i in range(n)]
    assert drain(a, "orders") == [] and drain(b, "orders") == []
