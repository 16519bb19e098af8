"""Redirect following for event-driven proton applications (``Container`` + ``MessagingHandler``).

One line in an ordinary application: connect with :func:`connect` instead of
``container.connect`` (or run the application on :class:`RedirectingContainer`, whose
``connect`` does it)::

    class Send(MessagingHandler):
        def on_start(self, event):
            conn = connect(event.container, "amqp://router.example:5672", user="app", password="app")
            event.container.create_sender(conn, "orders")        # links as usual
        def on_sendable(self, event): ...

Theory of operation. The connection gets a per-connection handler, a :class:`RedirectFollower`,
which passes every event to the application's handler (the container's) except while the
connection is *between brokers*: from the router's failed-establishment Open (``properties``
``amqp:connection-establishment-failed = true``) until a real Open arrives. In that window the
application sees nothing — no ``on_connection_opened`` for the router's Open, no error for its
``amqp:connection:redirect`` Close, no ``on_disconnected``. The follower decides with the pure
:class:`~router.client.hops.HopPlan`, points proton's own reconnect machinery (the connection's
``_Connector``) at the next URL and closes the router's transport; proton then binds a fresh
transport to the *same* ``Connection`` object and re-sends the Open, the Begins and the
Attaches of every session and link the application opened, with their options (source,
target, filters, settle modes) — so the application's ``Sender``/``Receiver`` objects stay
valid and get ``on_sendable``/``on_message`` from the broker. If the journey fails (a loop,
too many hops, a router that stays not ready or rejects the client) the application's
``on_connection_error(event)`` is called once with ``event.connection.lodestone_error`` set to
the :mod:`router.client.errors` exception that says why, and the connection is closed.

A later disconnection from the broker reconnects through the front door (the router decides
again), following redirects the same way. A broker that closes the established connection with
``amqp:connection:redirect`` (a router's drain, a failback, a scale-down: we announced that we
follow) is followed the same way, as a new journey. This module relies on proton's ``_Connector``
(``Connection._overrides``: ``address``, ``_connect_sequence``), stable from 0.33 to 0.40.
"""

from __future__ import annotations

import itertools
import logging

from proton import Url
from proton.handlers import MessagingHandler
from proton.reactor import Container
from proton._reactor import Urls  # the connector's address list (no public name)

from router.client.blocking import with_capability
from router.client.hops import (DEFAULT_REFUSAL_BACKOFF_S, REDIRECT, Follow, GiveUp, HopPlan, Retry,
                                is_failed_open)

log = logging.getLogger("router.client")


def _delays():
    """Proton's default reconnect delays (0, 0.1, 0.2, … up to 10 s), forever."""
    delay = 0.0
    while True:
        yield delay
        delay = 0.1 if delay == 0 else min(10.0, delay * 2)


class RedirectFollower:
    """Per-connection proton handler: follows redirects and hides the router's failed
    connection from ``app`` (the application's handler, e.g. the container's)."""

    def __init__(self, app, plan: HopPlan):
        self.app = app
        self.plan = plan
        self.direct = None  # (lookup, key) while trying the broker the management API named
        self.lookup = None  # (lookup, key): asked again when the router is not ready
        self.between = False  # inside the router's failed connection / on the way to the next hop
        self.connection = None
        self.reconnect = None  # the application's reconnect policy (None: proton's default)
        self.router_transport_open = False  # a router's transport we ended has not closed yet

    # proton calls on_<event>(event); everything goes through here
    def on_unhandled(self, method: str, event) -> None:
        if method == "on_connection_remote_open":
            if is_failed_open(event.connection.remote_properties):
                self.between = True
                return
            event.connection.lodestone_hops = list(self.plan.hops)
            self.between = False
            self.direct = None
            self.plan.established()
            self._back_to_front_door(event.connection)
            if self.reconnect is False:
                event.connection._overrides.reconnect = False  # as the application asked, from now on
        elif method == "on_connection_remote_close" and self.between:
            cond = event.connection.remote_condition
            decision = self.plan.on_close(cond.name if cond else None, cond.description if cond else None,
                                          cond.info if cond else None)
            if isinstance(decision, Retry) and self.lookup is not None:
                decision = self._ask_management(decision)
            if isinstance(decision, (Follow, Retry)):
                self._go(event, decision)
                return
            self.between = False
            if isinstance(decision, GiveUp):
                self._give_up(event, decision.error)
                return
            # not a router answer we know: the application sees the peer's error as it is
        elif method == "on_connection_remote_close" and self.connection_redirected(event):
            return      # a broker handed the client over (drain, failback, scale-down): on its way
        elif method.startswith("on_transport_") and (self.between or self.direct is not None):
            if method != "on_transport_closed":
                return
            if self.router_transport_open:
                self.router_transport_open = False  # the router's transport, which we ended
                return
            if self.direct is not None:
                # the broker the management API named is unreachable: forget it, use the front door
                lookup, key = self.direct
                self.direct = None
                lookup.invalidate(key)
                log.info("direct connection failed; falling back to the front door %s", self.plan.front_door)
                self.plan.restart()
                self.between = True
                self._go(event, Retry(self.plan.front_door, 0), close=False)
                return
            if self.reconnect is not False:
                return  # proton tries again (the front door), as the application's policy says
            self.between = False  # a hop failed and the application wants no reconnect: say so
        elif self.between:
            return
        event.dispatch(self.app)

    def connection_redirected(self, event) -> bool:
        """An established connection closed by its broker with ``amqp:connection:redirect``
        (we announced ``lodestone:follows-redirect``, so a broker that moves its clients — a
        router's drain, a failback, a scale-down — redirects this one): follow it as a new
        journey, the application's links re-attached there. False when the Close is anything
        else (the application sees it as it is)."""
        cond = event.connection.remote_condition
        if cond is None or cond.name != REDIRECT:
            return False
        self.plan.restart()
        decision = self.plan.on_close(cond.name, cond.description, cond.info)
        if not isinstance(decision, Follow):
            return False
        self.between = True
        self._go(event, decision)
        return True

    def _go(self, event, decision, close: bool = True) -> None:
        conn = event.connection
        connector = conn._overrides
        url = Url(decision.url)
        delay = decision.delay_s if isinstance(decision, Retry) else 0
        if isinstance(decision, Follow):
            log.info("following redirect to %s (hops: %s)", decision.url, " -> ".join(self.plan.hops))
            if decision.virtual_host:
                connector.virtual_host = decision.virtual_host
                conn.hostname = decision.virtual_host
        else:
            log.info("trying the front door %s again in %.2fs", decision.url, delay)
            connector.virtual_host = self.plan.virtual_host
        # the next connect of proton's reconnect loop goes there; if that fails, the front door
        # as the application's reconnect policy says, each time a new journey
        connector._connect_sequence = itertools.chain([(delay, url)], self._afterwards())
        # the router waits for our Close to end its side; we keep the Connection open (it is
        # re-bound to the next transport), so end the router's transport from our side instead
        if close and event.transport is not None:
            self.router_transport_open = True
            event.transport.close_tail()
            event.transport.close_head()

    def _ask_management(self, retry: Retry) -> Retry:
        """The router is not ready: Artemis' other way in — ask the management API (afresh)
        where the key goes, and go there directly after the same back-off."""
        lookup, key = self.lookup
        lookup.invalidate(key)
        direct = lookup.url_for(key, self.plan.front_door)
        if direct is None:
            return retry
        log.info("router not ready; the management API names %s", direct)
        self.direct = (lookup, key)
        self.plan.hops = [direct]
        return Retry(direct, retry.delay_s)

    def _afterwards(self):
        policy = self.reconnect
        delays = _delays() if policy is None else iter([] if policy is False else policy)
        for d in delays:
            self.plan.restart()
            yield d, Url(self.plan.front_door)

    def _give_up(self, event, error: Exception) -> None:
        conn = event.connection
        conn.lodestone_error = error
        conn.lodestone_hops = list(error.hops) if hasattr(error, "hops") else list(self.plan.hops)
        log.warning("giving up: %s", error)
        for h in _application_handlers(self.app):
            _call(h, "on_connection_error", event)
        conn.close()

    def _back_to_front_door(self, conn) -> None:
        connector = getattr(conn, "_overrides", None)
        if connector is not None:
            connector.address = Urls([self.plan.front_door])
        self.plan.restart()


def _application_handlers(app):
    """The handlers an application wrote (MessagingHandler-like), found under ``app``."""
    if isinstance(app, MessagingHandler) or not hasattr(app, "handlers"):
        return [app]
    out = []
    for h in app.handlers:
        out += _application_handlers(h)
    return out


def _call(handler, method: str, event) -> None:
    m = getattr(handler, method, None)
    if m is not None:
        m(event)
    elif hasattr(handler, "on_unhandled"):
        handler.on_unhandled(method, event)


def connect(container: Container, url: str, *, handler=None, max_hops: int = 5,
            refusal_backoff_s: tuple[float, ...] = DEFAULT_REFUSAL_BACKOFF_S, lookup=None, key: str | None = None,
            announce: bool = True, **kwargs):
    """``container.connect(url, **kwargs)`` that follows ``amqp:connection:redirect``.

    ``handler``: the application's handler for this connection (default: the container's,
    i.e. the handlers given to ``Container(...)``). ``max_hops`` bounds the redirects of one
    journey; a hop back to an address already visited is a loop. A router that is "not ready"
    is tried again after each delay of ``refusal_backoff_s``. Every other keyword goes to
    ``container.connect`` (``user``, ``password``, ``container_id`` — the CLIENT_ID key —,
    ``ssl_domain``, ``sni``, ``reconnect``, …); ``lodestone:follows-redirect`` is added to the
    Open's desired capabilities.

    ``lookup`` (a :class:`router.client.lookup.TargetLookup`) with ``key`` (default: the
    ``container_id``): ask the router's management API first and connect straight to the broker
    it names; when the API is down or refuses, use the front door ``url``.

    ``announce=False``: follow redirects without saying so in the Open, as clients that follow
    them natively do (Qpid JMS): a broker that moves its clients (a router's drain, a failback)
    then ends this connection instead of redirecting it, and it comes back through ``url``.

    Returns the ``Connection`` (``lodestone_hops`` lists the URLs of the last journey once it
    is open; ``lodestone_error`` is set if the helper gave up).
    """
    first, k = url, None
    if lookup is not None:
        k = key if key is not None else kwargs.get("container_id", getattr(container, "container_id", None))
        direct = lookup.url_for(k, url) if k is not None else None
        if direct is not None:
            first = direct
    plan = HopPlan(url, max_hops=max_hops, refusal_backoff_s=tuple(refusal_backoff_s),
                   virtual_host=kwargs.get("virtual_host"))
    follower = RedirectFollower(handler if handler is not None else container.handler, plan)
    if first != url:
        plan.hops = [first]
        follower.direct = (lookup, k)
    if lookup is not None and k is not None:
        follower.lookup = (lookup, k)
    follower.reconnect = kwargs.get("reconnect")
    if follower.reconnect is False:
        # proton's connector ignores its connect sequence when reconnect is False, so until the
        # broker's Open the connection runs with one try per hop; False again once open
        kwargs["reconnect"] = [0]
    conn = Container.connect(container, first, handler=follower, **(with_capability(kwargs) if announce else kwargs))
    follower.connection = conn
    return conn


class RedirectingContainer(Container):
    """A proton ``Container`` whose ``connect`` follows redirects (:func:`connect`); the
    one-line change for an application: ``RedirectingContainer(MyApp()).run()``."""

    def connect(self, url=None, urls=None, address=None, handler=None, reconnect=None, heartbeat=None,
                ssl_domain=None, **kwargs):
        if url is None or urls is not None or address is not None:
            return super().connect(url=url, urls=urls, address=address, handler=handler, reconnect=reconnect,
                                   heartbeat=heartbeat, ssl_domain=ssl_domain, **kwargs)
        extra = {k: v for k, v in (("reconnect", reconnect), ("heartbeat", heartbeat), ("ssl_domain", ssl_domain))
                 if v is not None}
        return connect(self, str(url), handler=handler, **extra, **kwargs)
