"""Redirect following for proton's ``BlockingConnection``.

    conn = connect_following_redirects("amqps://alice:secret@router.example:5671",
                                       ssl_domain=domain, max_hops=5)
    sender = conn.create_sender("orders")

It reconnects to ``network-host:port`` with the same scheme, credentials and keyword arguments,
at most ``max_hops`` times, refusing to visit the same (host, port, hostname) twice. A router
that is not ready (``amqp:connection:forced`` "… is not ready") is tried again after each
back-off in ``refusal_backoff_s``, then :class:`RouterRefusedClosed` is raised (a proton
``ConnectionClosed`` with condition ``amqp:connection:forced``). Any other close is raised as
proton's ``ConnectionClosed`` unchanged. The Open announces ``lodestone:follows-redirect`` in
its desired capabilities.
"""

from __future__ import annotations

import time

from proton import Endpoint, symbol
from proton.utils import BlockingConnection, ConnectionClosed

from broker.wire.frames import FOLLOWS_REDIRECT
from router.client.errors import RedirectError, RouterRefused
from router.client.hops import DEFAULT_REFUSAL_BACKOFF_S, ESTABLISHMENT_FAILED, REDIRECT, Follow, GiveUp, \
    HopPlan, Retry, is_failed_open


class RouterRefusedClosed(ConnectionClosed, RouterRefused):
    """The router's ``amqp:connection:forced`` after the bounded retries: both proton's
    ``ConnectionClosed`` (``condition``, ``connection``) and :class:`RouterRefused`
    (``attempts``, ``hops``, ``transient``)."""

    def __init__(self, closed: ConnectionClosed, refused: RouterRefused):
        Exception.__init__(self, f"{closed} — {refused}")
        self.connection = closed.connection
        self.condition = closed.condition
        self.description, self.attempts, self.hops, self.transient = \
            refused.description, refused.attempts, refused.hops, refused.transient


class _RecordingConnection(BlockingConnection):
    """BlockingConnection that keeps a copy of the peer's close condition (the base class raises
    ``ConnectionClosed`` and then frees the connection, so the info map would be gone)."""

    remote_close_condition = None
    failed_open = False

    def on_connection_remote_open(self, event) -> None:
        self.failed_open = is_failed_open(event.connection.remote_properties)
        base = getattr(super(), "on_connection_remote_open", None)
        if base is not None:
            base(event)

    def on_connection_remote_close(self, event) -> None:
        self.remote_close_condition = event.connection.remote_condition
        super().on_connection_remote_close(event)


def with_capability(kwargs: dict) -> dict:
    """``kwargs`` for ``Container.connect`` with ``lodestone:follows-redirect`` added to the
    Open's desired capabilities (after the caller's own)."""
    caps = [symbol(str(c)) for c in (kwargs.get("desired_capabilities") or [])]
    if FOLLOWS_REDIRECT not in caps:
        caps.append(symbol(FOLLOWS_REDIRECT))
    return {**kwargs, "desired_capabilities": caps}


def _attempt(url: str, kwargs: dict):
    """Connect once. Returns (connection, None) when open, (None, (condition, exc)) when the
    router answered with a failed-establishment Open + Close (or any redirect); raises for any
    other failure."""
    # Allocate first, initialise second: if the Close arrives inside the constructor, the object
    # (and the condition it recorded) is still ours.
    conn = _RecordingConnection.__new__(_RecordingConnection)
    try:
        conn.__init__(url, **kwargs)
        if is_failed_open(conn.conn.remote_properties):
            # The failed-establishment Open arrived without its Close in the same read: wait for it.
            conn.wait(lambda: conn.conn.state & Endpoint.REMOTE_CLOSED, msg="waiting for the router's Close")
            raise ConnectionClosed(conn.conn)
        return conn, None
    except ConnectionClosed as exc:
        cond = conn.remote_close_condition
        if cond is not None and (cond.name == REDIRECT or conn.failed_open):
            if conn.conn is not None:
                conn.close()
            return None, (cond, exc)
        raise


def _open_once(url: str, kwargs: dict):
    """Connect once. Returns (connection, None) when open, (None, condition) when the peer
    answered with a redirect, raises for any other failure (tests use it to see one hop)."""
    conn, failed = _attempt(url, kwargs)
    if conn is not None:
        return conn, None
    cond, exc = failed
    if cond.name == REDIRECT:
        return None, cond
    raise exc


def connect_following_redirects(url: str, *, max_hops: int = 5,
                                refusal_backoff_s: tuple[float, ...] = DEFAULT_REFUSAL_BACKOFF_S,
                                **kwargs) -> BlockingConnection:
    """Open a proton ``BlockingConnection`` to ``url``, following AMQP redirects.

    ``kwargs`` go to ``BlockingConnection`` (``ssl_domain``, ``timeout``, ``user``, ``password``,
    ``allowed_mechs``, ``container_id`` (the CLIENT_ID key), ``container`` (a proton
    ``Container``: its ``container_id`` is used; each attempt runs on a container of its own,
    since ``BlockingConnection`` releases its container when an attempt fails), ``sni``, …).
    On a redirect with a ``hostname`` the next hop uses it as ``virtual_host`` (the Open
    hostname and the TLS SNI). The returned connection has
    ``lodestone_hops``: the URLs visited, in order.

    Raises :class:`TooManyRedirects`, :class:`RedirectLoop`, :class:`RedirectError` (a redirect
    without a usable address), :class:`RouterRefusedClosed` (the router refused: "rejected"
    at once, "not ready" after ``len(refusal_backoff_s)`` retries), or proton's
    ``ConnectionClosed`` / ``ConnectionException`` / ``Timeout`` for every other failure.
    """
    plan = HopPlan(url, max_hops=max_hops, refusal_backoff_s=tuple(refusal_backoff_s),
                   virtual_host=kwargs.get("virtual_host"))
    given = kwargs.pop("container", None)
    if given is not None and "container_id" not in kwargs:
        # BlockingConnection releases its container when an attempt fails, so a container
        # cannot outlive a redirected attempt: each attempt runs on its own, with this id
        kwargs["container_id"] = given.container_id
    kwargs = with_capability(kwargs)
    current = url
    while True:
        conn, failed = _attempt(current, kwargs)
        if conn is not None:
            plan.established()
            conn.lodestone_hops = list(plan.hops)
            return conn
        cond, exc = failed
        decision = plan.on_close(cond.name, cond.description, cond.info)
        if decision is None:
            raise exc
        if isinstance(decision, GiveUp):
            if isinstance(decision.error, RouterRefused):
                raise RouterRefusedClosed(exc, decision.error) from None
            raise decision.error from None
        if isinstance(decision, Retry):
            time.sleep(decision.delay_s)
            kwargs = {k: v for k, v in kwargs.items() if k != "virtual_host"}
            if plan.virtual_host:
                kwargs["virtual_host"] = plan.virtual_host
        elif isinstance(decision, Follow):
            if decision.virtual_host:
                kwargs = {**kwargs, "virtual_host": decision.virtual_host}
        current = decision.url


__all__ = ["connect_following_redirects", "RouterRefusedClosed", "with_capability", "RedirectError",
           "ESTABLISHMENT_FAILED"]
