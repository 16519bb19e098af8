"""Pure tests of the broker's message core: addresses, queues, dispatch, settlement, dead-letters."""

from __future__ import annotations

import pytest

from broker.amqp.message import message_header
from broker.core.addresses import (
    ANYCAST,
    MULTICAST,
    AddressNotFound,
    AddressSettings,
    Broker,
    SettingsResolver,
    match_address,
)
from broker.core.deliveries import Outcome
from broker.core.queues import Subscription


class ListStore:
    """Records what the core asks the store to do."""

    def __init__(self):
        self.ops = []
        self.live = {}

    def add(self, queue, msg):
        self.ops.append(("add", queue, msg.mid))
        self.live[(queue, msg.mid)] = msg.body

    def remove(self, queue, msg):
        self.ops.append(("remove", queue, msg.mid))
        del self.live[(queue, msg.mid)]

    def delivery_count_changed(self, queue, msg):
        assert (queue, msg.mid) in self.live
        self.ops.append(("count", queue, msg.mid, msg.delivery_count))

    def queue_created(self, d):
        self.ops.append(("queue", d["name"]))

    def queue_deleted(self, name):
        self.ops.append(("unqueue", name))


class Sink:
    def __init__(self, credit=0, auto_ack=False):
        self.got = []
        self.sub = Subscription(self.deliver, auto_ack=auto_ack)
        self.sub.credit = credit

    def deliver(self, sub, msg):
        self.got.append(msg)

    @property
    def bodies(self):
        return [m.body for m in self.got]


def make(store=None, **settings):
    return Broker(SettingsResolver(AddressSettings(**settings)), store or ListStore())


@pytest.mark.parametrize("pattern,address,expected", [
    ("#", "a", True), ("#", "a.b.c", True), ("a.#", "a", True), ("a.#", "a.b.c", True),
    ("a.#", "ab", False), ("a.*", "a.b", True), ("a.*", "a.b.c", False), ("a.*", "a", False),
    ("*.b", "a.b", True), ("a.#.c", "a.c", True), ("a.#.c", "a.x.y.c", True), ("a.#.c", "a.x.y", False),
    ("orders", "orders", True), ("orders", "orders.eu", False), ("#.eu", "orders.eu", True),
])
def test_match_address(pattern, address, expected):
    assert match_address(pattern, address) is expected


def test_settings_most_specific_wins():
    r = SettingsResolver(AddressSettings(), (
        ("#", AddressSettings(max_delivery_count=1)),
        ("events.#", AddressSettings(default_routing_type=MULTICAST)),
        ("events.eu", AddressSettings(max_delivery_count=7)),
    ))
    assert r.for_address("x").max_delivery_count == 1
    assert r.for_address("events.us").default_routing_type == MULTICAST
    assert r.for_address("events.eu").max_delivery_count == 7


def test_anycast_competing_consumers_round_robin():
    b = make()
    b.resolve("q", None, may_create=True)
    q = b.anycast_queue("q")
    s1, s2 = Sink(credit=10), Sink(credit=10)
    q.add_subscription(s1.sub)
    q.add_subscription(s2.sub)
    for i in range(6):
        b.publish("q", b"m%d" % i, durable=False)
    assert s1.bodies == [b"m0", b"m2", b"m4"]
    assert s2.bodies == [b"m1", b"m3", b"m5"]
    assert q.depth == 6  # all delivered, none settled yet


def test_credit_limits_dispatch_and_flow_resumes():
    b = make()
    b.resolve("q", ANYCAST, may_create=True)
    q = b.anycast_queue("q")
    s = Sink(credit=2)
    q.add_subscription(s.sub)
    for i in range(5):
        b.publish("q", b"%d" % i, False)
    assert s.bodies == [b"0", b"1"] and len(q.messages) == 3
    s.sub.credit = 10
    assert q.dispatch() == 3
    assert s.bodies == [b"0", b"1", b"2", b"3", b"4"]


def test_multicast_copies_to_every_subscriber():
    b = make()
    b.resolve("t", MULTICAST, may_create=True)
    qa = b.subscription_queue("t", "c1.a", durable=True)
    qb = b.subscription_queue("t", "c2.b", durable=False)
    a, c = Sink(credit=5), Sink(credit=5)
    qa.add_subscription(a.sub)
    qb.add_subscription(c.sub)
    b.publish("t", b"x", False)
    assert a.bodies == [b"x"] and c.bodies == [b"x"]
    assert a.got[0].mid != c.got[0].mid


def test_unknown_address_without_auto_create_or_permission():
    b = make(auto_create=False)
    with pytest.raises(AddressNotFound) as ei:
        b.resolve("nope", None, may_create=True)
    assert ei.value.condition == "amqp:not-found"
    b2 = make()
    with pytest.raises(AddressNotFound):
        b2.resolve("nope", None, may_create=False)
    assert b2.needs_create("nope", None)


@pytest.mark.parametrize("outcome,failed,expect_count,expect_requeued,expect_dlq", [
    (Outcome.ACCEPTED, False, 0, False, False),
    (Outcome.RELEASED, False, 0, True, False),
    (Outcome.MODIFIED, False, 0, True, False),
    (Outcome.MODIFIED, True, 1, True, False),
    (Outcome.REJECTED, False, 0, False, True),
])
def test_settle_outcomes(outcome, failed, expect_count, expect_requeued, expect_dlq):
    store = ListStore()
    b = make(store)
    b.resolve("q", None, may_create=True)
    q = b.anycast_queue("q")
    s = Sink(credit=1)
    q.add_subscription(s.sub)
    b.publish("q", b"body", durable=True)
    msg = s.got[0]
    q.settle(s.sub, msg.mid, outcome, delivery_failed=failed)
    assert (len(q.messages) == 1) is expect_requeued
    if expect_requeued:
        assert q.messages[0].delivery_count == expect_count
    dlq = b.queues.get("DLQ")
    assert (dlq is not None and len(dlq.messages) == 1) is expect_dlq
    if outcome is Outcome.ACCEPTED:
        assert store.live == {} and q.acked == 1


def test_consumer_gone_returns_unacked_in_order_with_count():
    b = make()
    b.resolve("q", None, may_create=True)
    q = b.anycast_queue("q")
    s = Sink(credit=3)
    q.add_subscription(s.sub)
    for i in range(5):
        b.publish("q", b"%d" % i, False)
    q.settle(s.sub, s.got[1].mid, Outcome.ACCEPTED)
    q.remove_subscription(s.sub)
    assert [m.body for m in q.messages] == [b"0", b"2", b"3", b"4"]
    assert [m.delivery_count for m in q.messages] == [1, 1, 0, 0]
    s2 = Sink(credit=10)
    q.add_subscription(s2.sub)
    assert s2.bodies == [b"0", b"2", b"3", b"4"]


def test_max_delivery_count_dead_letters():
    store = ListStore()
    b = make(store, max_delivery_count=2, dead_letter_address="DLQ")
    b.resolve("q", None, may_create=True)
    q = b.anycast_queue("q")
    b.publish("q", b"poison", durable=True)
    for attempt in range(2):
        s = Sink(credit=1)
        q.add_subscription(s.sub)
        assert s.bodies == [b"poison"]
        q.remove_subscription(s.sub)
    assert len(q.messages) == 0 and q.dead_lettered == 1
    dlq = b.anycast_queue("DLQ")
    assert [m.body for m in dlq.messages] == [b"poison"]
    assert [k[0] for k in store.live] == ["DLQ"]  # moved in the store too


def test_failed_attempts_are_written_to_the_store():
    """Delivery counts of durable messages reach the store, so max-delivery-count survives a
    restart: modified(delivery-failed) and a consumer going away count; released does not;
    the attempt that dead-letters writes a remove, not a count."""
    store = ListStore()
    b = make(store, max_delivery_count=3)
    b.resolve("q", None, may_create=True)
    q = b.anycast_queue("q")
    b.publish("q", b"d", durable=True)
    b.publish("q", b"n", durable=False)
    mid = q.messages[0].mid

    def attempt(finish):
        s = Sink(credit=2)
        q.add_subscription(s.sub)
        assert sorted(s.bodies) == [b"d", b"n"]
        finish(s)
        if not s.sub.closed:
            q.remove_subscription(s.sub)

    def counts():
        return [op for op in store.ops if op[0] == "count"]

    attempt(lambda s: [q.settle(s.sub, m.mid, Outcome.RELEASED) for m in s.got])
    assert counts() == []
    attempt(lambda s: [q.settle(s.sub, m.mid, Outcome.MODIFIED, delivery_failed=True) for m in s.got])
    assert counts() == [("count", "q", mid, 1)]  # the non-durable one never reaches the store
    attempt(lambda s: q.remove_subscription(s.sub))
    assert counts() == [("count", "q", mid, 1), ("count", "q", mid, 2)]
    attempt(lambda s: [q.settle(s.sub, m.mid, Outcome.MODIFIED, undeliverable_here=True) for m in s.got])
    assert len(counts()) == 2 and ("remove", "q", mid) in store.ops and q.dead_lettered == 2
    # recovery hands the stored count back
    b2 = make()
    b2.resolve("q", None, may_create=True)
    b2.restore_message("q", 7, b"d", "q", delivery_count=2)
    assert b2.anycast_queue("q").messages[0].delivery_count == 2


def test_at_most_once_subscription_acks_on_dispatch():
    store = ListStore()
    b = make(store)
    b.resolve("q", None, may_create=True)
    q = b.anycast_queue("q")
    s = Sink(credit=5, auto_ack=True)
    q.add_subscription(s.sub)
    b.publish("q", b"a", durable=True)
    assert s.bodies == [b"a"] and q.depth == 0 and q.acked == 1 and store.live == {}


def test_temporary_subscription_deleted_durable_kept():
    b = make()
    b.resolve("t", MULTICAST, may_create=True)
    tmp = b.subscription_queue("t", "c.l", durable=False)
    dur = b.subscription_queue("t", "c.d", durable=True)
    s1, s2 = Sink(), Sink()
    tmp.add_subscription(s1.sub)
    dur.add_subscription(s2.sub)
    tmp.remove_subscription(s1.sub)
    dur.remove_subscription(s2.sub)
    assert tmp.name not in b.queues and "c.d" in b.queues
    b.publish("t", b"while-away", False)
    assert len(b.queues["c.d"].messages) == 1
    assert b.subscription_queue("t", "c.d", durable=True) is dur


def test_non_durable_messages_never_touch_the_store():
    store = ListStore()
    b = make(store)
    b.resolve("q", None, may_create=True)
    b.publish("q", b"x", durable=False)
    assert [op for op in store.ops if op[0] in ("add", "remove")] == []


def test_recovery_restores_queues_and_ids():
    b = make()
    b.restore_queue({"name": "c.sub", "address": "t", "routing_type": MULTICAST, "subscription": True})
    assert b.restore_message("c.sub", 41, b"m", "t")
    assert not b.restore_message("missing", 50, b"m", "t")
    assert b.next_mid() == 51
    assert b.addresses["t"].routing_types == {MULTICAST}


@pytest.mark.parametrize("data,durable", [
    (b"", False),
    (b"\x00\x53\x70\x45", False),                      # header, list0
    (b"\x00\x53\x70\xc0\x02\x01\x41", True),           # header [true]
    (b"\x00\x53\x70\xc0\x02\x01\x42", False),          # header [false]
    (b"\x00\x53\x70\xc0\x02\x01\x40", False),          # header [null]
    (b"\x00\x53\x70\xc0\x03\x01\x56\x01", True),       # boolean 0x56 0x01
    (b"\x00\x53\x70\xd0\x00\x00\x00\x05\x00\x00\x00\x01\x41", True),  # list32
    (b"\x00\x53\x73\xc0\x02\x01\x41", False),          # properties first: no header
    (b"\x00\x80\x00\x00\x00\x00\x00\x00\x00\x70\xc0\x02\x01\x41", True),  # ulong descriptor
    (b"\x00\x53\x70\xc0", False),                      # truncated
])
def test_message_durable_peek(data, durable):
    assert message_header(data)[0] is durable


def test_message_durable_matches_proton_encoding():
    from proton import Message
    for d in (True, False):
        m = Message(body="x" * 100, durable=d, priority=7, ttl=1000)
        assert message_header(m.encode())[0] is d
