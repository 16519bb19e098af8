"""A redirect-following AMQP 1.0 client helper on python-qpid-proton.

A Lodestone router in ``redirect`` mode (like an Artemis connection router) answers the client's
Open with an Open whose properties carry ``amqp:connection-establishment-failed = true``,
immediately followed by a Close with condition ``amqp:connection:redirect`` and info
``{network-host: <str>, port: <int>}`` (plus ``hostname`` when the router names a virtual host).
Proton does not follow such redirects by itself; :func:`connect_following_redirects` does:

    conn = connect_following_redirects("amqps://alice:secret@router.example:5671",
                                       ssl_domain=domain, max_hops=5)
    sender = conn.create_sender("orders")

It reconnects to ``network-host:port`` with the same scheme, credentials and keyword arguments,
at most ``max_hops`` times, refusing to visit the same (host, port, hostname) twice. Any other
close (for example ``amqp:connection:forced`` from a router that is not ready) is raised as
proton's ``ConnectionClosed`` unchanged, with its ``condition`` and a ``description``.
"""

from __future__ import annotations

from urllib.parse import quote, unquote, urlsplit

from proton import Endpoint
from proton.utils import BlockingConnection, ConnectionClosed

REDIRECT = "amqp:connection:redirect"
ESTABLISHMENT_FAILED = "amqp:connection-establishment-failed"


class RedirectError(ConnectionError):
    """Following redirects failed (too many hops, a loop, or a malformed redirect)."""

    def __init__(self, message: str, hops: list[str]):
        super().__init__(f"{message} (hops: {' -> '.join(hops)})")
        self.hops = hops


class TooManyRedirects(RedirectError):
    """More than ``max_hops`` redirects."""


class RedirectLoop(RedirectError):
    """A redirect pointed back to an address already visited."""


class _RecordingConnection(BlockingConnection):
    """BlockingConnection that keeps a copy of the peer's close condition (the base class raises
    ``ConnectionClosed`` and then frees the connection, so the info map would be gone)."""

    remote_close_condition = None

    def on_connection_remote_close(self, event) -> None:
        self.remote_close_condition = event.connection.remote_condition
        super().on_connection_remote_close(event)


def _open_once(url: str, kwargs: dict) -> tuple[BlockingConnection | None, object | None]:
    """Connect once. Returns (connection, None) when open, (None, condition) when the peer
    answered with a redirect, raises for any other failure."""
    # Allocate first, initialise second: if the Close arrives inside the constructor, the object
    # (and the condition it recorded) is still ours.
    conn = _RecordingConnection.__new__(_RecordingConnection)
    try:
        conn.__init__(url, **kwargs)
        props = conn.conn.remote_properties or {}
        if props.get(ESTABLISHMENT_FAILED):
            # The failed-establishment Open arrived without its Close in the same read: wait for it.
            conn.wait(lambda: conn.conn.state & Endpoint.REMOTE_CLOSED, msg="waiting for the router's Close")
            raise ConnectionClosed(conn.conn)
        return conn, None
    except ConnectionClosed as exc:
        cond = conn.remote_close_condition
        if cond is not None and cond.name == REDIRECT:
            if conn.conn is not None:
                conn.close()
            return None, cond
        raise


def connect_following_redirects(url: str, *, max_hops: int = 5, **kwargs) -> BlockingConnection:
    """Open a proton ``BlockingConnection`` to ``url``, following AMQP redirects.

    ``kwargs`` go to ``BlockingConnection`` (``ssl_domain``, ``timeout``, ``user``, ``password``,
    ``allowed_mechs``, ``sasl_enabled``, ``container_id`` via ``Container``-style kwargs, …). On a
    redirect with a ``hostname`` the next hop uses it as ``virtual_host`` (the Open hostname and
    the TLS SNI). The returned connection has ``lodestone_hops``: the URLs visited, in order.

    Raises :class:`TooManyRedirects`, :class:`RedirectLoop`, :class:`RedirectError` (a redirect
    without a usable address), or proton's ``ConnectionClosed`` / ``ConnectionException`` /
    ``Timeout`` for every other failure.
    """
    parts = urlsplit(url)
    scheme = parts.scheme or "amqp"
    userinfo = ""
    if parts.username is not None:
        userinfo = quote(unquote(parts.username), safe="")
        if parts.password is not None:
            userinfo += ":" + quote(unquote(parts.password), safe="")
        userinfo += "@"
    path = parts.path
    hops = [url]
    visited = {(parts.hostname, parts.port, kwargs.get("virtual_host"))}
    current = url
    while True:
        conn, cond = _open_once(current, kwargs)
        if conn is not None:
            conn.lodestone_hops = hops
            return conn
        info = dict(cond.info or {})
        host = info.get("network-host")
        port = info.get("port")
        if not isinstance(host, str) or not host or port is None:
            raise RedirectError(f"redirect without network-host/port: {cond}", hops)
        if len(hops) > max_hops:
            raise TooManyRedirects(f"more than {max_hops} redirects", hops)
        hostname = info.get("hostname")
        kwargs = dict(kwargs)
        if hostname:
            kwargs["virtual_host"] = str(hostname)
        key = (str(host), int(port), kwargs.get("virtual_host"))
        if key in visited:
            raise RedirectLoop(f"redirect loop back to {host}:{port}", hops + [f"{host}:{port}"])
        visited.add(key)
        netloc_host = f"[{host}]" if ":" in host else host
        current = f"{scheme}://{userinfo}{netloc_host}:{int(port)}{path}"
        hops.append(current)
