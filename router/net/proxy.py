"""Byte pumping between a client and its broker once the handshake has been replayed.

Theory of operation
-------------------
One nursery, two pump tasks (client → upstream "up", upstream → client "down"), one cancel scope
owning the idle deadline. Each pump:

* reads a large chunk (``chunk_bytes``, 64 KiB by default) and refreshes the shared idle
  deadline (``scope.deadline = now + idle``);
* writes it with ``send_all`` — back-pressure is simply that we do not read again until the
  peer has taken the bytes (trio's send_all waits for the socket to drain);
* on EOF from its source it half-closes its destination (``send_eof``) and ends, while the other
  direction keeps running until it too sees EOF or the idle deadline fires. A TLS destination
  cannot be half-closed by ``trio.SSLStream``; there an EOF from the source closes the whole
  connection (TLS close_notify), which is what AMQP peers expect after a Close anyway.
* a broken peer (reset, TLS error) ends both directions at once.

Splice fast path: when both ends are plain TCP sockets and the OS has ``os.splice`` (Linux), each
direction starts by copying with plain ``read``/``write`` on the file descriptors (no trio
stream layers); once a read fills the whole 64 KiB buffer the direction is carrying bulk data and
switches to moving bytes socket → pipe → socket inside the kernel (``SPLICE_F_MOVE``), never
copying them into Python. Short-lived connections never pay for the pipes. Readiness comes from trio's ``wait_readable``/``wait_writable``; the pipe is
private to the direction and its size (1 MiB when the kernel allows) bounds the bytes in flight,
which is the back-pressure. ``loadtest/bench_proxy.py`` measures both paths
(``--no-splice``); see docs/router.md for the figures.
"""

from __future__ import annotations

import enum
import errno
import os
import socket as _stdlib_socket
import ssl
from dataclasses import dataclass

import trio

DEFAULT_CHUNK_BYTES = 65536
_TLS_CLOSE_S = 1.0  # how long a TLS close_notify may take before we just drop the socket
_PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = 1031  # linux/fcntl.h; not in Python's fcntl module before 3.10 on every build
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
_BROKEN_ERRNOS = {errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ETIMEDOUT, errno.EHOSTUNREACH,
                  errno.ENETUNREACH, errno.ECONNABORTED}


class EndReason(enum.Enum):
    """Why a proxied connection ended (the routing log's ``close_reason``)."""

    CLOSED = "closed"                  # both sides reached EOF (normal)
    CLIENT_ERROR = "client_error"      # the client reset / broke the connection
    UPSTREAM_ERROR = "upstream_error"  # the broker reset / broke the connection
    IDLE_TIMEOUT = "idle_timeout"      # no bytes either way for idle_timeout_s
    CANCELLED = "cancelled"            # we stopped it (drain deadline, shutdown)


@dataclass
class PumpStats:
    """Bytes moved and how the connection ended."""

    bytes_up: int = 0     # client → broker
    bytes_down: int = 0   # broker → client
    reason: EndReason = EndReason.CLOSED
    first_eof: str | None = None   # "client" or "upstream": who closed first
    spliced: bool = False          # True once a direction switched to kernel splice (bulk traffic)
    error: str | None = None       # what broke, when reason is *_ERROR


def splice_available() -> bool:
    """True when the kernel splice fast path can be used at all."""
    return hasattr(os, "splice")


def _plain_socket(stream) -> "trio.socket.SocketType | None":
    if type(stream) is trio.SocketStream and stream.socket.family in (_stdlib_socket.AF_INET,
                                                                      _stdlib_socket.AF_INET6):
        return stream.socket
    return None


class _Broken(Exception):
    def __init__(self, side: str, detail: str = ""):
        self.side = side
        self.detail = detail


def _detail(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}({cause!r})" if cause is not None else repr(exc)


async def pump(client: trio.abc.Stream, upstream: trio.abc.Stream, *, idle_timeout_s: float | None,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, use_splice: bool = True,
               stats: PumpStats | None = None) -> PumpStats:
    """Move bytes both ways until both sides closed, one broke, or nothing moved for
    ``idle_timeout_s``. Never raises for peer behaviour; returns what happened (``stats``, if
    given, is filled in as bytes move, so a caller that is cancelled still has the counts). The
    caller closes both streams afterwards (``aclose_forcefully``)."""
    stats = stats if stats is not None else PumpStats()
    csock, usock = _plain_socket(client), _plain_socket(upstream)
    spliced = use_splice and splice_available() and csock is not None and usock is not None
    with trio.CancelScope() as scope:
        idle = idle_timeout_s

        def refresh() -> None:
            if idle is not None:
                scope.deadline = trio.current_time() + idle

        refresh()
        async with trio.open_nursery() as nursery:
            if spliced:
                nursery.start_soon(_guard, stats, nursery, _splice_dir, csock, usock, "client", "upstream", refresh)
                nursery.start_soon(_guard, stats, nursery, _splice_dir, usock, csock, "upstream", "client", refresh)
            else:
                nursery.start_soon(_guard, stats, nursery, _stream_dir, client, upstream, "client", "upstream", refresh,
                                   chunk_bytes)
                nursery.start_soon(_guard, stats, nursery, _stream_dir, upstream, client, "upstream", "client", refresh,
                                   chunk_bytes)
    if scope.cancelled_caught and stats.reason is EndReason.CLOSED:
        stats.reason = EndReason.IDLE_TIMEOUT
    return stats


async def _guard(stats: PumpStats, nursery: trio.Nursery, fn, *args) -> None:
    # A broken side ends both directions; the first break names the reason.
    try:
        await fn(*args, stats=stats, nursery=nursery)
    except _Broken as exc:
        if stats.reason is EndReason.CLOSED:
            stats.reason = EndReason.CLIENT_ERROR if exc.side == "client" else EndReason.UPSTREAM_ERROR
            stats.error = f"{exc.side}: {exc.detail}"
        nursery.cancel_scope.cancel()


def _count(stats: PumpStats, src_name: str, n: int) -> None:
    if src_name == "client":
        stats.bytes_up += n
    else:
        stats.bytes_down += n


async def _stream_dir(src: trio.abc.Stream, dst: trio.abc.Stream, src_name: str, dst_name: str,
                      refresh, chunk_bytes: int, *, stats: PumpStats, nursery: trio.Nursery) -> None:
    while True:
        try:
            data = await src.receive_some(chunk_bytes)
        except trio.ClosedResourceError:
            return  # the other direction closed this stream (TLS close after EOF): not an error
        except trio.BrokenResourceError as exc:
            if not isinstance(exc.__cause__, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
                raise _Broken(src_name, "receive " + _detail(exc)) from None
            # TCP EOF without a TLS close_notify (many AMQP peers, trio's https-compatible mode):
            # AMQP frames are self-delimiting, so it is an ordinary EOF here.
            data = b""
        if not data:
            break
        refresh()
        try:
            await dst.send_all(data)
        except trio.ClosedResourceError:
            return
        except trio.BrokenResourceError as exc:
            raise _Broken(dst_name, "send " + _detail(exc)) from None
        _count(stats, src_name, len(data))
    # EOF from src: pass it on.
    if stats.first_eof is None:
        stats.first_eof = src_name
    if isinstance(dst, trio.abc.HalfCloseableStream):
        try:
            await dst.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise _Broken(dst_name, "send_eof " + _detail(exc)) from None
    else:
        # A TLS stream cannot be half-closed: close it gracefully (close_notify, bounded wait),
        # then end both directions.
        with trio.move_on_after(_TLS_CLOSE_S):
            try:
                await dst.aclose()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await trio.aclose_forcefully(dst)
        nursery.cancel_scope.cancel()


async def _splice_dir(src: trio.socket.SocketType, dst: trio.socket.SocketType, src_name: str, dst_name: str,
                      refresh, *, stats: PumpStats, nursery: trio.Nursery) -> None:
    sfd, dfd = src.fileno(), dst.fileno()
    # Copy mode first: most AMQP connections move little data, and for them a pipe pair per
    # direction costs more than it saves. A read that fills the whole buffer means bulk traffic:
    # from then on this direction splices.
    bulk = False
    while True:
        try:
            data = os.read(sfd, DEFAULT_CHUNK_BYTES)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(src)
            continue
        except OSError as exc:
            if exc.errno in _BROKEN_ERRNOS:
                raise _Broken(src_name, f"read: {exc.strerror}") from None
            raise
        if not data:
            break
        refresh()
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(dfd, view):]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(dst)
            except OSError as exc:
                if exc.errno in _BROKEN_ERRNOS:
                    raise _Broken(dst_name, f"write: {exc.strerror}") from None
                raise
        _count(stats, src_name, len(data))
        await trio.lowlevel.checkpoint()
        if len(data) == DEFAULT_CHUNK_BYTES:
            bulk = True
            break
    if bulk:
        await _splice_loop(src, dst, sfd, dfd, src_name, dst_name, refresh, stats)
    if stats.first_eof is None:
        stats.first_eof = src_name
    try:
        dst.shutdown(_stdlib_socket.SHUT_WR)
    except OSError as exc:
        if exc.errno not in _BROKEN_ERRNOS:
            raise
        raise _Broken(dst_name, f"shutdown: {exc.strerror}") from None


async def _splice_loop(src, dst, sfd: int, dfd: int, src_name: str, dst_name: str, refresh,
                       stats: PumpStats) -> None:
    """socket → pipe → socket in the kernel until EOF on ``src``."""
    import fcntl

    stats.spliced = True
    rfd, wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        try:
            fcntl.fcntl(wfd, _F_SETPIPE_SZ, _PIPE_SIZE)
        except OSError:
            pass  # above /proc/sys/fs/pipe-max-size for this user: keep the default 64 KiB
        while True:
            try:
                n = os.splice(sfd, wfd, _PIPE_SIZE, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(src)
                continue
            except OSError as exc:
                if exc.errno in _BROKEN_ERRNOS:
                    raise _Broken(src_name, f"splice in: {exc.strerror}") from None
                raise
            if n == 0:
                return
            refresh()
            left = n
            while left:
                try:
                    left -= os.splice(rfd, dfd, left, flags=_SPLICE_FLAGS)
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(dst)
                except OSError as exc:
                    if exc.errno in _BROKEN_ERRNOS:
                        raise _Broken(dst_name, f"splice out: {exc.strerror}") from None
                    raise
            _count(stats, src_name, n)
            # Let the other direction and the rest of the process run between chunks.
            await trio.lowlevel.checkpoint()
    finally:
        os.close(rfd)
        os.close(wfd)
