"""The AMQP 1.0 features clients use, against a real broker process with unmodified
python-qpid-proton clients: dynamic nodes (temporary queues), browsing, ordering on release,
expiry, priority, wildcard subscriptions, anycast/multicast prefixes, link stealing, and the
rule that an attach reply claims only what is in force.

Each expectation is computed by hand from the messages the test sent (not read back from the
broker's own view), and the broker's management API is used only for state no client can see
(queue depth, the expiry address, whether a temporary queue is gone).
"""

from __future__ import annotations

import threading
import time

import pytest
from proton import Condition, Data, Described, Message, Terminus, symbol, ulong
from proton.handlers import MessagingHandler
from proton.reactor import Container, Copy, DurableSubscription, DynamicNodeProperties, Filter, LinkOption
from proton.utils import BlockingConnection, LinkDetached

from tests.brokerproc import start_broker, write_users_file
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin", ["admin"]), "app": ("app", ["app"])}


class Capability(LinkOption):
    def __init__(self, *caps: str):
        self.caps = caps

    def apply(self, link):
        term = link.source if link.is_receiver else link.target
        term.capabilities.put_array(False, Data.SYMBOL)
        term.capabilities.enter()
        for c in self.caps:
            term.capabilities.put_symbol(symbol(c))
        term.capabilities.exit()


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broker-features")
    users = write_users_file(tmp / "users.toml", USERS)
    b = start_broker(tmp, users_file=users, config={
        "acceptors.amqp": {"anycast-prefix": "queue://", "multicast-prefix": "topic://"},
        "node": {"message-expiry-scan-period-ms": 200},
        "address-settings.events.#": {"default-routing-type": "multicast"},
        "address-settings.noexp.#": {"expiry-address": ""},
    })
    yield b
    b.terminate()


def connect(b, container_id=None, user="app"):
    container = Container()
    if container_id:
        container.container_id = container_id
    return BlockingConnection(b.amqp_url.replace("amqp://", f"amqp://{user}:{user}@"), timeout=10,
                              container=container, allowed_mechs="PLAIN")


def send(c, address, bodies, **props):
    s = c.create_sender(address)
    for b in bodies:
        s.send(Message(body=b, **props))
    s.close()


def receive_all(r, n, timeout=5):
    out = []
    for _ in range(n):
        m = r.receive(timeout=timeout)
        r.accept()
        out.append(m.body)
    return out


def nothing_more(r, timeout=0.5):
    try:
        m = r.receive(timeout=timeout)
    except Exception:  # noqa: BLE001 - proton's Timeout
        return True
    return pytest.fail(f"unexpected message {m.body!r}")


def pump(c) -> bool:
    """Let a blocking connection do its I/O for a moment (it writes dispositions lazily)."""
    try:
        c.wait(lambda: False, timeout=0.05)
    except Exception:  # noqa: BLE001 - proton's Timeout
        pass
    return True


def depth(b, name):
    q = b.queue(name)
    return None if q is None else q["depth"]


# -- dynamic nodes -------------------------------------------------------------------------

def test_dynamic_receiver_gets_a_temporary_queue_for_request_response(broker):
    c = connect(broker)
    r = c.create_receiver(None, dynamic=True)
    reply_to = r.link.remote_source.address
    assert reply_to and reply_to.startswith("temp.")
    assert r.link.remote_source.dynamic
    q = broker.queue(reply_to)
    assert q is not None and q["temporary"] and not q["durable"]
    # another connection answers to the reply-to address
    other = connect(broker)
    send(other, reply_to, ["answer-1", "answer-2"])
    assert receive_all(r, 2) == ["answer-1", "answer-2"]
    r.close()
    wait_for(lambda: broker.queue(reply_to) is None, 5)  # gone with its link
    other.close()
    c.close()


def test_two_dynamic_receivers_get_distinct_addresses_and_connection_close_removes_them(broker):
    c = connect(broker)
    a = c.create_receiver(None, dynamic=True).link.remote_source.address
    b = c.create_receiver(None, dynamic=True).link.remote_source.address
    assert a != b
    c.close()
    wait_for(lambda: broker.queue(a) is None and broker.queue(b) is None, 5)


class DynamicTarget(LinkOption):
    def apply(self, link):
        link.target.dynamic = True


def test_dynamic_sender_is_refused_not_implemented(broker):
    c = connect(broker)
    with pytest.raises(LinkDetached) as info:
        c.create_sender(None, options=DynamicTarget())
    assert "amqp:not-implemented" in str(info.value) and "dynamic target" in str(info.value)
    c.close()


# -- browsing ------------------------------------------------------------------------------

def test_browser_reads_without_consuming(broker):
    c = connect(broker)
    send(c, "browse.q", [f"m{i}" for i in range(5)])
    br = c.create_receiver("browse.q", options=Copy())
    assert br.link.remote_source.distribution_mode == Terminus.DIST_MODE_COPY
    seen = [br.receive(timeout=5).body for _ in range(5)]
    assert seen == [f"m{i}" for i in range(5)]
    nothing_more(br)
    br.close()
    assert depth(broker, "browse.q") == 5  # nothing consumed
    r = c.create_receiver("browse.q")
    assert receive_all(r, 5) == [f"m{i}" for i in range(5)]
    r.close()
    wait_for(lambda: depth(broker, "browse.q") == 0, 5)
    c.close()


def test_browser_sees_new_messages_and_competes_with_nobody(broker):
    c = connect(broker)
    br = c.create_receiver("browse.live", name="browser", options=Copy())
    consumer = c.create_receiver("browse.live", name="consumer")
    send(c, "browse.live", ["a", "b", "c"])
    assert [br.receive(timeout=5).body for _ in range(3)] == ["a", "b", "c"]
    assert receive_all(consumer, 3) == ["a", "b", "c"]  # the consumer got every one too
    c.close()


# -- ordering ------------------------------------------------------------------------------

class _ReleaseTail(MessagingHandler):
    """Accept the first ``keep`` messages, then release the rest in one go (proton ranges the
    dispositions of consecutive deliveries), in the order ``order`` ("forward"/"reverse")."""

    def __init__(self, url, address, total, keep, order):
        super().__init__(prefetch=0, auto_accept=False)
        self.url, self.address, self.total, self.keep, self.order = url, address, total, keep, order
        self.held = []
        self.got = 0

    def on_start(self, event):
        self.conn = event.container.connect(self.url, allowed_mechs="PLAIN")
        self.receiver = event.container.create_receiver(self.conn, self.address)
        self.receiver.flow(self.total)

    def on_message(self, event):
        self.got += 1
        if self.got <= self.keep:
            self.accept(event.delivery)
        else:
            self.held.append(event.delivery)
        if self.got == self.total:
            for d in (self.held if self.order == "forward" else reversed(self.held)):
                self.release(d, delivered=False)
            event.receiver.close()
            event.connection.close()


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_released_messages_return_in_their_original_order(broker, order):
    address = f"order.{order}"
    c = connect(broker)
    send(c, address, list(range(1, 11)))
    Container(_ReleaseTail(broker.amqp_url.replace("amqp://", "amqp://app:app@"), address, 10, 5, order)).run()
    r = c.create_receiver(address)
    assert receive_all(r, 5) == [6, 7, 8, 9, 10]
    c.close()


def test_returned_on_link_close_keep_order(broker):
    c = connect(broker)
    send(c, "order.close", list(range(10)))
    r = c.create_receiver("order.close", credit=10)
    first = [r.receive(timeout=5).body for _ in range(3)]
    r.close()  # nothing settled: all ten come back, with one more failed attempt each
    r2 = c.create_receiver("order.close")
    rest = receive_all(r2, 10)
    assert first == [0, 1, 2] and rest == list(range(10))
    c.close()


# -- expiry --------------------------------------------------------------------------------

def test_expired_message_is_never_delivered_and_goes_to_the_expiry_address(broker):
    c = connect(broker)
    s = c.create_sender("exp.q")
    s.send(Message(body="short", ttl=0.3))
    s.send(Message(body="long", ttl=60))
    s.send(Message(body="abs", expiry_time=time.time() + 0.3))
    s.send(Message(body="plain"))
    # the two short-lived messages expire (the fixture's 200 ms expiry scan moves them out)
    wait_for(lambda: broker.queue("exp.q")["expired"] == 2, 10)
    r = c.create_receiver("exp.q")
    assert receive_all(r, 2) == ["long", "plain"]
    nothing_more(r)
    eq = c.create_receiver("ExpiryQueue")
    got = set(receive_all(eq, 2))
    assert got == {"short", "abs"}
    assert broker.queue("exp.q")["expired"] == 2
    c.close()


def test_expiry_scan_empties_a_queue_nobody_reads(broker):
    c = connect(broker)
    s = c.create_sender("noexp.scan")
    for i in range(20):
        s.send(Message(body=i, ttl=0.2))
    assert depth(broker, "noexp.scan") == 20
    wait_for(lambda: depth(broker, "noexp.scan") == 0, 5)  # scan period 200 ms
    q = broker.queue("noexp.scan")
    assert q["expired"] == 20
    c.close()


# -- priority ------------------------------------------------------------------------------

def test_priority_orders_delivery_within_a_queue(broker):
    c = connect(broker)
    sent = [("a", 4), ("b", 9), ("c", 0), ("d", 9), ("e", 5), ("f", 4), ("g", 0), ("h", 7)]
    s = c.create_sender("prio.q")
    for body, p in sent:
        s.send(Message(body=body, priority=p))
    s.close()
    expected = [b for b, _ in sorted(sent, key=lambda x: -x[1])]  # stable: FIFO within a level
    assert expected == ["b", "d", "h", "e", "a", "f", "c", "g"]
    r = c.create_receiver("prio.q")
    assert receive_all(r, len(sent)) == expected
    c.close()


# -- wildcards and prefixes ----------------------------------------------------------------

def test_wildcard_subscriptions_get_exactly_the_matching_messages(broker):
    c = connect(broker)
    one = c.create_receiver("events.stock.*", options=Capability("topic"))
    many = c.create_receiver("events.#", options=Capability("topic"))
    exact = c.create_receiver("events.stock.ibm", options=Capability("topic"))
    sent = ["events.stock.ibm", "events.stock.ibm.nyse", "events.bond.x", "events.stock", "other.stock.ibm"]
    for address in sent:
        send(c, address, [address])
    import fnmatch  # noqa: F401 - the expected sets below are written out by hand

    def got(r, n):
        return sorted(receive_all(r, n))

    assert got(one, 1) == ["events.stock.ibm"]
    assert got(many, 4) == sorted(["events.stock.ibm", "events.stock.ibm.nyse", "events.bond.x", "events.stock"])
    assert got(exact, 1) == ["events.stock.ibm"]
    for r in (one, many, exact):
        nothing_more(r, 0.3)
    c.close()


def test_topic_and_queue_prefixes_name_the_routing_type(broker):
    c = connect(broker)
    sub1 = c.create_receiver("topic://news", name="sub1")
    sub2 = c.create_receiver("topic://news", name="sub2")
    assert sub1.link.remote_source.address == "topic://news"
    send(c, "topic://news", ["n1", "n2"])
    assert receive_all(sub1, 2) == ["n1", "n2"] and receive_all(sub2, 2) == ["n1", "n2"]
    send(c, "queue://work", ["w1"])
    q = broker.queue("work")
    assert q is not None and q["routing_type"] == "anycast" and q["depth"] == 1
    assert broker.queue("queue://work") is None and broker.queue("topic://news") is None
    r = c.create_receiver("work")
    assert receive_all(r, 1) == ["w1"]
    # the anonymous relay honours the prefixes in 'to' too
    relay = c.create_sender(None)
    relay.send(Message(address="topic://news", body="n3"))
    assert receive_all(sub1, 1) == ["n3"] and receive_all(sub2, 1) == ["n3"]
    c.close()


# -- link stealing -------------------------------------------------------------------------

def test_second_connection_with_the_same_container_id_steals_the_durable_subscription(broker):
    first = connect(broker, container_id="stealer")
    r1 = first.create_receiver("events.steal", name="sub", options=[DurableSubscription(), Capability("topic")])
    producer = connect(broker)
    send(producer, "events.steal", ["before"])
    assert receive_all(r1, 1) == ["before"]
    wait_for(lambda: pump(first) and depth(broker, "stealer.sub") == 0, 5)  # the accept reached the broker
    second = connect(broker, container_id="stealer")
    r2 = second.create_receiver("events.steal", name="sub", options=[DurableSubscription(), Capability("topic")])
    with pytest.raises(LinkDetached) as info:
        r1.receive(timeout=5)
    assert "amqp:link:stolen" in str(info.value)
    send(producer, "events.steal", ["after"])
    assert receive_all(r2, 1) == ["after"]
    q = broker.queue("stealer.sub")
    assert q["consumers"] == 1
    for c in (first, second, producer):
        try:
            c.close()
        except Exception:  # noqa: BLE001 - the first connection's link is gone already
            pass


# -- never claim what is not done -----------------------------------------------------------

class RawFilter(LinkOption):
    def __init__(self, key, descriptor, value):
        self.key, self.descriptor, self.value = key, descriptor, value

    def apply(self, link):
        link.source.filter.put_dict({symbol(self.key): Described(self.descriptor, self.value)})


def test_unknown_filter_is_refused_with_not_implemented(broker):
    c = connect(broker)
    with pytest.raises(LinkDetached) as info:
        c.create_receiver("claims.q", options=RawFilter("x", symbol("example.org:made-up-filter"), "v"))
    assert "amqp:not-implemented" in str(info.value) and "example.org:made-up-filter" in str(info.value)
    c.close()


def test_shared_subscription_capability_is_refused(broker):
    c = connect(broker)
    with pytest.raises(LinkDetached) as info:
        c.create_receiver("events.shared", options=Capability("topic", "shared"))
    assert "amqp:not-implemented" in str(info.value) and "shared" in str(info.value)
    c.close()


def test_attach_reply_echoes_only_what_is_in_force(broker):
    c = connect(broker)
    r = c.create_receiver("claims.plain", options=Capability("queue", "made-up-capability"))
    src = r.link.remote_source
    assert src.distribution_mode != Terminus.DIST_MODE_COPY
    src.filter.rewind()
    assert not src.filter.next()  # no filter claimed
    caps = src.capabilities
    caps.rewind()
    caps.next()
    obj = caps.get_object()
    items = list(getattr(obj, "elements", obj if isinstance(obj, (list, tuple)) else [obj]))
    assert [str(x) for x in items] == ["queue"]
    c.close()
