"""Unmodified python-qpid-proton 0.40 applications through a real router in ``redirect`` mode
(and, at the end, through its ``auto`` acceptor: redirected with the helpers, proxied without).

Event-driven (``Container`` + ``MessagingHandler``) with ``router.client.connect`` (one line),
``BlockingConnection`` with ``connect_following_redirects``, and the management-API lookup
helper. Where a message lands is counted by a consumer connected straight to the broker the
router's management API names for the client's key (CLIENT_ID, CONSISTENT_HASH over 3 brokers).
"""

from __future__ import annotations

import time
import uuid

import pytest
from proton import Message, symbol
from proton.handlers import MessagingHandler
from proton.reactor import Container
from proton.utils import BlockingConnection

from broker.wire.frames import FOLLOWS_REDIRECT
from router.client.lookup import Answer
from router.client import (RedirectLoop, RedirectingContainer, RouterRefused, RouterRefusedClosed, TargetLookup,
                           TooManyRedirects, connect, connect_following_redirects, connect_via_management)
from clients_env import MGMT, USERS, free_port

pytestmark = pytest.mark.slow

APP = {"user": "app", "password": USERS["app"][0], "allowed_mechs": "PLAIN"}


@pytest.fixture(scope="module")
def env(clients_env):
    return clients_env


def drain(broker, address: str, timeout_s: float = 3.0) -> list[str]:
    """Every message waiting on ``address`` at ``broker``, read by a direct consumer."""
    conn = BlockingConnection(broker.amqp_url, timeout=10, user="admin", password=USERS["admin"][0],
                              allowed_mechs="PLAIN")
    try:
        rcv = conn.create_receiver(address, credit=100)
        got = []
        while True:
            try:
                m = rcv.receive(timeout=timeout_s)
            except Exception:  # proton's Timeout: nothing more
                break
            got.append(m.body)
            rcv.accept()
            timeout_s = 1.0
        return got
    finally:
        conn.close()


def preload(broker, address: str, bodies: list[str]) -> None:
    conn = BlockingConnection(broker.amqp_url, timeout=10, user="admin", password=USERS["admin"][0],
                              allowed_mechs="PLAIN")
    try:
        snd = conn.create_sender(address)
        for b in bodies:
            snd.send(Message(body=b))
    finally:
        conn.close()


class App(MessagingHandler):
    """An ordinary proton application: one sender or one receiver, counts and records events.
    ``use_helper`` is the one line that differs: ``connect(...)`` vs ``container.connect(...)``."""

    def __init__(self, url: str, address: str, *, send: int = 0, receive: int = 0, use_helper: bool = True,
                 deadline_s: float = 20.0, **connect_kw):
        super().__init__()
        self.url, self.address, self.to_send, self.to_receive = url, address, send, receive
        self.use_helper, self.deadline_s, self.connect_kw = use_helper, deadline_s, connect_kw
        self.events: list[str] = []
        self.opened_nodes: list[str | None] = []
        self.errors: list[tuple[str | None, str | None, Exception | None]] = []
        self.sent = self.accepted = 0
        self.received: list[str] = []
        self.link = None
        self.link_seen = set()
        self.conn = None

    def on_start(self, event):
        kw = {**APP, **self.connect_kw}
        if self.use_helper:
            self.conn = connect(event.container, self.url, **kw)
        else:
            self.conn = event.container.connect(self.url, reconnect=False, **kw)
        if self.to_send:
            self.link = event.container.create_sender(self.conn, self.address)
        else:
            self.link = event.container.create_receiver(self.conn, self.address)
        self.timer = event.container.schedule(self.deadline_s, self)

    def on_timer_task(self, event):
        self.events.append("deadline")
        if self.conn is not None:
            self.conn.close()
        event.container.stop()

    def on_connection_opened(self, event):
        self.events.append("opened")
        self.opened_nodes.append((event.connection.remote_properties or {}).get("node-id"))

    def on_connection_error(self, event):
        cond = event.connection.remote_condition
        self.events.append("error")
        self.errors.append((cond.name if cond else None, cond.description if cond else None,
                            getattr(event.connection, "lodestone_error", None)))
        event.connection.close()
        self.timer.cancel()

    def on_sendable(self, event):
        self.link_seen.add(event.sender)
        while event.sender.credit and self.sent < self.to_send:
            event.sender.send(Message(body=f"m{self.sent}"))
            self.sent += 1

    def on_accepted(self, event):
        self.accepted += 1
        if self.accepted == self.to_send:
            event.connection.close()
            self.timer.cancel()

    def on_message(self, event):
        self.link_seen.add(event.receiver)
        self.received.append(event.message.body)
        if len(self.received) == self.to_receive:
            event.connection.close()
            self.timer.cancel()

    def on_disconnected(self, event):
        self.events.append("disconnected")


def run(app: App, container_cls=Container, **container_kw) -> App:
    t0 = time.monotonic()
    container_cls(app, **container_kw).run()
    app.took_s = time.monotonic() - t0
    return app


def key() -> str:
    return f"client-{uuid.uuid4().hex[:8]}"


# -- event-driven --------------------------------------------------------------------------------

def test_event_driven_sender_follows_the_redirect_to_the_broker_management_names(env):
    k, address = key(), f"ev.send.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    before = env.redirected()
    app = run(App(env.front_door(), address, send=10, container_id=k))
    assert app.errors == [] and app.accepted == 10
    # the application saw exactly one "opened": the broker's (never the router's failed Open)
    assert app.events.count("opened") == 1 and app.opened_nodes == [target.node_id]
    # the hop was really followed: front door, then the broker management names
    assert app.conn.lodestone_hops == [env.front_door(), f"amqp://127.0.0.1:{target.port}"]
    assert env.redirected() == before + 1
    assert app.link_seen == {app.link}  # the application's own Sender object, re-attached
    assert sorted(drain(target, address)) == sorted(f"m{i}" for i in range(10))


def test_event_driven_receiver_is_recreated_with_its_options_on_the_broker(env):
    k, address = key(), f"ev.recv.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    preload(target, address, [f"r{i}" for i in range(7)])
    app = run(App(env.front_door(), address, receive=7, container_id=k))
    assert app.errors == [] and sorted(app.received) == sorted(f"r{i}" for i in range(7))
    assert app.opened_nodes == [target.node_id] and app.link_seen == {app.link}
    assert app.link.source.address == address  # the receiver's own options, on the new connection


def test_redirecting_container_is_the_one_line_change(env):
    """``RedirectingContainer(app)`` instead of ``Container(app)``: the app's own
    ``event.container.connect(...)`` follows the redirect; the container id is the key."""
    k, address = key(), f"ev.rc.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)

    class Plain(App):
        def on_start(self, event):
            self.conn = event.container.connect(self.url, **APP)  # unmodified application code
            self.link = event.container.create_sender(self.conn, self.address)
            self.timer = event.container.schedule(self.deadline_s, self)

    app = run(Plain(env.front_door(), address, send=5), RedirectingContainer, container_id=k)
    assert app.errors == [] and app.accepted == 5 and app.opened_nodes == [target.node_id]
    assert len(drain(target, address)) == 5


def test_event_driven_open_announces_follows_redirect(env):
    """The broker sees ``lodestone:follows-redirect`` among the Open's desired capabilities."""
    seen = []

    class Peek(App):
        def on_connection_opened(self, event):
            super().on_connection_opened(event)
            seen.append(list(event.connection.desired_capabilities or []))
            event.connection.close()
            self.timer.cancel()

    run(Peek(env.front_door(), "ev.caps", send=1, container_id=key()))
    assert seen and symbol(FOLLOWS_REDIRECT) in seen[0]


def test_event_driven_redirect_loop_is_a_clear_error(env):
    app = run(App(env.front_door("ping"), "ev.loop", send=1, container_id=key()))
    assert app.events.count("opened") == 0 and app.sent == 0
    assert len(app.errors) == 1
    name, _, err = app.errors[0]
    assert name == "amqp:connection:redirect" and isinstance(err, RedirectLoop)
    ping, pong = env.loop_ports
    assert err.hops == [f"amqp://127.0.0.1:{ping}", f"amqp://127.0.0.1:{pong}", f"amqp://127.0.0.1:{ping}"]
    assert "redirect loop" in str(err)


def test_event_driven_too_many_hops_is_a_clear_error(env):
    app = run(App(env.front_door("ping"), "ev.hops", send=1, container_id=key(), max_hops=1))
    assert app.events.count("opened") == 0 and len(app.errors) == 1
    assert isinstance(app.errors[0][2], TooManyRedirects) and "more than 1 redirects" in str(app.errors[0][2])


def test_event_driven_not_ready_router_is_retried_then_reported(env):
    before = env.router.counters("q-redir")["refused"]
    app = run(App(env.front_door("q-redir"), "ev.q", send=1, container_id=key(), refusal_backoff_s=(0.1, 0.2)))
    assert app.events.count("opened") == 0 and app.sent == 0 and len(app.errors) == 1
    name, description, err = app.errors[0]
    assert name == "amqp:connection:forced" and "is not ready" in description
    assert isinstance(err, RouterRefused) and err.transient and err.attempts == 3
    assert "gave up after 3 attempts" in str(err)
    assert env.router.counters("q-redir")["refused"] == before + 3  # 1 + 2 bounded retries
    assert app.took_s >= 0.3


def test_plain_proton_without_the_helper_does_not_get_through(env):
    """Documents the problem: an unmodified application sees the router's failed connection as
    *opened*, then an error, and its message never reaches any broker."""
    address = f"ev.plain.{uuid.uuid4().hex[:6]}"
    app = run(App(env.front_door(), address, send=1, use_helper=False, container_id=key()))
    assert app.accepted == 0 and app.sent == 0
    assert app.opened_nodes == [None]  # "opened" — for the router's failed-establishment Open
    assert [e[0] for e in app.errors] == ["amqp:connection:redirect"]
    for b in env.brokers:
        assert drain(b, address, timeout_s=0.5) == []


# -- blocking ------------------------------------------------------------------------------------

def test_blocking_connection_follows_the_redirect_and_delivers(env):
    k, address = key(), f"bl.send.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    before = env.redirected()
    conn = connect_following_redirects(env.front_door(), timeout=10, container_id=k, **APP)
    try:
        assert conn.conn.remote_properties["node-id"] == target.node_id
        assert conn.lodestone_hops == [env.front_door(), f"amqp://127.0.0.1:{target.port}"]
        assert symbol(FOLLOWS_REDIRECT) in conn.conn.desired_capabilities
        snd = conn.create_sender(address)
        for i in range(6):
            snd.send(Message(body=f"b{i}"))
    finally:
        conn.close()
    assert env.redirected() == before + 1
    assert sorted(drain(target, address)) == sorted(f"b{i}" for i in range(6))


def test_blocking_on_a_given_container_or_container_id(env):
    k = key()
    target = env.broker_for(k)
    conn = connect_following_redirects(env.front_door(), timeout=10, container=Container(container_id=k), **APP)
    try:
        assert conn.conn.remote_properties["node-id"] == target.node_id
    finally:
        conn.close()


def test_blocking_loop_and_hops_and_not_ready_are_clear_errors(env):
    with pytest.raises(RedirectLoop) as loop:
        connect_following_redirects(env.front_door("ping"), timeout=10, container_id=key(), **APP)
    assert len(loop.value.hops) == 3 and loop.value.hops[0] == loop.value.hops[2]
    with pytest.raises(TooManyRedirects):
        connect_following_redirects(env.front_door("ping"), timeout=10, container_id=key(), max_hops=1, **APP)
    before = env.router.counters("q-redir")["refused"]
    with pytest.raises(RouterRefusedClosed) as refused:
        connect_following_redirects(env.front_door("q-redir"), timeout=10, container_id=key(),
                                    refusal_backoff_s=(0.05, 0.05), **APP)
    assert refused.value.condition == "amqp:connection:forced" and refused.value.attempts == 3
    assert "is not ready" in str(refused.value) and "gave up after 3 attempts" in str(refused.value)
    assert env.router.counters("q-redir")["refused"] == before + 3


# -- management-API lookups ------------------------------------------------------------------------

def test_management_lookup_connects_directly_and_caches(env):
    k, address = key(), f"mg.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    lookup = TargetLookup(env.router.management_url, "main", auth=MGMT, ttl_s=60)
    before = env.router.counters("redir")["accepted"]
    for i in range(2):
        conn = connect_via_management(lookup, env.front_door(), key=k, timeout=10, container_id=k, **APP)
        try:
            assert conn.lodestone_route == "direct"
            assert conn.lodestone_hops == [f"amqp://127.0.0.1:{target.port}"]
            conn.create_sender(address).send(Message(body=f"d{i}"))
        finally:
            conn.close()
    assert lookup.requests == 1  # the second connection used the cached answer
    assert env.router.counters("redir")["accepted"] == before  # never touched the front door
    assert sorted(drain(target, address)) == ["d0", "d1"]


def test_management_lookup_ttl_expires(env):
    now = [0.0]
    lookup = TargetLookup(env.router.management_url, "main", auth=MGMT, ttl_s=5, clock=lambda: now[0])
    k = key()
    lookup.answer(k)
    lookup.answer(k)
    assert lookup.requests == 1
    now[0] = 5.0
    lookup.answer(k)
    assert lookup.requests == 2


def test_management_lookup_does_not_keep_a_refusal(env):
    # the "quorum" router is never ready: its answer must be asked again, not served from the
    # cache for ttl_s (a router that becomes ready would otherwise be ignored that long)
    lookup = TargetLookup(env.router.management_url, "quorum", auth=MGMT, ttl_s=60)
    k = key()
    assert lookup.answer(k).outcome != "OK"
    assert lookup.answer(k).outcome != "OK"
    assert lookup.requests == 2


def test_management_lookup_falls_back_to_the_front_door_when_the_api_refuses(env):
    k = key()
    target = env.broker_for(k)
    lookup = TargetLookup(env.router.management_url, "main", auth=("ops", "wrong"))
    conn = connect_via_management(lookup, env.front_door(), key=k, timeout=10, container_id=k, **APP)
    try:
        assert conn.lodestone_route == "front-door" and lookup.last_error == "HTTP 401"
        assert conn.conn.remote_properties["node-id"] == target.node_id and len(conn.lodestone_hops) == 2
    finally:
        conn.close()


def test_management_lookup_falls_back_to_the_front_door_when_the_api_is_stopped(env):
    """Two router processes with the same ``main`` router: the lookup asks the second one's
    management API, which is then stopped; the client goes through the first one's front door."""
    other = env.start_second_router("router-api")
    try:
        lookup = TargetLookup(other.management_url, "main", auth=MGMT, ttl_s=0.001, timeout_s=1)
        k = key()
        target = env.broker_for(k)
        conn = connect_via_management(lookup, env.front_door(), key=k, timeout=10, container_id=k, **APP)
        assert conn.lodestone_route == "direct" and conn.conn.remote_properties["node-id"] == target.node_id
        conn.close()
    finally:
        assert other.terminate() == 0
    time.sleep(0.01)   # the thing under test: the lookup's 1 ms cached answer expires, it asks the stopped API
    address = f"mg.down.{uuid.uuid4().hex[:6]}"
    before = env.redirected()
    conn = connect_via_management(lookup, env.front_door(), key=k, timeout=10, container_id=k, **APP)
    try:
        assert conn.lodestone_route == "front-door" and lookup.last_error is not None
        assert conn.conn.remote_properties["node-id"] == target.node_id
        conn.create_sender(address).send(Message(body="via-front-door"))
    finally:
        conn.close()
    assert env.redirected() == before + 1
    assert drain(target, address) == ["via-front-door"]
    # the event-driven helper takes the same lookup and falls back the same way
    app = run(App(env.front_door(), address, send=3, container_id=k, lookup=lookup))
    assert app.errors == [] and app.accepted == 3 and app.opened_nodes == [target.node_id]
    assert len(app.conn.lodestone_hops) == 2


def test_event_driven_lookup_connects_directly(env):
    k, address = key(), f"mg.ev.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    lookup = TargetLookup(env.router.management_url, "main", auth=MGMT)
    before = env.router.counters("redir")["accepted"]
    app = run(App(env.front_door(), address, send=4, container_id=k, lookup=lookup))
    assert app.errors == [] and app.accepted == 4 and app.opened_nodes == [target.node_id]
    assert app.conn.lodestone_hops == [f"amqp://127.0.0.1:{target.port}"]
    assert env.router.counters("redir")["accepted"] == before
    assert len(drain(target, address)) == 4


def test_management_lookup_falls_back_when_the_named_broker_does_not_answer(env):
    """A cached answer names a broker that is gone (nothing listens on its port): the helpers
    forget the answer and go through the front door (redirect followed)."""
    k = key()
    target = env.broker_for(k)
    for event_driven in (False, True):
        lookup = TargetLookup(env.router.management_url, "main", auth=MGMT, ttl_s=60)
        lookup.cache.put(k, Answer("127.0.0.1", free_port(), False, "gone", "OK"), lookup.clock())
        before = env.redirected()
        if event_driven:
            app = run(App(env.front_door(), "mg.gone", send=1, container_id=k, lookup=lookup))
            assert app.errors == [] and app.accepted == 1 and app.opened_nodes == [target.node_id]
            assert app.events.count("opened") == 1 and app.conn.lodestone_hops[0] == env.front_door()
        else:
            conn = connect_via_management(lookup, env.front_door(), key=k, timeout=10, container_id=k, **APP)
            assert conn.lodestone_route == "front-door" and conn.conn.remote_properties["node-id"] == target.node_id
            conn.close()
        assert env.redirected() == before + 1
        assert lookup.requests == 0 and lookup.cache.get(k, lookup.clock()) is None
    drain(target, "mg.gone")


def test_event_driven_follows_redirects_even_with_reconnect_disabled(env):
    """``reconnect=False`` (the application wants no reconnects) still follows the redirect."""
    k, address = key(), f"ev.norc.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    app = run(App(env.front_door(), address, send=2, container_id=k, reconnect=False))
    assert app.errors == [] and app.accepted == 2 and app.opened_nodes == [target.node_id]
    assert app.conn._overrides.reconnect is False  # as asked, once on the broker
    assert len(drain(target, address)) == 2


def test_event_driven_asks_the_management_api_when_the_router_is_not_ready(env):
    """Artemis' advice for a router that is not ready: the front door again after a back-off, or
    the management API. With a lookup the helper asks the API afresh after the refusal (here the
    lookup's cached answer said "refused", so the first try went to the not-ready front door)."""
    k, address = key(), f"ev.qm.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    lookup = TargetLookup(env.router.management_url, "main", auth=MGMT, ttl_s=60)
    lookup.cache.put(k, Answer(None, None, False, None, "REFUSED_UNAVAILABLE"), lookup.clock())
    before = env.router.counters("q-redir")["refused"]
    app = run(App(env.front_door("q-redir"), address, send=3, container_id=k, lookup=lookup,
                  refusal_backoff_s=(0.05,)))
    assert app.errors == [] and app.accepted == 3 and app.opened_nodes == [target.node_id]
    assert app.events.count("opened") == 1 and lookup.requests == 1
    assert app.conn.lodestone_hops == [f"amqp://127.0.0.1:{target.port}"]
    assert env.router.counters("q-redir")["refused"] == before + 1
    assert len(drain(target, address)) == 3


def test_blocking_lookup_asks_again_when_the_front_door_stays_not_ready(env):
    k = key()
    target = env.broker_for(k)
    lookup = TargetLookup(env.router.management_url, "main", auth=MGMT, ttl_s=60)
    lookup.cache.put(k, Answer(None, None, False, None, "REFUSED_UNAVAILABLE"), lookup.clock())
    conn = connect_via_management(lookup, env.front_door("q-redir"), key=k, timeout=10, container_id=k,
                                  refusal_backoff_s=(0.05,), **APP)
    try:
        assert conn.lodestone_route == "direct" and conn.conn.remote_properties["node-id"] == target.node_id
        assert lookup.requests == 1
    finally:
        conn.close()


# -- through an ``auto`` acceptor --------------------------------------------------------------------
# One port for every client: the helpers announce ``lodestone:follows-redirect`` and are redirected
# (then connected straight to the broker); unmodified applications announce nothing and are
# proxied to the same broker. Which broker the connection ended on: the broker's own Open
# (``node-id``, passed through unchanged by the proxy) and the brokers' connection lists.

class Where(App):
    """Also records, when the connection opens, which brokers list its container id."""

    env = None

    def on_connection_opened(self, event):
        super().on_connection_opened(event)
        self.on_brokers = self.env.brokers_with(event.connection.container)


def where(env, *args, **kw) -> Where:
    app = Where(*args, **kw)
    app.env = env
    return app


def test_auto_event_driven_helper_is_redirected_to_the_broker_management_names(env):
    k, address = key(), f"au.ev.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    before = env.auto_counts()
    app = run(where(env, env.front_door("auto"), address, send=8, container_id=k))
    assert app.errors == [] and app.accepted == 8 and app.sent == 8
    assert app.events.count("opened") == 1 and app.opened_nodes == [target.node_id]
    assert app.on_brokers == [target.node_id]  # connected to the broker itself
    assert app.conn.lodestone_hops == [env.front_door("auto"), f"amqp://127.0.0.1:{target.port}"]
    assert app.link_seen == {app.link}
    env.assert_routed(k, before, "redirected", target)
    assert sorted(drain(target, address)) == sorted(f"m{i}" for i in range(8))


def test_auto_redirecting_container_is_redirected(env):
    k, address = key(), f"au.rc.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)

    class Plain(Where):
        def on_start(self, event):
            self.conn = event.container.connect(self.url, **APP)  # unmodified application code
            self.link = event.container.create_sender(self.conn, self.address)
            self.timer = event.container.schedule(self.deadline_s, self)

    before = env.auto_counts()
    app = Plain(env.front_door("auto"), address, send=4)
    app.env = env
    run(app, RedirectingContainer, container_id=k)
    assert app.errors == [] and app.accepted == 4 and app.opened_nodes == [target.node_id]
    assert app.on_brokers == [target.node_id] and len(app.conn.lodestone_hops) == 2
    env.assert_routed(k, before, "redirected", target)
    assert sorted(drain(target, address)) == sorted(f"m{i}" for i in range(4))


def test_auto_plain_proton_container_is_proxied_to_the_broker_management_names(env):
    """The same application without the helper (``container.connect``): proxied, it sees the
    broker's Open, no error, and every message arrives on the broker the API names."""
    k, address = key(), f"au.plain.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    before = env.auto_counts()
    app = run(where(env, env.front_door("auto"), address, send=8, use_helper=False, container_id=k))
    assert app.errors == [] and app.accepted == 8 and app.sent == 8
    assert app.events.count("opened") == 1 and app.opened_nodes == [target.node_id]
    assert app.on_brokers == [target.node_id]  # the proxied connection, as the broker lists it
    assert not hasattr(app.conn, "lodestone_hops")
    assert symbol(FOLLOWS_REDIRECT) not in list(app.conn.desired_capabilities or [])
    env.assert_routed(k, before, "proxied", target)
    assert sorted(drain(target, address)) == sorted(f"m{i}" for i in range(8))


def test_auto_plain_proton_receiver_is_proxied(env):
    k, address = key(), f"au.precv.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    preload(target, address, [f"r{i}" for i in range(5)])
    before = env.auto_counts()
    app = run(where(env, env.front_door("auto"), address, receive=5, use_helper=False, container_id=k))
    assert app.errors == [] and sorted(app.received) == sorted(f"r{i}" for i in range(5))
    assert app.opened_nodes == [target.node_id] and app.on_brokers == [target.node_id]
    env.assert_routed(k, before, "proxied", target)


def test_auto_blocking_helper_is_redirected(env):
    k, address = key(), f"au.bl.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    before = env.auto_counts()
    conn = connect_following_redirects(env.front_door("auto"), timeout=10, container_id=k, **APP)
    try:
        assert conn.conn.remote_properties["node-id"] == target.node_id
        assert conn.lodestone_hops == [env.front_door("auto"), f"amqp://127.0.0.1:{target.port}"]
        assert env.brokers_with(k) == [target.node_id]
        snd = conn.create_sender(address)
        for i in range(6):
            snd.send(Message(body=f"b{i}"))
    finally:
        conn.close()
    env.assert_routed(k, before, "redirected", target)
    assert sorted(drain(target, address)) == sorted(f"b{i}" for i in range(6))


def test_auto_plain_blocking_connection_is_proxied(env):
    """An unmodified ``BlockingConnection`` (its container's id is the key): proxied; sends and
    receives on the broker the API names, which lists the connection."""
    k, address = key(), f"au.pbl.{uuid.uuid4().hex[:6]}"
    target = env.broker_for(k)
    before = env.auto_counts()
    conn = BlockingConnection(env.front_door("auto"), timeout=10, container=Container(container_id=k), **APP)
    try:
        assert conn.conn.remote_properties["node-id"] == target.node_id
        assert env.brokers_with(k) == [target.node_id]
        snd = conn.create_sender(address)
        for i in range(6):
            snd.send(Message(body=f"p{i}"))
        rcv = conn.create_receiver(address, credit=10)
        got = []
        for _ in range(6):
            got.append(rcv.receive(timeout=10).body)
            rcv.accept()
        assert sorted(got) == sorted(f"p{i}" for i in range(6))
    finally:
        conn.close()
    env.assert_routed(k, before, "proxied", target)
    # counted on that broker (and no other): 6 enqueued, 6 acknowledged
    q = env.queue(target, address)
    assert q is not None and (q["enqueued"], q["acked"], q["depth"]) == (6, 6, 0), q
    assert [env.queue(b, address) for b in env.brokers if b is not target] == [None, None]
