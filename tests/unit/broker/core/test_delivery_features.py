"""The pure message core's delivery features: priority, order on return, consumer and queue
filters, browsers, expiry (with an injected clock), wildcard routing and temporary queues."""

from __future__ import annotations

import pytest

from broker.core.addresses import ANYCAST, MULTICAST, AddressSettings, Broker, SettingsResolver, WildcardSettings
from broker.core.deliveries import Outcome
from broker.core.queues import PriorityMessages, Subscription


class Sink:
    def __init__(self):
        self.got = []

    def __call__(self, sub, msg):
        self.got.append(msg)

    @property
    def bodies(self):
        return [m.body for m in self.got]


def consumer(q, credit=100, **kw):
    sink = Sink()
    sub = Subscription(sink, **kw)
    sub.credit = credit
    q.add_subscription(sub)
    return sub, sink


def anycast(broker, name="q"):
    broker.declare_address(name, [ANYCAST])
    return broker.anycast_queue(name)


def test_priority_highest_first_fifo_within_a_level():
    b = Broker()
    q = anycast(b)
    sent = [(b"a", 4), (b"b", 9), (b"c", 0), (b"d", 9), (b"e", 5), (b"f", 4)]
    for body, p in sent:
        b.publish("q", body, False, priority=p)
    assert isinstance(q.messages, PriorityMessages) and len(q.messages) == 6
    _, sink = consumer(q)
    assert sink.bodies == [b"b", b"d", b"e", b"a", b"f", b"c"]


def test_default_priority_keeps_the_plain_deque():
    b = Broker()
    q = anycast(b)
    for i in range(3):
        b.publish("q", b"%d" % i, False)
    assert type(q.messages).__name__ == "deque"


@pytest.mark.parametrize("order", [[5, 6, 7, 8, 9], [9, 8, 7, 6, 5], [7, 5, 9, 6, 8]])
def test_released_messages_return_to_their_place_whatever_the_disposition_order(order):
    b = Broker()
    q = anycast(b)
    for i in range(10):
        b.publish("q", b"%d" % i, False)
    sub, sink = consumer(q, credit=10)
    mids = [m.mid for m in sink.got]
    for i in range(5):
        q.settle(sub, mids[i], Outcome.ACCEPTED)
    q.remove_subscription(sub)  # nothing settled for the rest yet: order matters only below
    sub2, sink2 = consumer(q, credit=5)
    for i in order:
        q.settle(sub2, sink2.got[i - 5].mid, Outcome.RELEASED)
    assert [m.body for m in q.messages] == [b"%d" % i for i in range(5, 10)]


def test_release_of_priority_messages_returns_within_their_level():
    b = Broker()
    q = anycast(b)
    for body, p in [(b"h1", 9), (b"h2", 9), (b"l1", 1)]:
        b.publish("q", body, False, priority=p)
    sub, sink = consumer(q, credit=3)
    for m in reversed(sink.got):
        q.settle(sub, m.mid, Outcome.RELEASED)
    q.remove_subscription(sub)
    assert [m.body for m in q.messages] == [b"h1", b"h2", b"l1"]


def test_filtered_consumers_take_only_what_they_accept_and_the_rest_waits():
    b = Broker()
    q = anycast(b)
    red, red_sink = consumer(q, accepts=lambda m: m.body.startswith(b"red"))
    for body in (b"blue1", b"red1", b"blue2", b"red2"):
        b.publish("q", body, False)
    assert red_sink.bodies == [b"red1", b"red2"]
    assert [m.body for m in q.messages] == [b"blue1", b"blue2"]
    _, any_sink = consumer(q)
    assert any_sink.bodies == [b"blue1", b"blue2"]


def test_filtered_dispatch_respects_credit_and_keeps_order():
    b = Broker()
    q = anycast(b)
    for i in range(6):
        b.publish("q", b"%d" % i, False)
    even, sink = consumer(q, credit=2, accepts=lambda m: int(m.body) % 2 == 0)
    assert sink.bodies == [b"0", b"2"]
    even.credit = 5
    q.credit_changed(even)
    assert sink.bodies == [b"0", b"2", b"4"]
    assert [m.body for m in q.messages] == [b"1", b"3", b"5"]


def test_queue_filter_keeps_messages_out():
    b = Broker()
    q = anycast(b)
    b.set_queue_filter("q", lambda m: m.body != b"no", "body <> 'no'")
    b.publish("q", b"yes", False)
    b.publish("q", b"no", False)
    assert [m.body for m in q.messages] == [b"yes"] and b.dropped_unrouted == 1
    assert q.definition()["filter"] == "body <> 'no'"


def test_browser_sees_everything_once_and_acquires_nothing():
    b = Broker()
    q = anycast(b)
    for i in range(3):
        b.publish("q", b"%d" % i, False)
    br, sink = consumer(q, credit=2, browser=True)
    assert sink.bodies == [b"0", b"1"]
    br.credit = 10
    q.credit_changed(br)
    b.publish("q", b"3", False)
    assert sink.bodies == [b"0", b"1", b"2", b"3"]
    assert len(q.messages) == 4 and q.depth == 4 and not br.unacked
    assert q.consumer_count == 1
    _, real = consumer(q)
    assert real.bodies == [b"0", b"1", b"2", b"3"]
    assert sink.bodies == [b"0", b"1", b"2", b"3"]  # nothing shown twice


class Clock:
    def __init__(self, now=1_000_000.0):
        self.now = now

    def __call__(self):
        return self.now


def test_expired_messages_are_not_delivered_and_go_to_the_expiry_address():
    clock = Clock()
    b = Broker(clock=clock)
    q = anycast(b)
    b.publish("q", b"short", False, expires=clock.now + 100)
    b.publish("q", b"long", False, expires=clock.now + 10_000)
    b.publish("q", b"never", False)
    clock.now += 500
    _, sink = consumer(q)
    assert sink.bodies == [b"long", b"never"]
    assert q.expired == 1
    assert [m.body for m in b.anycast_queue("ExpiryQueue").messages] == [b"short"]
    assert b.anycast_queue("ExpiryQueue").messages[0].expires == 0  # it does not expire again


def test_expire_scan_and_a_missing_expiry_address_drops_and_counts():
    clock = Clock()
    b = Broker(SettingsResolver(AddressSettings(expiry_address=None)), clock=clock)
    q = anycast(b)
    for i in range(5):
        b.publish("q", b"%d" % i, False, expires=clock.now + (100 if i % 2 else 10_000))
    assert q.expire_scan(clock.now + 200) == 2
    assert [m.body for m in q.messages] == [b"0", b"2", b"4"] and b.dropped_expired == 2


def test_wildcard_subscriptions_receive_matching_addresses():
    b = Broker()
    b.declare_address("events.stock.*", [MULTICAST])
    b.declare_address("events.#", [MULTICAST])
    one = b.subscription_queue("events.stock.*", None, durable=False)
    many = b.subscription_queue("events.#", None, durable=False)
    for address in ("events.stock.ibm", "events.stock.ibm.x", "events.bond", "other"):
        b.declare_address(address, [MULTICAST])
        b.publish(address, address.encode(), False)
    assert [m.body for m in one.messages] == [b"events.stock.ibm"]
    assert [m.body for m in many.messages] == [b"events.stock.ibm", b"events.stock.ibm.x", b"events.bond"]


def test_wildcard_routing_can_be_turned_off_and_characters_changed():
    off = Broker(wildcards=WildcardSettings(routing_enabled=False))
    off.declare_address("a.*", [MULTICAST])
    q = off.subscription_queue("a.*", None, durable=False)
    off.declare_address("a.b", [MULTICAST])
    off.publish("a.b", b"x", False)
    assert not q.messages
    slash = Broker(wildcards=WildcardSettings(delimiter="/", any_words=">", single_word="+"))
    slash.declare_address("a/+", [MULTICAST])
    q2 = slash.subscription_queue("a/+", None, durable=False)
    slash.declare_address("a/b", [MULTICAST])
    slash.publish("a/b", b"y", False)
    assert [m.body for m in q2.messages] == [b"y"]


def test_temporary_queue_and_its_address_go_with_the_last_consumer():
    b = Broker()
    q = b.temporary_queue("temp.1", owner="app")
    sub, _ = consumer(q)
    b.publish("temp.1", b"x", False)
    assert b.owned["app"] == 1
    q.remove_subscription(sub)
    assert "temp.1" not in b.queues and "temp.1" not in b.addresses and not b.owned["app"]
    with pytest.raises(ValueError):
        b.temporary_queue("q0") if anycast(b, "q0") else None
