"""The AMQP engine on a fake host (broker.amqp.host.EngineHost): no node, no sockets, no trio.

A proton client transport is pumped against an ``AmqpEngine`` whose host records what it is
told (counters, authorization questions, sync requests, lifecycle callbacks), so the tests
show exactly what the engine asks of its host — and that it asks nothing else.
"""

from __future__ import annotations

import collections

import pytest
from proton import Collector, Connection, Delivery, Message, Transport

from broker.amqp.engine import AmqpEngine
from broker.amqp.links import InternalServices
from broker.amqp.host import EngineHost, EngineSettings
from broker.core.addresses import Broker
from broker.node import Node
from tests.engine_pair import pump


class RecordingStore:
    """A core store that keeps nothing but counts adds (makes durable sends 'stored')."""

    def __init__(self):
        self.added = 0

    def add(self, queue, msg):
        self.added += 1

    def remove(self, queue, msg):
        pass

    def delivery_count_changed(self, queue, msg):
        pass

    def queue_created(self, definition):
        pass

    def queue_deleted(self, name):
        pass


class FakeHost:
    """Records everything an engine tells its host; ``deny`` lists (permission, address) refused."""

    def __init__(self, settings: EngineSettings = EngineSettings(), deny=()):
        self.settings = settings
        self.core = Broker(store=RecordingStore())
        self.container_id = "fake-container"
        self.node_id = "fake-node-id"
        self.counts: collections.Counter = collections.Counter()
        self.asked: list[tuple[str, str]] = []
        self.deny = set(deny)
        self.sync: list = []
        self.created: list[str] = []
        self.opened: list = []
        self.closed: list = []
        self.services = InternalServices()
        self.open_properties: dict = {}
        self.server_open_properties: dict = {}

    def authorize(self, principal, permission, address):
        self.asked.append((permission, address))
        return (permission, address) not in self.deny

    def count(self, event, n=1):
        self.counts[event] += n

    def await_sync(self, engine, delivery):
        self.sync.append((engine, delivery))

    def address_created(self, address):
        self.created.append(address)

    def connection_opened(self, engine):
        self.opened.append(engine)

    def connection_closed(self, engine):
        self.closed.append(engine)


class Wire:
    """A proton client connection pumped against one engine on ``host``."""

    def __init__(self, host):
        self.host = host
        self.engine = AmqpEngine(host, conn_id="c1", principal=None, source="test", tls=False, wake=lambda: None)
        self.conn = Connection()
        self.conn.container = "client-1"
        self.transport = Transport()
        self.transport.bind(self.conn)
        self.conn.collect(Collector())
        self.conn.open()
        self.session = self.conn.session()
        self.session.open()
        self.pump()

    def pump(self) -> None:
        pump(self.transport, self.engine, 20)

    def sender(self, address: str, name: str = "s"):
        s = self.session.sender(name)
        s.target.address = address
        s.open()
        self.pump()
        return s

    def send(self, sender, body: str, durable: bool = False) -> Delivery:
        d = sender.delivery(body.encode())
        sender.send(Message(body=body, durable=durable).encode())
        sender.advance()
        self.pump()
        return d


def test_fake_host_satisfies_the_protocol_and_node_has_every_member():
    members = [n for n in vars(EngineHost) if not n.startswith("_")] + list(EngineHost.__annotations__)
    for name in set(members):
        assert hasattr(FakeHost(), name), name
        assert hasattr(Node, name) or name in ("settings", "core", "container_id", "node_id", "services"), name


def test_open_tells_the_host_and_carries_its_identity():
    host = FakeHost()
    w = Wire(host)
    assert host.opened == [w.engine]
    assert w.engine.container_id == "client-1"
    assert w.conn.remote_container == "fake-container"
    assert w.conn.remote_properties["node-id"] == "fake-node-id"
    w.conn.close()
    w.pump()
    w.engine.close_input()
    w.engine.take_output()
    assert host.closed == [w.engine] and w.engine.error is None


def test_attach_asks_the_host_and_counts_link_and_message():
    host = FakeHost()
    w = Wire(host)
    s = w.sender("orders")
    assert ("send", "orders") in host.asked and ("createAddress", "orders") in host.asked
    assert host.created == ["orders"]
    assert host.counts["links_opened"] == 1
    d = w.send(s, "hello")
    assert d.remote_state == Delivery.ACCEPTED and d.settled
    assert host.counts["messages_in"] == 1
    assert host.core.queues["orders"].depth == 1


def test_durable_send_waits_for_the_hosts_sync():
    host = FakeHost()
    w = Wire(host)
    s = w.sender("orders")
    d = w.send(s, "kept", durable=True)
    assert len(host.sync) == 1 and host.sync[0][0] is w.engine
    assert d.remote_state is None or d.remote_state == 0  # not answered before the fsync
    w.engine.synced([host.sync[0][1]])
    w.pump()
    assert d.remote_state == Delivery.ACCEPTED


def test_refused_by_the_host_gives_unauthorized_access():
    host = FakeHost(deny={("send", "secret")})
    w = Wire(host)
    s = w.sender("secret")
    assert s.remote_condition is not None and s.remote_condition.name == "amqp:unauthorized-access"
    assert host.counts["links_opened"] == 0 and "secret" not in host.core.addresses


@pytest.mark.parametrize("max_links", [1, 2])
def test_settings_bound_links_and_the_refusal_is_counted(max_links):
    host = FakeHost(EngineSettings(max_links=max_links))
    w = Wire(host)
    links = [w.sender(f"q{i}", name=f"s{i}") for i in range(max_links + 1)]
    assert all(link.remote_condition is None for link in links[:max_links])
    assert links[-1].remote_condition.name == "amqp:resource-limit-exceeded"
    assert host.counts["resource_limit_max_links"] == 1
    assert host.counts["links_opened"] == max_links


def test_settings_set_the_transport():
    host = FakeHost(EngineSettings(max_frame_bytes=4096, idle_timeout_s=7.0, max_sessions=3))
    e = AmqpEngine(host, conn_id="c", principal=None, source="t", tls=False, wake=lambda: None)
    assert e.transport.max_frame_size == 4096
    assert e.transport.idle_timeout == 7.0
    assert e.transport.channel_max == 3


# -- client mode: two engines, the dialling one (client=True) against an accepting one -----------

class Handler:
    """An owner's link handler (broker.amqp.links.LinkHandler): records what the engine tells it."""

    def __init__(self, settle: str = "accepted"):
        self.attached = []
        self.detached = []
        self.deliveries = []      # sending: (token, outcome)
        self.messages = []        # receiving: the bytes
        self.flows = 0
        self.settle = settle

    def on_attached(self, link):
        self.attached.append(link)

    def on_detached(self, link, condition):
        self.detached.append(condition)

    def on_credit(self, link):
        self.flows += 1

    def on_outcome(self, link, token, outcome):
        self.deliveries.append((token, outcome))

    def on_message(self, link, data, delivery):
        self.messages.append(data)
        if self.settle == "rejected":
            delivery.reject("amqp:precondition-failed", "test says no")
        else:
            delivery.settle(self.settle)


def pump_pair(a: AmqpEngine, b: AmqpEngine) -> None:
    for _ in range(30):
        x, y = a.take_output(), b.take_output()
        if x:
            b.push(x)
        if y:
            a.push(y)
        if not x and not y:
            return


def client_pair(server_host=None):
    server_host = server_host or FakeHost()
    dialler_host = FakeHost()
    dialler_host.container_id, dialler_host.node_id = "dialler", "dialler-node"
    client = AmqpEngine(dialler_host, conn_id="p1", principal=None, source="amqp://peer", tls=False,
                        wake=lambda: None, client=True, hostname="peer.example")
    server = AmqpEngine(server_host, conn_id="s1", principal=None, source="dialler", tls=False, wake=lambda: None)
    opened = []
    client.on_open = opened.append
    pump_pair(client, server)
    return client, server, dialler_host, server_host, opened


def test_client_mode_opens_with_our_identity_and_learns_the_peers():
    client, server, dh, sh, opened = client_pair()
    assert client.opened and server.opened and opened == [client]
    assert server.container_id == "dialler" and server.connection.remote_hostname == "peer.example"
    assert server.connection.remote_properties["node-id"] == "dialler-node"
    assert client.container_id == "fake-container" and client.remote_properties["node-id"] == "fake-node-id"
    assert dh.opened == [client] and sh.opened == [server]


def test_client_mode_sender_gets_attach_flow_and_each_acceptance():
    client, server, dh, sh, _ = client_pair()
    h = Handler()
    link = client.open_link(h, name="bridge-1", sender=True, address="orders")
    pump_pair(client, server)
    assert h.attached == [link] and link.credit > 0 and h.flows >= 1
    for i in range(3):
        link.send(Message(body=f"m{i}").encode(), f"t{i}")
    pump_pair(client, server)
    assert [tag for tag, _ in h.deliveries] == ["t0", "t1", "t2"]
    assert all(state == "accepted" for _, state in h.deliveries)
    assert sh.core.queues["orders"].depth == 3 and sh.counts["messages_in"] == 3
    assert dh.counts["links_opened"] == 1  # the dialler's own link, counted on its host


def test_client_mode_refused_link_is_reported_detached_with_the_condition():
    client, server, dh, sh, _ = client_pair(FakeHost(deny={("send", "secret")}))
    h = Handler()
    client.open_link(h, name="bridge-x", sender=True, address="secret")
    pump_pair(client, server)
    assert h.attached == [] and len(h.detached) == 1
    assert h.detached[0].name == "amqp:unauthorized-access"
    assert not client.owned


def test_client_mode_refuses_links_the_peer_attaches():
    client, server, dh, sh, _ = client_pair()
    # the accepting side's proton connection attaches a link of its own towards the dialler
    ssn = server.connection.session()
    ssn.open()
    snd = ssn.sender("intruder")
    snd.target.address = "anything"
    snd.open()
    pump_pair(client, server)
    assert snd.remote_condition is not None and snd.remote_condition.name == "amqp:not-allowed"


def test_client_mode_peer_close_condition_becomes_the_error():
    client, server, dh, sh, _ = client_pair()
    server.abort("amqp:connection:forced", "going down")
    pump_pair(client, server)
    client.close_input()
    client.take_output()
    assert client.closed and client.error.name == "amqp:connection:forced"
    assert dh.closed == [client]


# -- internal services: links a broker service owns on accepted connections ---------------------

class Service:
    """A LinkService for ``$lodestone.test.``: ``in`` (clients send to it), ``out`` (they read)."""

    def __init__(self, settle: str = "accepted"):
        self.handlers: list[Handler] = []
        self.settle = settle

    def attach(self, engine, link):
        if link.address == "$lodestone.test.closed":
            return ("amqp:unauthorized-access", "not for you")
        if link.address not in ("$lodestone.test.in", "$lodestone.test.out"):
            return None
        h = Handler(self.settle)
        self.handlers.append(h)
        if link.is_receiver:
            link.credit_window = 4
            link.flow(4)
        return h


def _internal_wire(settle: str = "accepted"):
    host = FakeHost()
    service = Service(settle)
    host.services.register("$lodestone.test.", service)
    return Wire(host), service


@pytest.mark.parametrize("settle, state", [("accepted", Delivery.ACCEPTED), ("released", Delivery.RELEASED),
                                           ("rejected", Delivery.REJECTED)])
def test_a_service_link_gets_each_message_as_bytes_and_settles_it(settle, state):
    w, service = _internal_wire(settle)
    s = w.sender("$lodestone.test.in")
    assert s.remote_target.address == "$lodestone.test.in" and s.credit == 4
    sent = [w.send(s, f"m{i}") for i in range(10)]       # more than the window: topped up as they arrive
    h = service.handlers[0]
    assert len(h.messages) == 10 and b"m9" in h.messages[9]
    assert all(d.remote_state == state for d in sent)
    assert w.host.counts["links_opened"] == 1


def test_a_service_sending_link_sends_on_credit_pre_settled():
    w, service = _internal_wire()
    r = w.session.receiver("r")
    r.source.address = "$lodestone.test.out"
    r.open()
    w.pump()
    h = service.handlers[0]
    assert h.attached and h.flows == 0
    r.flow(2)
    w.pump()
    assert h.flows == 1
    link = h.attached[0]
    for i in range(2):
        link.send(Message(body=f"n{i}").encode())
    link.wake()
    w.pump()
    got = []
    while r.current is not None and r.current.readable and not r.current.partial:
        d = r.current
        m = Message()
        m.decode(r.recv(d.pending))
        got.append(m.body)
        assert d.settled      # pre-settled by the sender
        r.advance()
    assert got == ["n0", "n1"] and h.deliveries == []


@pytest.mark.parametrize("address, condition", [("$lodestone.test.closed", "amqp:unauthorized-access"),
                                                ("$lodestone.test.nothing", "amqp:not-found"),
                                                ("$lodestone.other", "amqp:not-found")])
def test_an_internal_address_no_service_takes_is_refused(address, condition):
    w, service = _internal_wire()
    s = w.sender(address)
    assert s.remote_condition is not None and s.remote_condition.name == condition
    assert service.handlers == []


def test_a_service_link_is_told_when_the_connection_ends():
    w, service = _internal_wire()
    w.sender("$lodestone.test.in")
    w.engine.finish()
    assert service.handlers[0].detached == [None]
