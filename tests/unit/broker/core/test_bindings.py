"""Bindings in the pure core: the QueueHost, the remote-binding table, consumer-count events, and
the Broker's clustered publish and redistribution bookkeeping (broker.core.bindings, addresses)."""

from __future__ import annotations

import proton
import pytest

from broker.core.addresses import ANYCAST, MULTICAST, AddressSettings, Broker, SettingsResolver
from broker.core.balancing import LoadBalancing
from broker.core.bindings import ClusterBindings, ConsumersChanged, RemoteBinding
from broker.core.deliveries import Message
from broker.core.queues import Queue, QueueHost, Subscription


def consumer(q, credit=100, **kw):
    got = []
    sub = Subscription(lambda s, m: got.append(m.body), **kw)
    sub.credit = credit
    q.add_subscription(sub)
    return sub, got


def events(broker):
    seen = []
    broker.add_consumer_listener(lambda ev: seen.append(
        (ev.queue, ev.address, ev.routing_type, ev.count, ev.filter_text, ev.added)))
    return seen


# -- the queue's host ---------------------------------------------------------------------------
class FakeHost:
    def __init__(self):
        self.calls = []
        self.store = self
        self.clock = lambda: 5_000.0

    def add(self, queue, msg):
        self.calls.append(("add", queue, msg.mid))

    def remove(self, queue, msg):
        self.calls.append(("remove", queue, msg.mid))

    def delivery_count_changed(self, queue, msg):
        self.calls.append(("count", queue, msg.mid))


def test_a_queue_talks_only_to_its_host():
    fake = FakeHost()
    calls = fake.calls
    host = QueueHost(fake, fake.clock, lambda q, m: calls.append(("dlq", q.name, m.mid)),
                     lambda q, m: calls.append(("expire", q.name, m.mid)), lambda name: calls.append(("delete", name)),
                     lambda q, s, added: calls.append(("consumers", q.name, len(q.subs), added)))
    q = Queue(host, "t", "t", ANYCAST, durable=True, max_delivery_count=1, dead_letter_address="DLQ", temporary=True)
    q.enqueue(Message(1, b"x", True, "t"))
    q.enqueue(Message(2, b"y", True, "t", expires=4_000))
    sub, got = consumer(q)
    q.remove_subscription(sub)
    assert calls == [("add", "t", 1), ("add", "t", 2), ("consumers", "t", 1, True), ("remove", "t", 2),
                     ("expire", "t", 2), ("consumers", "t", 0, False), ("remove", "t", 1), ("dlq", "t", 1),
                     ("delete", "t")]
    assert got == [b"x"]
    assert not hasattr(q, "broker")


def test_broker_store_and_clock_replace_the_host_of_every_queue():
    b = Broker()
    b.declare_address("q", [ANYCAST])
    q = b.anycast_queue("q")
    assert q.host is b.host
    b.clock = lambda: 42.0
    assert q.host is b.host and q.host.clock() == 42.0 and b.clock() == 42.0


# -- consumer-count events --------------------------------------------------------------------
def test_events_on_add_remove_and_close_of_subscriptions_but_not_browsers():
    b = Broker()
    b.declare_address("orders", [ANYCAST])
    q = b.anycast_queue("orders")
    seen = events(b)
    s1, _ = consumer(q)
    s2, _ = consumer(q, accepts=lambda m: True, filter_text="color = 'red'")
    br, _ = consumer(q, browser=True)  # browse-only: not a consumer for the cluster (Artemis)
    q.remove_subscription(br)
    q.remove_subscription(s2)
    q.remove_subscription(s2)  # closed already: nothing
    q.remove_subscription(s1)
    assert seen == [
        ("orders", "orders", ANYCAST, 1, None, True),
        ("orders", "orders", ANYCAST, 2, "color = 'red'", True),
        ("orders", "orders", ANYCAST, 1, "color = 'red'", False),
        ("orders", "orders", ANYCAST, 0, None, False),
    ]


def test_events_for_a_temporary_subscription_come_before_its_queue_goes():
    b = Broker()
    b.declare_address("news", [MULTICAST])
    q = b.subscription_queue("news", "c1.l", durable=False)
    seen = events(b)
    sub, _ = consumer(q)
    q.remove_subscription(sub)
    assert [(e[0], e[2], e[3], e[5]) for e in seen] == [(q.name, MULTICAST, 1, True), (q.name, MULTICAST, 0, False)]
    assert q.deleted and q.name not in b.queues


def test_no_events_once_the_queue_is_deleted_and_listeners_can_be_removed():
    b = Broker()
    b.declare_address("orders", [ANYCAST])
    q = b.anycast_queue("orders")
    seen = events(b)
    sub, _ = consumer(q)
    b.delete_queue("orders")
    q.remove_subscription(sub)
    assert len(seen) == 1
    b.remove_consumer_listener(b._consumer_listeners[0])
    b.declare_address("other", [ANYCAST])
    consumer(b.anycast_queue("other"))
    assert len(seen) == 1


def test_event_is_a_plain_frozen_record():
    ev = ConsumersChanged("q", "a", ANYCAST, 1, None, True)
    with pytest.raises(AttributeError):
        ev.count = 2  # type: ignore[misc]


# -- the remote-binding table ----------------------------------------------------------------
def test_put_replace_remove_and_count():
    c = ClusterBindings()
    assert c.put(RemoteBinding("B", "orders", "orders", ANYCAST))
    assert c.put(RemoteBinding("C", "orders", "orders", ANYCAST, consumers=2))
    assert c.put(RemoteBinding("B", "orders", "orders", ANYCAST, consumers=1))  # replaced in place
    assert c.count == len(c) == 2
    assert list(c.remote("orders")["orders"]) == ["B", "C"]  # arrival order kept
    assert c.get("B", "orders").consumers == 1
    assert c.remove("B", "orders").node_id == "B" and c.remove("B", "orders") is None
    assert c.count == 1
    c.put(RemoteBinding("C", "news.1", "news", MULTICAST))
    assert sorted(b.queue for b in c.remove_node("C")) == ["news.1", "orders"]
    assert c.count == 0 and c.by_address == {}


def test_consumer_filters_are_reference_counted():
    c = ClusterBindings(compile_filter=lambda t: (lambda m: t.encode() in m.body))
    c.put(RemoteBinding("B", "orders", "orders", ANYCAST))
    c.consumer_added("B", "orders", "red")
    c.consumer_added("B", "orders", "red")
    c.consumer_added("B", "orders", "blue")
    b = c.get("B", "orders")
    assert (b.consumers, sorted(b.consumer_filters)) == (3, ["blue", "red", "red"])
    c.consumer_removed("B", "orders", "red")
    entry = c.remote("orders")["orders"]["B"]
    assert entry.has_matching_consumer(Message(1, b"red", False, "orders"))
    c.consumer_removed("B", "orders", "red")
    entry = c.remote("orders")["orders"]["B"]
    assert not entry.has_matching_consumer(Message(1, b"red", False, "orders"))
    assert entry.has_matching_consumer(Message(1, b"blue", False, "orders"))
    c.consumer_removed("B", "orders", "blue")
    c.consumer_removed("B", "orders")
    assert c.get("B", "orders").consumers == 0  # never below zero
    assert c.consumer_added("X", "orders") is None


def test_max_hops_and_connected_flags():
    c = ClusterBindings(max_hops=2)
    assert c.put(RemoteBinding("C", "orders", "orders", ANYCAST, distance=2, via="B"))
    assert not c.put(RemoteBinding("D", "orders", "orders", ANYCAST, distance=3, via="B"))
    assert c.ignored_too_far == 1 and c.get("C", "orders").next_hop == "B"
    assert c.set_connected("C", False) == 1 and not c.get("C", "orders").connected
    assert c.set_connected("C", False) == 0


def test_real_selectors_by_default():
    c = ClusterBindings()
    c.put(RemoteBinding("B", "orders", "orders", ANYCAST, consumers=1, consumer_filters=("color = 'red'",),
                        filter_text="size > 1"))
    e = c.remote("orders")["orders"]["B"]
    red = Message(1, proton.Message(properties={"color": "red", "size": 2}).encode(), False, "orders")
    blue = Message(2, proton.Message(properties={"color": "blue", "size": 2}).encode(), False, "orders")
    small = Message(3, proton.Message(properties={"color": "red", "size": 1}).encode(), False, "orders")
    assert e.has_matching_consumer(red) and not e.has_matching_consumer(blue)
    assert e.filter(red) and not e.filter(small)


# -- the Broker, clustered --------------------------------------------------------------------
def clustered(mode=LoadBalancing.ON_DEMAND, delay_ms=-1, now=None):
    now = now if now is not None else [0.0]
    b = Broker(SettingsResolver(AddressSettings(redistribution_delay_ms=delay_ms)), clock=lambda: now[0])
    b.load_balancing = mode
    sent = []
    b.on_forward = lambda fwd, msg: sent.append((fwd.via, fwd.targets, msg.body))
    return b, sent, now


def test_single_node_publish_never_consults_the_balancer(monkeypatch):
    b = Broker()
    b.declare_address("orders", [ANYCAST])
    monkeypatch.setattr(b, "_publish_clustered", lambda *a: pytest.fail("clustered path on a single node"))
    b.publish("orders", b"x", False)
    assert len(b.anycast_queue("orders").messages) == 1


def test_clustered_anycast_strict_round_robin_and_forwarding():
    b, sent, _ = clustered(LoadBalancing.STRICT)
    b.declare_address("orders", [ANYCAST])
    for n in "BC":
        b.cluster.put(RemoteBinding(n, "orders", "orders", ANYCAST))
    for i in range(6):
        b.publish("orders", b"%d" % i, False)
    assert [m.body for m in b.anycast_queue("orders").messages] == [b"0", b"3"]
    assert sent == [("B", (("B", "orders"),), b"1"), ("C", (("C", "orders"),), b"2"),
                    ("B", (("B", "orders"),), b"4"), ("C", (("C", "orders"),), b"5")]
    assert b.forwarded == 4 and b.forwards_unsent == 0


def test_clustered_on_demand_prefers_consumers_and_keeps_local_otherwise():
    b, sent, _ = clustered()
    b.declare_address("orders", [ANYCAST])
    q = b.anycast_queue("orders")
    b.cluster.put(RemoteBinding("B", "orders", "orders", ANYCAST))
    b.publish("orders", b"a", False)
    assert [m.body for m in q.messages] == [b"a"] and sent == []  # nobody consumes: local
    b.cluster.consumer_added("B", "orders")
    b.publish("orders", b"b", False)
    b.publish("orders", b"c", False)
    assert [m.body for m in q.messages] == [b"a"] and [s[2] for s in sent] == [b"b", b"c"]
    _, got = consumer(q)
    for body in (b"d", b"e", b"f", b"g"):
        b.publish("orders", body, False)
    # the rotation went local (fallback) → B → B (local had no consumer yet); now local, B, …
    assert got == [b"a", b"d", b"f"] and [s[2] for s in sent] == [b"b", b"c", b"e", b"g"]


def test_clustered_multicast_local_subscriptions_and_one_copy_per_node():
    b, sent, _ = clustered()
    b.declare_address("news", [MULTICAST])
    s1 = b.subscription_queue("news", "a.1", durable=True)
    s2 = b.subscription_queue("news", "a.2", durable=True)
    for name in ("b.1", "b.2"):
        b.cluster.put(RemoteBinding("B", name, "news", MULTICAST))
    b.cluster.put(RemoteBinding("C", "c.1", "news", MULTICAST))
    b.publish("news", b"n", False)
    assert len(s1.messages) == len(s2.messages) == 1 and s1.messages[0].mid != s2.messages[0].mid
    assert sent == [("B", (("B", "b.1"), ("B", "b.2")), b"n"), ("C", (("C", "c.1"),), b"n")]


def test_clustered_publish_to_an_address_only_other_nodes_have():
    b, sent, _ = clustered()
    b.cluster.put(RemoteBinding("B", "remote.q", "remote.q", ANYCAST, consumers=1))
    b.publish("remote.q", b"r", True)
    assert sent == [("B", (("B", "remote.q"),), b"r")] and b.dropped_unrouted == 0
    b.publish("nowhere", b"x", False)
    assert b.dropped_unrouted == 1
    b.on_forward = None
    b.publish("remote.q", b"r2", False)
    assert b.forwards_unsent == 1


def test_remote_wildcard_subscriptions_attract_matching_addresses_with_one_copy_per_node():
    """A wildcard address only other nodes have (their wildcard subscriptions) takes part in
    routing every address it matches; a node with several matching subscriptions gets one copy
    for all of them; the match cache follows remote addresses coming and going."""
    b, sent, _ = clustered()
    b.declare_address("events.stock.ibm", [MULTICAST])
    b.declare_address("events.bond.x", [MULTICAST])
    b.publish("events.stock.ibm", b"0", False)          # nobody subscribed yet (and the cache is warm)
    assert sent == [] and b.dropped_unrouted == 1
    b.cluster.put(RemoteBinding("B", "b.stocks", "events.stock.*", MULTICAST, consumers=1))
    b.cluster.put(RemoteBinding("B", "b.all", "events.#", MULTICAST, consumers=1))
    b.cluster.put(RemoteBinding("C", "c.bonds", "events.bond.*", MULTICAST, consumers=1))
    b.publish("events.stock.ibm", b"1", False)
    b.publish("events.bond.x", b"2", False)
    assert sorted(sent) == sorted([("B", (("B", "b.stocks"), ("B", "b.all")), b"1"),
                                   ("B", (("B", "b.all"),), b"2"), ("C", (("C", "c.bonds"),), b"2")])
    sent.clear()
    b.cluster.remove("B", "b.all")
    b.cluster.remove("B", "b.stocks")
    b.publish("events.stock.ibm", b"3", False)
    assert sent == [] and b.dropped_unrouted == 2


def test_clustered_off_keeps_everything_local_and_the_store_is_written():
    stored = []

    class Store:
        def add(self, queue, msg):
            stored.append((queue, msg.body))

        def queue_created(self, d):
            pass

    b = Broker(store=Store())
    b.load_balancing = LoadBalancing.OFF
    b.declare_address("orders", [ANYCAST])
    b.cluster.put(RemoteBinding("B", "orders", "orders", ANYCAST, consumers=1))
    assert b.publish("orders", b"d", True) is True
    assert stored == [("orders", b"d")]


# -- redistribution bookkeeping in the Broker -------------------------------------------------
def test_last_consumer_leaving_starts_the_delay_and_a_returning_one_cancels_it():
    b, _, now = clustered(delay_ms=1_000)
    b.declare_address("orders", [ANYCAST])
    q = b.anycast_queue("orders")
    b.cluster.put(RemoteBinding("B", "orders", "orders", ANYCAST, consumers=1))
    sub, _ = consumer(q, credit=0)
    b.publish("orders", b"waiting", False)  # B has a consumer, but so do we: rotation → local first
    now[0] = 10_000
    q.remove_subscription(sub)
    assert "orders" in b.redistribution and b.next_redistribution_ms(10_000) == 11_000
    assert b.redistributions_due(10_999) == []
    now[0] = 10_500
    sub2, _ = consumer(q, credit=0)  # came back within the delay: cancelled
    assert "orders" not in b.redistribution and b.redistributions_due(20_000) == []
    now[0] = 12_000
    q.remove_subscription(sub2)
    assert b.redistributions_due(13_000) == [(q, "B")]


@pytest.mark.parametrize("delay,expect_pending", [(-1, False), (0, True)])
def test_redistribution_delay_setting(delay, expect_pending):
    b, _, _ = clustered(delay_ms=delay)
    b.declare_address("orders", [ANYCAST])
    q = b.anycast_queue("orders")
    sub, _ = consumer(q)
    q.remove_subscription(sub)
    assert ("orders" in b.redistribution) is expect_pending


def test_strict_and_off_never_schedule_redistribution():
    for mode in (LoadBalancing.STRICT, LoadBalancing.OFF):
        b, _, _ = clustered(mode, delay_ms=0)
        b.declare_address("orders", [ANYCAST])
        sub, _ = consumer(b.anycast_queue("orders"))
        b.anycast_queue("orders").remove_subscription(sub)
        assert len(b.redistribution) == 0


def test_a_remote_consumer_arriving_restarts_the_delay_for_an_idle_local_queue():
    b, _, now = clustered(delay_ms=500)
    b.declare_address("orders", [ANYCAST])
    q = b.anycast_queue("orders")
    b.cluster.put(RemoteBinding("B", "orders", "orders", ANYCAST))
    b.publish("orders", b"m", False)
    now[0] = 1_000
    b.cluster.consumer_added("B", "orders")
    assert b.next_redistribution_ms(1_000) == 1_500
    assert b.redistributions_due(1_499) == [] and b.redistributions_due(1_500) == [(q, "B")]
    b.delete_queue("orders")
    assert len(b.redistribution) == 0


def test_a_binding_learned_with_consumers_starts_the_delay_and_a_deleted_queue_leaves_no_rotation():
    b, _, now = clustered(delay_ms=0)
    b.declare_address("orders", [ANYCAST])
    q = b.anycast_queue("orders")
    b.cluster.put(RemoteBinding("B", "orders", "orders", ANYCAST))
    assert len(b.redistribution) == 0
    b.cluster.put(RemoteBinding("B", "orders", "orders", ANYCAST, consumers=2))  # a bridge resync
    b.publish("orders", b"m", False)  # B has consumers: forwarded, rotation remembered
    assert "orders" in b.redistribution and b.rotation.positions == {("orders", "orders"): 0}
    b.cluster.put(RemoteBinding("B", "other", "other", ANYCAST, consumers=1))  # no local queue of that name
    assert "other" not in b.redistribution
    b.delete_queue("orders")
    assert b.rotation.positions == {} and len(b.redistribution) == 0 and q.deleted


def test_a_5_node_mesh_gets_exactly_a_fifth_each_through_the_broker():
    b, sent, _ = clustered()
    b.declare_address("orders", [ANYCAST])
    _, got = consumer(b.anycast_queue("orders"), credit=10_000)
    for n in "BCDE":
        b.cluster.put(RemoteBinding(n, "orders", "orders", ANYCAST, consumers=1))
    for i in range(1_000):
        b.publish("orders", b"%d" % i, False)
    per_node = {n: sum(1 for s in sent if s[0] == n) for n in "BCDE"}
    assert len(got) == 200 and per_node == {"B": 200, "C": 200, "D": 200, "E": 200}


# -- the AMQP engine feeds the events (selector text; browsers are not consumers) -------------
def test_the_engine_reports_a_consumers_selector_and_ignores_browsers(tmp_path):
    from proton import Described, Terminus, symbol

    from tests.unit.broker.amqp.test_txn_engine import Wire

    w = Wire(tmp_path)
    core = w.node.core
    core.declare_address("orders", [ANYCAST])
    seen = events(core)

    def receiver(name, selector=None, browse=False):
        rcv = w.session.receiver(name)
        rcv.source.address = "orders"
        if selector is not None:
            rcv.source.filter.put_dict({symbol("selector"): Described(symbol("apache.org:selector-filter:string"),
                                                                      selector)})
        if browse:
            rcv.source.distribution_mode = Terminus.DIST_MODE_COPY
        rcv.open()
        rcv.flow(10)
        w.pump()
        return rcv

    red = receiver("red", "color = 'red'")
    receiver("browser", browse=True)
    plain = receiver("plain")
    red.close()
    w.pump()
    plain.close()
    w.pump()
    assert seen == [
        ("orders", "orders", ANYCAST, 1, "color = 'red'", True),
        ("orders", "orders", ANYCAST, 2, None, True),
        ("orders", "orders", ANYCAST, 1, "color = 'red'", False),
        ("orders", "orders", ANYCAST, 0, None, False),
    ]
    assert core.anycast_queue("orders").consumer_count == 1  # the browser, for management
