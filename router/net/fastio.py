"""Lean trio streams over non-blocking stdlib sockets, for the router's per-connection hot path.

Theory of operation
-------------------
``trio.SocketStream`` and ``trio.SSLStream`` are general and careful: every call is a checkpoint,
conflict detectors guard against two tasks using one stream, ``SSLStream`` shuttles every TLS
record through two ``MemoryBIO`` objects and a lock. Profiling the router (issue #4) showed these
layers costing more per connection than everything the router actually decides. The edge uses
each stream from one task at a time, so it can do without them:

* :class:`FastSocketStream` — a plain TCP socket. ``receive_some``/``send_all`` try the system
  call first and only wait (``trio.lowlevel.wait_readable``/``wait_writable``) on ``EAGAIN``.
* :class:`FastTLSStream` — an ``ssl.SSLSocket`` in non-blocking mode: OpenSSL reads and writes
  the file descriptor itself (no BIO copies); ``SSLWantReadError``/``SSLWantWriteError`` become
  waits. Always try the operation before waiting, never the other way round: OpenSSL may hold
  decrypted bytes that the kernel no longer reports as readable. A TCP EOF without close_notify
  reads as EOF (``b""``), and so does a TCP reset, which OpenSSL 3 reports the same way. (Telling
  them apart by the socket's TCP state is possible, but brokers commonly end TLS connections
  abortively right after their AMQP Close — Lodestone's own broker does — and every such
  connection would then count as broken.)

Both implement the ``trio.abc`` stream interface the rest of the edge (and ``router.net.proxy``)
uses, with trio's exceptions (``BrokenResourceError`` with the OS/TLS error as ``__cause__``,
``ClosedResourceError`` after ``aclose``). Unlike trio's streams, an operation that can complete
at once does not yield to the scheduler (no checkpoint): callers bound their loops (the handshake
by its byte limit, the pump by an explicit checkpoint per chunk). Not safe for concurrent use of
one direction by two tasks (the edge never does that).
"""

from __future__ import annotations

import errno
import select
import socket as _socket
import ssl

import trio
from trio.lowlevel import notify_closing, wait_readable, wait_writable

_RECEIVE_DEFAULT = 65536
_CLOSED_ERRNOS = {errno.EBADF, errno.ENOTSOCK}


def prepare_socket(sock: _socket.socket, user_timeout_ms: int = 0) -> None:
    """Non-blocking and ``TCP_NODELAY`` (AMQP frames are written whole; Nagle would only delay
    the next small frame behind a delayed ACK). ``user_timeout_ms`` > 0: ``TCP_USER_TIMEOUT``,
    the kernel ends the connection once bytes it sent stay unacknowledged that long (a peer
    across a silent partition), where it would otherwise retransmit for 15 minutes or more."""
    sock.setblocking(False)
    sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)
    if user_timeout_ms > 0 and hasattr(_socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_USER_TIMEOUT, user_timeout_ms)


class FastSocketStream(trio.abc.HalfCloseableStream):
    """A TCP connection over a non-blocking stdlib socket (see the module docstring)."""

    def __init__(self, sock: _socket.socket):
        self.socket = sock
        self._closed = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Bytes from the peer; ``b""`` at EOF."""
        sock = self.socket
        n = max_bytes or _RECEIVE_DEFAULT
        while True:
            try:
                return sock.recv(n)
            except BlockingIOError:
                pass
            except OSError as exc:
                raise self._error(exc) from exc
            await wait_readable(sock)

    async def send_all(self, data) -> None:
        """Write all of ``data`` (waits for the socket to drain: back-pressure)."""
        sock = self.socket
        view = memoryview(data)
        while view:
            try:
                sent = sock.send(view)
            except BlockingIOError:
                await wait_writable(sock)
                continue
            except OSError as exc:
                raise self._error(exc) from exc
            view = view[sent:]

    async def wait_send_all_might_not_block(self) -> None:
        await wait_writable(self.socket)

    async def send_eof(self) -> None:
        """Half-close (``shutdown(SHUT_WR)``)."""
        try:
            self.socket.shutdown(_socket.SHUT_WR)
        except OSError as exc:
            raise self._error(exc) from exc

    def close(self) -> None:
        """Close now (synchronous; wakes any task waiting on the socket)."""
        if not self._closed:
            self._closed = True
            notify_closing(self.socket)
            self.socket.close()

    async def aclose(self) -> None:
        self.close()

    def _error(self, exc: OSError) -> Exception:
        if self._closed or exc.errno in _CLOSED_ERRNOS:
            return trio.ClosedResourceError("stream was closed")
        return trio.BrokenResourceError(f"socket error: {exc}")


class FastTLSStream(trio.abc.Stream):
    """TLS over a non-blocking ``ssl.SSLSocket`` (see the module docstring).

    ``aclose`` sends a close_notify (once, without waiting for the peer's, as trio's SSLStream
    does) when the handshake completed, then closes the socket. A TLS stream cannot be
    half-closed, so this is not a ``HalfCloseableStream``."""

    def __init__(self, sock: _socket.socket, context: ssl.SSLContext, *, server_side: bool,
                 server_hostname: str | None = None):
        self.raw = sock
        self.ssl_object = context.wrap_socket(sock, server_side=server_side, server_hostname=server_hostname,
                                              do_handshake_on_connect=False, suppress_ragged_eofs=False)
        self.socket = self.ssl_object  # wrap_socket detached ``sock``; this object owns the fd now
        self.handshook = False
        self._closed = False
        self._broken = False

    async def do_handshake(self) -> None:
        """Complete the TLS handshake. Raises ``BrokenResourceError`` (cause: the ssl error)."""
        s = self.ssl_object
        while True:
            try:
                s.do_handshake()
                self.handshook = True
                return
            except ssl.SSLWantReadError:
                await wait_readable(s)
            except ssl.SSLWantWriteError:
                await wait_writable(s)
            except (ssl.SSLError, OSError) as exc:
                self._broken = True
                raise trio.BrokenResourceError(f"TLS handshake failed: {exc}") from exc

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Decrypted bytes; ``b""`` at a close_notify or a TCP EOF (AMQP frames are
        self-delimiting, so a missing close_notify loses nothing a peer can miss). OpenSSL 3
        reports a TCP reset as the same unexpected EOF, so under TLS a reset reads as EOF too."""
        s = self.ssl_object
        n = max_bytes or _RECEIVE_DEFAULT
        while True:
            try:
                return s.recv(n)
            except ssl.SSLWantReadError:
                await wait_readable(s)
            except ssl.SSLWantWriteError:
                await wait_writable(s)
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            except (ssl.SSLError, OSError) as exc:
                raise self._error(exc) from exc

    async def send_all(self, data) -> None:
        """Encrypt and write all of ``data``. OpenSSL either writes a whole record batch or asks
        to be called again with the same bytes (``SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER``)."""
        s = self.ssl_object
        view = memoryview(data)
        while view:
            try:
                sent = s.send(view)
            except ssl.SSLWantWriteError:
                await wait_writable(s)
                continue
            except ssl.SSLWantReadError:
                await wait_readable(s)
                continue
            except (ssl.SSLError, OSError) as exc:
                raise self._error(exc) from exc
            view = view[sent:]

    async def wait_send_all_might_not_block(self) -> None:
        await wait_writable(self.ssl_object)

    def send_close_notify(self) -> bool:
        """Try to send our close_notify without waiting; True when it went out (or cannot)."""
        if not self.handshook or self._broken or self._closed:
            return True
        try:
            self.ssl_object.unwrap()
        except ssl.SSLWantReadError:
            return True  # ours was sent; the peer's has not arrived, and we do not wait for it
        except ssl.SSLWantWriteError:
            return False
        except (ssl.SSLError, OSError, ValueError):
            return True
        return True

    async def aclose(self) -> None:
        """close_notify (bounded by the caller's cancel scope) and close."""
        try:
            while not self.send_close_notify():
                await wait_writable(self.ssl_object)
        finally:
            self.close()

    def close(self) -> None:
        """Close the socket now, without a close_notify."""
        if not self._closed:
            self._closed = True
            notify_closing(self.ssl_object)
            self.ssl_object.close()

    def _error(self, exc: Exception) -> Exception:
        if self._closed or (isinstance(exc, OSError) and exc.errno in _CLOSED_ERRNOS):
            return trio.ClosedResourceError("stream was closed")
        self._broken = True
        return trio.BrokenResourceError(f"TLS stream broken: {exc}")


async def connect_tcp(family: int, address: tuple) -> _socket.socket:
    """Non-blocking TCP connect to an IP address. Raises ``OSError``; closes the socket on any
    failure or cancellation."""
    sock = _socket.socket(family, _socket.SOCK_STREAM)
    try:
        prepare_socket(sock)
        err = sock.connect_ex(address)
        if err == errno.EINPROGRESS:
            # On loopback the handshake often completes inside connect(): a zero-timeout poll
            # saves a trip through the scheduler.
            poller = select.poll()
            poller.register(sock, select.POLLOUT)
            if not poller.poll(0):
                await wait_writable(sock)
            err = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_ERROR)
        if err:
            raise OSError(err, f"connect to {address[0]}:{address[1]} failed: {_strerror(err)}")
    except BaseException:
        notify_closing(sock)
        sock.close()
        raise
    return sock


def _strerror(err: int) -> str:
    import os

    return os.strerror(err)
