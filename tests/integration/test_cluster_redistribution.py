"""Redistribution across real broker processes (issue 10): messages left on a node whose last
consumer went move, in order and exactly once, to a node whose queue has a consumer — at once
(delay 0), after the delay, never when the consumer comes back within it — and
OFF_WITH_REDISTRIBUTION balances nothing at send time but redistributes.
"""

from __future__ import annotations

import time

import pytest

from tests.clusterproc import (cluster_view, connect, receive, send, start_cluster, wait_known_consumers, wait_mesh,
                               wait_until)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def pair(tmp_path, request):
    made = []

    def make(delay_ms: int, mode: str = "ON_DEMAND"):
        nodes = start_cluster(tmp_path, 2, mode=mode, config={
            "addresses.orders": {"routing-types": ["anycast"]},
            "address-settings.orders": {"redistribution-delay-ms": delay_ms}})
        made.extend(nodes)
        wait_mesh(nodes)
        return nodes
    yield make
    for n in made:
        if n.proc is not None and n.proc.poll() is None:
            n.kill()


def _leave_messages_on(a, n: int) -> None:
    """A consumer on A attaches and leaves; ``n`` messages then wait on A (no consumer anywhere)."""
    c = connect(a)
    c.create_receiver("orders", credit=0)
    c.close()
    send(a, "orders", [f"m{i}" for i in range(n)])
    assert a.queue("orders")["depth"] == n


def test_redistribution_at_once_when_a_consumer_appears_elsewhere(pair):
    a, b = pair(0)
    _leave_messages_on(a, 200)
    cb = connect(b)
    r = cb.create_receiver("orders", credit=500)
    got = []
    for _ in range(200):
        got.append(r.receive(timeout=20).body)
        r.accept()
    assert got == [f"m{i}" for i in range(200)]  # in order, each once
    assert a.queue("orders")["depth"] == 0
    assert cluster_view(a)["redistributed"] == 200
    cb.close()
    assert b.queue("orders")["depth"] == 0


def test_redistribution_after_the_consumer_moves(pair):
    """The consumer moves from A to B: what it left on A follows it to B."""
    a, b = pair(0)
    ca = connect(a)
    ra = ca.create_receiver("orders", credit=5)
    send(a, "orders", [f"m{i}" for i in range(100)])
    first = []
    for _ in range(5):
        first.append(ra.receive(timeout=20).body)
        ra.accept()
    ca.close()  # its unsettled credit returns; 95 wait on A
    wait_until(lambda: a.queue("orders")["depth"] == 95, 10, "95 left on A")
    rest = receive(b, "orders", 95)
    assert first + rest == [f"m{i}" for i in range(100)]


def test_delayed_redistribution_waits_for_the_delay(pair):
    """Consumers on A (no credit) and B share 40 messages (ON_DEMAND alternates); A's consumer
    leaves: its 20 move to B only once the 1.5 s delay has passed."""
    a, b = pair(1500)
    ca = connect(a)
    ca.create_receiver("orders", credit=0)
    cb = connect(b)
    r = cb.create_receiver("orders", credit=500)
    wait_known_consumers(a, "orders", 1)
    send(a, "orders", [f"m{i}" for i in range(40)])
    assert a.queue("orders")["depth"] == 20
    got = []
    for _ in range(20):
        got.append(r.receive(timeout=20).body)
        r.accept()
    assert got == [f"m{i}" for i in range(1, 40, 2)]
    left_at = time.monotonic()
    ca.close()
    moved = []
    for _ in range(20):
        moved.append(r.receive(timeout=20).body)
        r.accept()
        if len(moved) == 1:
            first_moved_after = time.monotonic() - left_at
    assert moved == [f"m{i}" for i in range(0, 40, 2)]
    assert first_moved_after >= 1.4, first_moved_after
    assert cluster_view(a)["redistributed"] == 20
    cb.close()


def test_a_consumer_back_within_the_delay_cancels_redistribution(pair):
    a, b = pair(1000)
    ca = connect(a)
    ca.create_receiver("orders", credit=0)
    send(a, "orders", [f"m{i}" for i in range(50)])  # nobody else consumes: all stay on A
    cb = connect(b)
    rb = cb.create_receiver("orders", credit=500)
    wait_known_consumers(a, "orders", 1)
    ca.close()
    ca = connect(a)  # back within the delay, still without credit: the messages wait on A
    ra = ca.create_receiver("orders", credit=0)
    # the thing under test: for twice the delay (a move would have happened by now) nothing moves
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert cluster_view(a)["redistributed"] == 0
        assert a.queue("orders")["depth"] == 50
        time.sleep(0.1)
    ra.flow(50)
    got = []
    for _ in range(50):
        got.append(ra.receive(timeout=20).body)
        ra.accept()
    assert got == [f"m{i}" for i in range(50)]
    assert b.queue("orders")["depth"] == 0
    ca.close()
    cb.close()


def test_off_with_redistribution_keeps_messages_local_then_moves_them(pair):
    a, b = pair(0, mode="OFF_WITH_REDISTRIBUTION")
    cb = connect(b)
    r = cb.create_receiver("orders", credit=500)
    wait_known_consumers(a, "orders", 1)
    ca = connect(a)
    ca.create_receiver("orders", credit=0)
    send(a, "orders", [f"m{i}" for i in range(60)])
    assert a.queue("orders")["depth"] == 60  # nothing balanced at send time
    assert cluster_view(a)["bridges"][0]["forwarded"] == 0
    ca.close()  # A's last consumer leaves: delay 0, B has a consumer
    got = []
    for _ in range(60):
        got.append(r.receive(timeout=20).body)
        r.accept()
    assert got == [f"m{i}" for i in range(60)]
    assert cluster_view(a)["redistributed"] == 60
    cb.close()
