"""Listening sockets and the accept loop.

trio's ``open_tcp_listeners`` does not set ``SO_REUSEPORT``, which several worker processes need
to share one port (the kernel then spreads new connections over the workers' accept queues). So
the sockets are made here: resolve, ``socket``, ``SO_REUSEADDR`` (+ ``SO_REUSEPORT`` when asked),
``bind``, ``listen``, and wrap each in ``trio.SocketListener``.

The accept loop follows trio's ``_highlevel_serve_listeners``: accepting and handling live in
separate nurseries, so a handler never blocks the accept loop; the connection limit is checked at
accept time (over-limit connections are counted and closed at once, before any TLS work). Unlike
trio's loop it accepts every pending connection per wakeup (bounded batches) on the stdlib
socket and hands handlers the stdlib socket and the peer address ``accept`` returned (the edge
wraps it in ``router.net.fastio`` streams).

Out of descriptors (EMFILE/ENFILE at ``accept``): the kernel keeps the connection in the backlog
and the listener stays readable, so simply retrying would spin and leave those clients hanging.
The loop keeps one spare descriptor (``/dev/null``, opened at start): it closes the spare,
accepts the waiting connection, closes it at once (the client sees the connection end — refused
cleanly, counted by ``on_fd_exhausted``), reopens the spare, and goes on. Connections already
established are untouched. Without a spare (it could not be reopened) it sleeps and retries.
"""

from __future__ import annotations

import errno
import logging
import os
import socket as _stdlib_socket
from typing import Any, Awaitable, Callable

import trio

log = logging.getLogger("router.listener")

# Errors from accept() that mean "out of a resource" (fds, memory); trio's serve_listeners sleeps
# and retries on them rather than crashing.
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
_SLEEP_ON_CAPACITY_S = 0.1
# accept() errors that concern only the connection being accepted: Linux passes a new socket's
# pending network error up through accept() (accept(2), "Error handling": treat them like
# EAGAIN). The same list as trio's SocketListener. Anything else is raised (and stops the router).
_ACCEPT_TRANSIENT_ERRNOS = {getattr(errno, name) for name in (
    "EPERM", "ECONNABORTED", "EPROTO", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN", "ENONET", "EHOSTUNREACH",
    "EOPNOTSUPP", "ENETUNREACH", "ENOSR", "ESOCKTNOSUPPORT", "EPROTONOSUPPORT", "ETIMEDOUT", "ECONNRESET")
    if hasattr(errno, name)}
_ACCEPT_BATCH = 64


async def open_listeners(host: str, port: int, *, reuse_port: bool = False,
                         backlog: int = 4096) -> list[trio.SocketListener]:
    """Bind ``host:port`` (every address it resolves to) and return trio listeners.

    With ``reuse_port`` the sockets get ``SO_REUSEPORT`` so sibling processes can bind the same
    port. ``port`` 0 picks a free port; when ``host`` resolves to several addresses the port the
    first bind got is reused for the rest, so one acceptor has one port.
    """
    infos = await trio.socket.getaddrinfo(host, port, type=_stdlib_socket.SOCK_STREAM,
                                          flags=_stdlib_socket.AI_PASSIVE)
    listeners: list[trio.SocketListener] = []
    chosen_port = port
    seen = set()
    try:
        for family, type_, proto, _canon, sockaddr in infos:
            key = (family, sockaddr[0])
            if key in seen:
                continue
            seen.add(key)
            sock = trio.socket.socket(family, type_, proto)
            try:
                sock.setsockopt(_stdlib_socket.SOL_SOCKET, _stdlib_socket.SO_REUSEADDR, 1)
                if reuse_port:
                    sock.setsockopt(_stdlib_socket.SOL_SOCKET, _stdlib_socket.SO_REUSEPORT, 1)
                if family == _stdlib_socket.AF_INET6:
                    sock.setsockopt(_stdlib_socket.IPPROTO_IPV6, _stdlib_socket.IPV6_V6ONLY, 1)
                addr = (sockaddr[0], chosen_port) + tuple(sockaddr[2:])
                await sock.bind(addr)
                if chosen_port == 0:
                    chosen_port = sock.getsockname()[1]
                sock.listen(backlog)
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            await listener.aclose()
        raise
    return listeners


def listener_port(listeners: list[trio.SocketListener]) -> int:
    """The port the (first) listener is bound to."""
    return listeners[0].socket.getsockname()[1]


class ConnectionLimit:
    """A per-acceptor cap on concurrent connections (a counter, not a semaphore: over the limit
    we refuse immediately instead of queueing, so the client is not left waiting)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self.active = 0

    def try_acquire(self) -> bool:
        if self.limit is not None and self.active >= self.limit:
            return False
        self.active += 1
        return True

    def release(self) -> None:
        self.active -= 1


class _Spare:
    """One spare descriptor, given up to accept-and-close a client when the process is out."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.reopen()

    def reopen(self) -> None:
        if self.fd is None:
            try:
                self.fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self.fd = None

    def release(self) -> bool:
        if self.fd is None:
            return False
        os.close(self.fd)
        self.fd = None
        return True

    def close(self) -> None:
        self.release()


class _Throttle:
    """At most one log line per ``period_s`` for a repeating condition."""

    def __init__(self, period_s: float = 10.0) -> None:
        self.period_s = period_s
        self.last = -1e9
        self.suppressed = 0

    def ready(self) -> bool:
        now = trio.current_time()
        if now - self.last >= self.period_s:
            self.last = now
            return True
        self.suppressed += 1
        return False


async def serve_listeners(handler: Callable[[_stdlib_socket.socket, Any], Awaitable[None]],
                          listeners: list[trio.SocketListener], *, handler_nursery: trio.Nursery,
                          limit: ConnectionLimit, on_rejected: Callable[[], None],
                          on_fd_exhausted: Callable[[], None] | None = None,
                          refuse: Callable[[_stdlib_socket.socket, Any], Awaitable[None]] | None = None) -> None:
    """Accept forever on every listener; each accepted socket runs ``handler(sock, peer)`` in
    ``handler_nursery`` (``sock``: a stdlib socket, ``peer``: its address as ``accept``
    returned it). Over the limit ``on_rejected`` is called and the socket goes to ``refuse``
    (which owns it: an AMQP refusal) or, without one, is closed at once; out
    of descriptors a waiting client is accepted with the spare descriptor and closed at once,
    and ``on_fd_exhausted`` called. The handler owns closing its socket."""
    spare = _Spare()
    try:
        async with trio.open_nursery() as accept_nursery:
            for listener in listeners:
                accept_nursery.start_soon(_accept_loop, handler, listener, handler_nursery, limit, on_rejected,
                                          spare, on_fd_exhausted or (lambda: None), _Throttle(), refuse)
    finally:
        spare.close()


def _stdlib_listener(listener: trio.SocketListener) -> _stdlib_socket.socket:
    """The stdlib socket under a trio listener (trio's socket wrapper keeps it as ``_sock``)."""
    return listener.socket._sock  # type: ignore[attr-defined]


async def _accept_loop(handler, listener: trio.SocketListener, handler_nursery: trio.Nursery,
                       limit: ConnectionLimit, on_rejected, spare: _Spare, on_fd_exhausted,
                       throttle: _Throttle, refuse=None) -> None:
    # Accept every pending connection per wakeup (up to _ACCEPT_BATCH, then yield so handlers
    # run): one wait per burst instead of one per connection. accept() returns the peer's
    # address, so handlers need no getpeername().
    lsock = _stdlib_listener(listener)
    accept = lsock.accept
    start_soon = handler_nursery.start_soon
    while True:
        for _ in range(_ACCEPT_BATCH):
            try:
                sock, peer = accept()
            except BlockingIOError:
                await trio.lowlevel.wait_readable(lsock)
                break
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE) and spare.release():
                    # refuse the waiting client cleanly instead of leaving it in the backlog
                    try:
                        s, _peer = accept()
                        s.close()
                        on_fd_exhausted()
                    except OSError:
                        pass
                    spare.reopen()
                    if throttle.ready():
                        log.error("out of file descriptors (%s): refusing new connections "
                                  "(established ones are unaffected)%s",
                                  errno.errorcode.get(exc.errno, exc.errno),
                                  f"; {throttle.suppressed} more since the last report" if throttle.suppressed else "")
                        throttle.suppressed = 0
                    continue
                if exc.errno in _ACCEPT_CAPACITY_ERRNOS:
                    if throttle.ready():
                        log.error("accept failed (%s); retrying in %.1fs", errno.errorcode.get(exc.errno, exc.errno),
                                  _SLEEP_ON_CAPACITY_S)
                    await trio.sleep(_SLEEP_ON_CAPACITY_S)
                    break
                if exc.errno in _ACCEPT_TRANSIENT_ERRNOS:
                    continue  # the client gave up before we accepted it
                raise
            if not limit.try_acquire():
                on_rejected()
                if refuse is None:
                    sock.close()  # a plain FIN: the client learns at once, we keep no state
                else:
                    start_soon(refuse, sock, peer)  # an AMQP refusal, bounded by the handler
                continue
            start_soon(_run_handler, handler, sock, peer, limit)
        else:
            await trio.lowlevel.checkpoint()


async def _run_handler(handler, sock: _stdlib_socket.socket, peer, limit: ConnectionLimit) -> None:
    owner = None
    try:
        # a handler may hand its connection to an object that outlives its task (the edge's
        # router.net.proxy.Relay): then the slot is given back when that one is done
        owner = await handler(sock, peer)
    finally:
        if owner is None:
            limit.release()
        else:
            owner.after.append(limit.release)
