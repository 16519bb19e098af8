"""Dual and ring mirrors (docs/broker-connections.md "Dual and ring mirrors") between real broker
processes: each site mirrors to the next, clients on every site. The oracle is what unmodified
python-qpid-proton consumers get and what each broker's queues hold (browsed), checked against
what was sent; the event counts on every target show that nothing travels back to where it came
from and nothing goes round a ring twice."""

from __future__ import annotations

import pytest

from tests.haproc import send
from tests.integration.test_broker_connections import depth, view as source_view
from tests.integration.test_mirror import browse, consume, mirror, start, target_events
from tests.brokerproc import ADMIN
from tests.serverproc import free_ports, http_json, metric_by_label
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def ring(tmp_path, procs, n: int) -> list:
    """``n`` brokers, each mirroring to the next (two: a dual mirror), once every link is up."""
    ports = free_ports(n)
    nodes = []
    for i, name in enumerate("abcdefgh"[:n]):
        nodes.append(start(tmp_path, name, port=ports[i], extra=mirror(f"amqp://127.0.0.1:{ports[(i + 1) % n]}")))
        procs.append(nodes[-1])
    for node in nodes:
        wait_for(lambda: source_view(node)["mirror"]["attached"], 30, what=f"{node} mirror attached")
    return nodes


def settled(*nodes) -> None:
    wait_for(lambda: all(source_view(x)["mirror"]["pending"] == 0 for x in nodes), 60,
             what="every mirror's events accepted")


def test_a_dual_mirror_takes_each_message_once_wherever_it_is_consumed(tmp_path, procs):
    a, b = ring(tmp_path, procs, 2)
    got_on_b, got_on_a = [], []
    for k in range(4):            # produce on A, consume on B; produce on B, consume on A; interleaved
        send(a, "orders", [f"a-{k}-{i}" for i in range(50)])
        send(b, "audit", [f"b-{k}-{i}" for i in range(50)])
        got_on_b += consume(b, "orders", 50)
        got_on_a += consume(a, "audit", 50)
    assert got_on_b == [f"a-{k}-{i}" for k in range(4) for i in range(50)]
    assert got_on_a == [f"b-{k}-{i}" for k in range(4) for i in range(50)]
    settled(a, b)
    wait_for(lambda: [depth(x, q) for x in (a, b) for q in ("orders", "audit")] == [0, 0, 0, 0], 30,
             what="both sides empty")
    for x in (a, b):
        m = source_view(x)["mirror"]
        assert (m["sends"], m["acks"], m["pending"]) == (200, 200, 0), m    # its own sends and consumes only
        ev = target_events(x)
        assert (ev["sends"], ev["acks"], ev["acks_not_found"], ev["duplicates"], ev["echoes"]) == (200, 200, 0, 0, 0)


def test_a_ring_of_three_carries_each_message_once_round_and_no_further(tmp_path, procs):
    a, b, c = ring(tmp_path, procs, 3)
    bodies = [f"r-{i}" for i in range(40)]
    send(a, "orders", bodies)
    settled(a, b, c)
    wait_for(lambda: [depth(x, "orders") for x in (a, b, c)] == [40, 40, 40], 30, what="40 on each")
    assert browse(a, "orders") == browse(b, "orders") == browse(c, "orders") == bodies
    assert [target_events(x)["sends"] for x in (a, b, c)] == [0, 40, 40]    # C does not send A's back to A
    assert consume(c, "orders", 40) == bodies                               # taken at the far end
    settled(a, b, c)
    wait_for(lambda: [depth(x, "orders") for x in (a, b, c)] == [0, 0, 0], 30, what="gone from all three")
    evs = [target_events(x) for x in (a, b, c)]
    # C's acknowledgements go to A (the origin, its own messages), A's on to B, B's on to C,
    # where they find nothing and stop: once round, no further
    assert [(e["acks"], e["acks_not_found"]) for e in evs] == [(40, 0), (40, 0), (40, 40)]
    assert [(e["duplicates"], e["echoes"]) for e in evs] == [(0, 0)] * 3
    assert [source_view(x)["mirror"]["acks"] for x in (a, b, c)] == [40, 40, 40]


def test_an_ack_for_a_message_a_target_transaction_holds_is_applied_at_its_rollback(tmp_path, procs):
    """A consumer on B accepts m0 inside a transaction it has not discharged when A's consumer
    takes m0: the acknowledgement waits for the transaction; the rollback would bring m0 back,
    so the acknowledgement takes it instead and m0 is not delivered again on B. (The same
    consumer's prefetched m1 is held the plain way.)"""
    from tests.txnclient import TxClient

    b = start(tmp_path, "b")
    procs.append(b)
    a = start(tmp_path, "a", extra=mirror(b.amqp_url))
    procs.append(a)
    wait_for(lambda: source_view(a)["mirror"]["attached"], 20, what="the mirror attached")
    send(a, "orders", ["m0", "m1"])
    wait_for(lambda: depth(b, "orders") == 2, 30, what="2 mirrored to B")
    c = TxClient(b.amqp_url.replace("amqp://", "amqp://app:app@"), timeout_s=20)
    try:
        r = c.bc.create_receiver("orders", credit=1)
        t = c.declare()
        m, d = c.receive(r, timeout_s=20)
        assert m.body == "m0"
        t.handle.accept(d)                                            # settled in the transaction only
        c.bc.create_sender("audit")    # a round trip: the accept is on the wire before A consumes
        assert consume(a, "orders", 2) == ["m0", "m1"]
        # the receiver keeps one message of credit: m1 waits with it, unsettled
        wait_for(lambda: _target_view(b)["pending_acks"] == 2, 30,
                 what="both acks held on B: m0's for the transaction, m1's for the consumer")
        r.close()                      # the consumer gives m1 back: its ack takes it; m0 stays with the transaction
        wait_for(lambda: _target_view(b)["pending_acks"] == 1, 30, what="m1's held ack applied")
        assert depth(b, "orders") == 1
        c.abort(t)
        assert t.aborted
        wait_for(lambda: _target_view(b)["pending_acks"] == 0, 30, what="m0's held ack applied at the rollback")
    finally:
        c.close()
    ev = _target_view(b)
    assert (ev["acks"], ev["acks_held"], ev["held_acks_applied"], ev["acks_not_found"]) == (2, 2, 2, 0)
    assert depth(b, "orders") == 0 and browse(b, "orders") == []


def _target_view(node) -> dict:
    """The target's event counters and its held acknowledgements (``pending_acks``), from /metrics."""
    status, text = http_json(node.management_url + "/metrics", auth=ADMIN)
    assert status == 200
    view = dict(metric_by_label(text, "lodestone_broker_mirror_target_events_total"))
    (line,) = [x for x in text.splitlines() if x.startswith("lodestone_broker_mirror_target_pending_acks ")]
    view["pending_acks"] = float(line.split()[-1])
    return view


def test_an_ack_for_a_message_a_target_consumer_holds_waits_and_is_applied_when_it_comes_back(tmp_path, procs):
    from proton.utils import BlockingConnection

    (port,) = free_ports(1)
    b = start(tmp_path, "b", port=port)     # a fixed port: it is restarted below
    procs.append(b)
    a = start(tmp_path, "a", extra=mirror(f"amqp://127.0.0.1:{port}"))
    procs.append(a)
    wait_for(lambda: source_view(a)["mirror"]["attached"], 20, what="the mirror attached")
    send(a, "orders", ["m0", "m1", "m2", "m3"])
    wait_for(lambda: depth(b, "orders") == 4, 30, what="4 mirrored to B")
    conn = BlockingConnection(b.amqp_url, user="app", password="app", allowed_mechs="PLAIN", timeout=20)
    try:
        r = conn.create_receiver("orders", credit=1)
        assert r.receive(timeout=20).body == "m0"                     # B's consumer holds m0, unsettled
        assert consume(a, "orders", 4) == ["m0", "m1", "m2", "m3"]     # A's consumer takes all four
        wait_for(lambda: _target_view(b)["pending_acks"] == 1 and depth(b, "orders") == 1, 30,
                 what="m1-m3 removed on B (m0 with its consumer), the ack of m0 held")
        r.release()                                                     # B's consumer gives m0 back
        conn.create_sender("audit")    # a round trip: the release is on the wire before the attach
        wait_for(lambda: _target_view(b)["pending_acks"] == 0, 30, what="the held ack applied")
    finally:
        conn.close()
    ev = _target_view(b)
    assert (ev["acks"], ev["acks_held"], ev["held_acks_applied"], ev["acks_not_found"]) == (4, 1, 1, 0)
    assert depth(b, "orders") == 0 and browse(b, "orders") == []      # m0 is not delivered again on B

    # a consumer that accepts the message it holds makes the held ack moot
    send(a, "orders", ["n0"])
    wait_for(lambda: depth(b, "orders") == 1, 30, what="n0 mirrored")
    conn = BlockingConnection(b.amqp_url, user="app", password="app", allowed_mechs="PLAIN", timeout=20)
    try:
        r = conn.create_receiver("orders", credit=1)
        assert r.receive(timeout=20).body == "n0"
        assert consume(a, "orders", 1) == ["n0"]
        wait_for(lambda: _target_view(b)["pending_acks"] == 1, 30, what="the ack of n0 held")
        r.accept()
        conn.create_sender("audit")
        wait_for(lambda: _target_view(b)["pending_acks"] == 0, 30, what="the held ack moot")
    finally:
        conn.close()
    assert _target_view(b)["held_acks_moot"] == 1

    # the target killed while it holds an ack: at the restart the message is not delivered again
    send(a, "orders", ["k0", "k1"])
    wait_for(lambda: depth(b, "orders") == 2, 30, what="k0, k1 mirrored")
    conn = BlockingConnection(b.amqp_url, user="app", password="app", allowed_mechs="PLAIN", timeout=20)
    r = conn.create_receiver("orders", credit=1)
    assert r.receive(timeout=20).body == "k0"
    assert consume(a, "orders", 2) == ["k0", "k1"]
    wait_for(lambda: _target_view(b)["pending_acks"] == 1 and source_view(a)["mirror"]["pending"] == 0, 30,
             what="the ack of k0 held, journaled and accepted")
    b.kill()                                                            # SIGKILL: k0 comes back at the restart
    b.restart()
    wait_for(lambda: source_view(a)["mirror"]["attached"], 30, what="the mirror attached again")
    assert depth(b, "orders") == 0 and browse(b, "orders") == []
    assert _target_view(b)["held_acks_applied"] == 1 and _target_view(b)["pending_acks"] == 0
