"""Byte pumping between a client and its broker once the handshake has been replayed.

Theory of operation
-------------------
Plain-to-plain connections start in a first phase (``_SmallPhase``): the process's one
shared epoll set (``SharedPoller``, run by the server as a system task; no descriptor per
connection) watches both sockets; each readable side is read once (64 KiB) and written to the
other side at once, EOFs are passed on with ``shutdown(SHUT_WR)``. The edge runs that phase as a
:class:`Relay`, with no task at all: the poller's dispatcher calls the relay for its sockets,
and one :class:`RelayKeeper` task per process (in the handlers nursery, alive while relays are)
ends relays that idled out or were cancelled (drain deadline, shutdown). So a held, idle
connection costs its two sockets and a few small objects — no task, no stack of coroutine
frames (``loadtest/bench_held.py``: 3.3 KiB of memory each, 9.2 KiB with a task). Without a
relay (``pump`` called directly) the same phase runs in the calling task (``_pump_small``).
Most AMQP connections (a few frames, then Close) end in that phase without spawning anything.
The first write that would block, a read that fills the whole buffer (bulk traffic), or the
broker ending first (the client's grace) hands the connection over — with the bytes not yet
written — to the general pump below, in a task of its own. TLS connections start there directly.

The general pump: one nursery, two pump tasks (client → upstream "up", upstream → client
"down"), one cancel scope owning the idle deadline (shared with ``_pump_small``). Each pump:

* reads a large chunk (``chunk_bytes``, 64 KiB by default) and refreshes the shared idle
  deadline (``scope.deadline = now + idle``);
* writes it with ``send_all`` — back-pressure is simply that we do not read again until the
  peer has taken the bytes (send_all waits for the socket to drain);
* on EOF from its source it half-closes its destination (``send_eof``) and ends, while the other
  direction keeps running until it too sees EOF or the idle deadline fires. A TLS destination
  cannot be half-closed; there an EOF from the source closes the whole connection (TLS
  close_notify), which is what AMQP peers expect after a Close anyway.
* a broken peer (reset, TLS error) ends both directions at once.

**The broker ends first** (its Close and EOF, or just its EOF when it died): nothing the client
sends can reach anybody any more, and a client that waits for its transport to close (proton
does after ``amqp:connection:forced``: it reconnects only once the socket is gone) would wait
for ever on a half-closed socket. So the router ends the client connection as a broker would:
the EOF is passed on, the client → broker direction stops (whatever the client sends from then
on is read and dropped, not written to the gone broker), the client gets
``upstream_close_grace_s`` to answer with its own EOF (a normal close, ``closed``), and then its
socket is closed both ways with a reset (``upstream_closed``), so its next read or write fails
at once. The trigger is the broker's end of stream alone: no frame is parsed after the handshake,
and the splice path is unchanged. When the client ends first, the half-close stays as it is: the
broker is given its time to answer.

Splice fast path: when both ends are plain TCP sockets and the OS has ``os.splice`` (Linux), each
direction starts by copying with plain ``read``/``write`` on the file descriptors (no trio
stream layers); once a read fills the whole 64 KiB buffer the direction is carrying bulk data and
switches to moving bytes socket → pipe → socket inside the kernel (``SPLICE_F_MOVE``), never
copying them into Python. Short-lived connections never pay for the pipes. Readiness comes from
trio's ``wait_readable``/``wait_writable``; the pipe is private to the direction and its size
(1 MiB when the kernel allows) bounds the bytes in flight, which is the back-pressure.
``loadtest/bench_proxy.py`` measures both paths (target ``proxy-nosplice``); see docs/router.md
for the figures.
"""

from __future__ import annotations

import enum
import logging
import errno
import os
import select
import socket as _stdlib_socket
import ssl
import struct
from dataclasses import dataclass

import trio

from router.net.fastio import FastSocketStream

log = logging.getLogger("router.connection")

DEFAULT_CHUNK_BYTES = 65536
DEFAULT_UPSTREAM_CLOSE_GRACE_S = 1.0  # upstream-close-grace-ms: the client's time to close after its broker did
_TLS_CLOSE_S = 1.0  # how long a TLS close_notify may take before we just drop the socket
_PIPE_SIZE = 1 << 20
LINGER_RESET = struct.pack("ii", 1, 0)  # struct linger {l_onoff = 1, l_linger = 0}: close sends a reset
_F_SETPIPE_SZ = 1031  # linux/fcntl.h; not in Python's fcntl module before 3.10 on every build
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
# A peer or the network broke the connection (read/write/splice/shutdown on a socket): that
# connection ends with *_error; any other errno is a bug (internal_error).
_BROKEN_ERRNOS = {errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ETIMEDOUT, errno.EHOSTUNREACH,
                  errno.ENETUNREACH, errno.ECONNABORTED, errno.ECONNREFUSED, errno.ENETDOWN, errno.EHOSTDOWN}


class EndReason(enum.Enum):
    """Why a proxied connection ended (the routing log's ``close_reason``)."""

    CLOSED = "closed"                  # both sides reached EOF (normal)
    CLIENT_ERROR = "client_error"      # the client reset / broke the connection
    UPSTREAM_ERROR = "upstream_error"  # the broker reset / broke the connection
    IDLE_TIMEOUT = "idle_timeout"      # no bytes either way for idle_timeout_s
    UPSTREAM_CLOSED = "upstream_closed"  # the broker ended first; the client did not follow within the grace
    CANCELLED = "cancelled"            # we stopped it (drain deadline, shutdown)


#: ``PumpStats.error`` of a connection ended by a bug in its relay (see Relay.fired)
INTERNAL_ERROR = "internal error"


@dataclass(slots=True)
class PumpStats:
    """Bytes moved and how the connection ended."""

    bytes_up: int = 0     # client → broker
    bytes_down: int = 0   # broker → client
    reason: EndReason = EndReason.CLOSED
    first_eof: str | None = None   # "client" or "upstream": who closed first
    spliced: bool = False          # True once a direction switched to kernel splice (bulk traffic)
    error: str | None = None       # what broke, when reason is *_ERROR (or how, for upstream_closed)
    dropped_up: int = 0            # client bytes read and dropped after the broker had ended


def splice_available() -> bool:
    """True when the kernel splice fast path can be used at all."""
    return hasattr(os, "splice")


def _plain_socket(stream):
    """The TCP socket under a plain stream (``FastSocketStream`` or ``trio.SocketStream``), else None."""
    t = type(stream)
    if (t is FastSocketStream or t is trio.SocketStream) and stream.socket.family in (_stdlib_socket.AF_INET,
                                                                                      _stdlib_socket.AF_INET6):
        return stream.socket
    return None


class _Waiter:
    """One connection parked on the shared poller: its task, and the fds that fired."""

    __slots__ = ("task", "ready")

    def __init__(self) -> None:
        self.task = None
        self.ready: list[int] = []


class SharedPoller:
    """One epoll set for every plain connection in its first pump phase.

    Until issue 7 each such connection made its own ``select.epoll`` — a third descriptor per
    proxied connection, which with a 1,024 open-files limit capped the router near 340 clients.
    Here one epoll set serves the whole process: a connection registers its two sockets
    (``EPOLLIN | EPOLLONESHOT``, so a socket that fired stays quiet until the connection
    re-arms it: the dispatcher never spins on data the connection has not read yet) and parks;
    the dispatcher task (``run``) waits for the epoll descriptor with trio's ``wait_readable``,
    collects the fired sockets per connection and reschedules each connection's task once.
    """

    def __init__(self) -> None:
        self._ep = select.epoll()
        self._owners: dict[int, _Waiter] = {}
        self.token = None
        self.keeper = RelayKeeper()     # the relays of this process (see Relay)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The dispatcher; while it runs, ``pump`` uses this poller (see ``active_poller``)."""
        global _ACTIVE
        self.token = trio.lowlevel.current_trio_token()
        _ACTIVE = self
        task_status.started()
        ep = self._ep
        owners = self._owners
        try:
            while True:
                await trio.lowlevel.wait_readable(ep)
                for fd, _ev in ep.poll(0, 1024):
                    w = owners.get(fd)
                    if w is None:
                        continue
                    if type(w) is Relay:
                        try:
                            w.fired(fd)
                        except Exception:   # a bug in one connection must not stop the dispatcher
                            log.exception("proxied connection: ending it failed")
                        continue
                    w.ready.append(fd)
                    task = w.task
                    if task is not None:
                        w.task = None
                        trio.lowlevel.reschedule(task)
        finally:
            self.token = None
            if _ACTIVE is self:
                _ACTIVE = None
            for w in list(owners.values()):  # nobody will wake them: wake them now
                if type(w) is Relay:
                    w.end(EndReason.CANCELLED)
                elif w.task is not None:
                    task, w.task = w.task, None
                    trio.lowlevel.reschedule(task)
            owners.clear()
            trio.lowlevel.notify_closing(ep)
            ep.close()

    def register(self, w: _Waiter, fd: int) -> None:
        try:
            self._ep.register(fd, select.EPOLLIN | select.EPOLLONESHOT)
        except FileExistsError:  # a closed socket's number, reused: take it over
            self._ep.modify(fd, select.EPOLLIN | select.EPOLLONESHOT)
        self._owners[fd] = w

    def rearm(self, fd: int) -> None:
        self._ep.modify(fd, select.EPOLLIN | select.EPOLLONESHOT)

    def unregister(self, fd: int) -> None:
        if self._owners.pop(fd, None) is not None:
            try:
                self._ep.unregister(fd)
            except (OSError, ValueError):
                pass

    async def wait(self, w: _Waiter) -> bool:
        """Park until one of ``w``'s sockets fired (at once if one already did). False when the
        dispatcher has stopped: the caller must go on without it."""
        if self.token is None:
            await trio.lowlevel.checkpoint()
            return False
        if w.ready:
            await trio.lowlevel.checkpoint()
            return True
        w.task = trio.lowlevel.current_task()

        def abort(_raise_cancel):
            w.task = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        return self.token is not None or bool(w.ready)


_ACTIVE: SharedPoller | None = None


def active_poller() -> SharedPoller | None:
    """The shared poller running in this trio run, else None (then plain connections go
    straight to the two-task pump)."""
    p = _ACTIVE
    if p is None or p.token is None:
        return None
    try:
        if trio.lowlevel.current_trio_token() is not p.token:
            return None
    except RuntimeError:
        return None
    return p


class _Broken(Exception):
    def __init__(self, side: str, detail: str = ""):
        self.side = side
        self.detail = detail


def _detail(exc: BaseException) -> str:
    cause = exc.__cause__ or exc.__context__
    return f"{type(exc).__name__}({cause!r})" if cause is not None else repr(exc)


async def pump(client: trio.abc.Stream, upstream: trio.abc.Stream, *, idle_timeout_s: float | None,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, use_splice: bool = True,
               stats: PumpStats | None = None,
               upstream_close_grace_s: float = DEFAULT_UPSTREAM_CLOSE_GRACE_S, state=None) -> PumpStats:
    """Move bytes both ways until both sides closed, one broke, nothing moved for
    ``idle_timeout_s``, or the broker ended first and the client did not follow within
    ``upstream_close_grace_s`` (see the module docstring). Never raises for peer behaviour;
    returns what happened (``stats``, if given, is filled in as bytes move, so a caller that is
    cancelled still has the counts). The caller closes both streams afterwards
    (``aclose_forcefully``); a client left to the grace has its socket set to reset on close.
    ``state``: where a :class:`Relay` handed the connection over (its first phase is over)."""
    stats = stats if stats is not None else PumpStats()
    csock, usock = _plain_socket(client), _plain_socket(upstream)
    plain = csock is not None and usock is not None
    spliced = use_splice and splice_available() and plain
    with trio.CancelScope() as scope:
        idle = idle_timeout_s
        # The deadline is pushed out only when it falls short of now + idle, and then with some
        # slack (1 %, at most 1 s), so a busy connection does not re-arm trio's deadline heap
        # on every read: the idle timeout fires between idle and idle + slack after the last byte.
        slack = min(1.0, idle * 0.01) if idle is not None else 0.0

        def refresh() -> None:
            if idle is not None:
                due = trio.current_time() + idle
                if scope.deadline < due:
                    scope.deadline = due + slack

        if idle is not None:
            scope.deadline = trio.current_time() + idle + slack
        # (done, pending bytes, bulk) for client→upstream and upstream→client
        poller = active_poller() if plain and state is None else None
        if state is None:
            state = ((False, b"", False), (False, b"", False))
        if poller is not None:
            try:
                state = await _pump_small(poller, csock, usock, stats, refresh)
            except _Broken as exc:
                _broken(stats, exc)
                state = None
        if state is not None:
            (up_done, up_pending, up_bulk), (down_done, down_pending, down_bulk) = state
            if down_done and not up_done and stats.first_eof == "upstream":
                # the broker ended first, in the first phase: only the client's grace is left
                await _client_grace(client, csock, upstream_close_grace_s, chunk_bytes, stats)
            else:
                async with trio.open_nursery() as nursery:
                    flow = _Flow(nursery, client, csock, upstream_close_grace_s, chunk_bytes, stats)
                    if spliced:
                        if not up_done:
                            nursery.start_soon(flow.up, _splice_dir, csock, usock, "client", "upstream",
                                               refresh, up_pending, up_bulk)
                        if not down_done:
                            nursery.start_soon(_guard, stats, nursery, _splice_dir, usock, csock, "upstream",
                                               "client", refresh, down_pending, down_bulk, flow)
                    else:
                        if not up_done:
                            nursery.start_soon(flow.up, _stream_dir, client, upstream, "client", "upstream",
                                               refresh, chunk_bytes, up_pending)
                        if not down_done:
                            nursery.start_soon(_guard, stats, nursery, _stream_dir, upstream, client, "upstream",
                                               "client", refresh, chunk_bytes, down_pending, flow)
    if scope.cancelled_caught and stats.reason is EndReason.CLOSED:
        stats.reason = EndReason.IDLE_TIMEOUT
    return stats


_GO_ON = object()   # _SmallPhase.step: nothing to report, wait for the next readiness


class _SmallPhase:
    """The first phase of a plain-to-plain pump, one readiness at a time: the shared poller
    watches both sockets, and each readable side is read once and written to the other at
    once. Most AMQP connections (a few frames each way, then Close) end here. Driven by
    :func:`_pump_small` (in the connection's task) or by a :class:`Relay` (no task at all)."""

    __slots__ = ("poller", "csock", "usock", "cfd", "ufd", "cdone", "udone", "stats", "refresh", "registered")

    def __init__(self, poller: SharedPoller, csock, usock, stats: PumpStats, refresh) -> None:
        self.poller = poller
        self.csock, self.usock = csock, usock
        self.cfd, self.ufd = csock.fileno(), usock.fileno()
        self.cdone = self.udone = False
        self.stats = stats
        self.refresh = refresh
        self.registered: list[int] = []

    def register(self, owner) -> None:
        for fd in (self.cfd, self.ufd):
            self.poller.register(owner, fd)
            self.registered.append(fd)

    def unregister(self) -> None:
        for fd in self.registered:
            self.poller.unregister(fd)
        self.registered.clear()

    def step(self, fd: int):
        """``fd`` is readable: read it once and write what came to the other side. Returns
        ``_GO_ON``; None when both directions reached EOF; or, to hand over to the two-task
        pump, per direction (done, bytes still to write, bulk) — as soon as a write would block
        (back-pressure needs the per-direction tasks), a read fills the whole buffer (bulk
        traffic: splice), or the broker ended first (the client's grace). Raises ``_Broken``."""
        poller, cfd, ufd = self.poller, self.cfd, self.ufd
        if fd == cfd:
            if self.cdone:
                return _GO_ON
            dfd, src_name, dst_name, dst = ufd, "client", "upstream", self.usock
        else:
            if self.udone:
                return _GO_ON
            dfd, src_name, dst_name, dst = cfd, "upstream", "client", self.csock
        try:
            data = os.read(fd, DEFAULT_CHUNK_BYTES)
        except BlockingIOError:
            poller.rearm(fd)
            return _GO_ON
        except OSError as exc:
            if exc.errno in _BROKEN_ERRNOS:
                raise _Broken(src_name, f"read: {exc.strerror}") from None
            raise
        stats = self.stats
        if not data:  # EOF: pass it on; the other direction keeps flowing
            if stats.first_eof is None:
                stats.first_eof = src_name
            _shutdown(dst, dst_name)
            poller.unregister(fd)
            self.registered.remove(fd)
            if fd == cfd:
                self.cdone = True
            else:
                self.udone = True
            if self.cdone and self.udone:
                return None
            if fd == ufd:  # the broker ended first: the client's grace (see pump)
                return (False, b"", False), (True, b"", False)
            return _GO_ON
        self.refresh()
        try:
            n = os.write(dfd, data)
        except BlockingIOError:
            n = 0
        except OSError as exc:
            if exc.errno in _BROKEN_ERRNOS:
                raise _Broken(dst_name, f"write: {exc.strerror}") from None
            raise
        _count(stats, src_name, n)
        if n < len(data) or len(data) == DEFAULT_CHUNK_BYTES:
            here = (False, data[n:], len(data) == DEFAULT_CHUNK_BYTES)
            if fd == cfd:
                return here, (self.udone, b"", False)
            return (self.cdone, b"", False), here
        poller.rearm(fd)
        return _GO_ON


async def _pump_small(poller: SharedPoller, csock, usock, stats: PumpStats, refresh):
    """:class:`_SmallPhase` in the calling task (see its ``step`` for what it returns; the
    state also when the dispatcher stopped). Raises ``_Broken``."""
    phase = _SmallPhase(poller, csock, usock, stats, refresh)
    w = _Waiter()
    try:
        phase.register(w)
        while True:
            if not await poller.wait(w):  # the dispatcher stopped: the two-task pump goes on
                return (phase.cdone, b"", False), (phase.udone, b"", False)
            fired, w.ready = w.ready, []
            for fd in fired:
                r = phase.step(fd)
                if r is not _GO_ON:
                    return r
    finally:
        phase.unregister()


class Relay:
    """A plain proxied connection in its first phase with no task of its own: the poller's
    dispatcher calls :meth:`fired` for its sockets, :class:`RelayKeeper` ends it when idle or
    cancelled. An idle held connection then costs its two sockets and this object, not a task
    and a stack of coroutine frames. It ends (``on_end(stats)``, synchronous, once) when both
    sides closed, one broke, it idled out or was cancelled; it hands over (``resume(state)``, a
    new task in the keeper's nursery) when the two-task pump must take over: back-pressure,
    bulk data, or the broker ended first (the client's grace)."""

    __slots__ = ("phase", "keeper", "stats", "idle", "slack", "deadline", "on_end", "resume", "ended", "after")

    def __init__(self, poller: SharedPoller, keeper: "RelayKeeper", csock, usock, stats: PumpStats,
                 idle_timeout_s: float | None, on_end, resume) -> None:
        self.keeper = keeper
        self.stats = stats
        self.idle = idle_timeout_s
        # the same slack as pump's deadline: pushed out only when it falls short
        self.slack = min(1.0, idle_timeout_s * 0.01) if idle_timeout_s is not None else 0.0
        self.deadline = (trio.current_time() + idle_timeout_s + self.slack if idle_timeout_s is not None
                         else float("inf"))
        self.on_end = on_end
        self.resume = resume
        self.ended = False
        #: run once the connection is over, however it ends (the listener's connection slot)
        self.after: list = []
        self.phase = _SmallPhase(poller, csock, usock, stats, self._refresh)

    def start(self) -> None:
        """Register both sockets and join the keeper; on failure (raised) nothing stays
        registered once :meth:`abandon` has run."""
        self.phase.register(self)
        self.keeper.add(self)

    def abandon(self) -> None:
        """Undo a failed :meth:`start` without ending the connection (its caller serves it)."""
        self.ended = True
        self.phase.unregister()
        self.keeper.discard(self)

    def _refresh(self) -> None:
        idle = self.idle
        if idle is not None:
            due = trio.current_time() + idle
            if self.deadline < due:
                self.deadline = due + self.slack

    def fired(self, fd: int) -> None:
        """The dispatcher: ``fd`` is readable."""
        if self.ended:
            return
        try:
            r = self.phase.step(fd)
        except _Broken as exc:
            _broken(self.stats, exc)
            self.end()
            return
        except Exception:
            log.exception("proxied connection failed in its first phase")
            if self.stats.reason is EndReason.CLOSED:   # we stopped it; the owner counts the bug
                self.stats.reason = EndReason.CANCELLED
            self.stats.error = INTERNAL_ERROR
            self.end()
            return
        if r is _GO_ON:
            return
        if r is None:
            self.end()
            return
        self.ended = True
        self.phase.unregister()
        self.keeper.discard(self)
        try:
            self.keeper.nursery.start_soon(self.resume, r)
        except RuntimeError:      # the handlers nursery is closing: nobody may serve it any more
            self.ended = False
            self.end(EndReason.CANCELLED)

    def end(self, reason: EndReason | None = None) -> None:
        """End here (idle timeout, cancellation: ``reason``; else as ``stats`` says)."""
        if self.ended:
            return
        self.ended = True
        if reason is not None and self.stats.reason is EndReason.CLOSED:
            self.stats.reason = reason
        try:
            self.phase.unregister()
            self.keeper.discard(self)
        finally:
            try:
                self.on_end(self.stats)
            except Exception:     # the dispatcher and the keeper serve every relay: never raise
                log.exception("proxied connection: ending it failed")


class RelayKeeper:
    """The relays of one process, and the one task that stands for them in the handlers nursery
    (started with the first relay, ended with the last): it ends relays whose idle deadline
    passed (checked every ``sweep`` — an eighth of the shortest idle timeout, at most 1 s — so an
    idle timeout fires up to that much late), and when the nursery is cancelled (a drain's
    deadline, shutdown) it ends every relay as cancelled. So a drain waits for relays as it waits
    for connection tasks."""

    def __init__(self) -> None:
        self.relays: set[Relay] = set()
        self.nursery: trio.Nursery | None = None
        self.sweep_s = 1.0
        self._running = False

    def add(self, relay: Relay) -> None:
        self.relays.add(relay)
        if relay.idle is not None:
            self.sweep_s = min(self.sweep_s, max(0.01, relay.idle / 8))
        if not self._running:
            self._running = True
            self.nursery.start_soon(self._run)

    def discard(self, relay: Relay) -> None:
        self.relays.discard(relay)

    async def _run(self) -> None:
        relays = self.relays
        try:
            while relays:
                await trio.sleep(self.sweep_s)
                now = trio.current_time()
                for r in [r for r in relays if r.deadline <= now]:
                    r.end(EndReason.IDLE_TIMEOUT)
        except BaseException:
            for r in list(relays):
                r.end(EndReason.CANCELLED)    # never raises (see Relay.end)
            raise
        finally:
            self._running = False
            self.sweep_s = 1.0


def _shutdown(dst, dst_name: str) -> None:
    try:
        dst.shutdown(_stdlib_socket.SHUT_WR)
    except OSError as exc:
        if exc.errno not in _BROKEN_ERRNOS:
            raise
        raise _Broken(dst_name, f"shutdown: {exc.strerror}") from None


def _broken(stats: PumpStats, exc: "_Broken") -> None:
    if stats.reason is EndReason.CLOSED:
        stats.reason = EndReason.CLIENT_ERROR if exc.side == "client" else EndReason.UPSTREAM_ERROR
        stats.error = f"{exc.side}: {exc.detail}"


async def _guard(stats: PumpStats, nursery: trio.Nursery, fn, *args) -> None:
    # A broken side ends both directions; the first break names the reason.
    try:
        await fn(*args, stats=stats, nursery=nursery)
    except _Broken as exc:
        _broken(stats, exc)
        nursery.cancel_scope.cancel()


class _Flow:
    """What the two directions of one two-task pump share: the client → broker direction runs
    in a scope of its own, which the broker → client direction cancels when the broker ended
    first; the same task then runs the client's grace (``_client_grace``), so that only one task
    ever reads the client (trio's own streams allow no second reader)."""

    __slots__ = ("nursery", "client", "csock", "grace_s", "chunk_bytes", "stats", "up_scope", "ended")

    def __init__(self, nursery: trio.Nursery, client, csock, grace_s: float, chunk_bytes: int,
                 stats: PumpStats) -> None:
        self.nursery = nursery
        self.client = client
        self.csock = csock
        self.grace_s = grace_s
        self.chunk_bytes = chunk_bytes
        self.stats = stats
        self.up_scope = trio.CancelScope()
        self.ended = False

    async def up(self, fn, *args) -> None:
        """The client → broker direction; once the broker has ended first, the client's grace."""
        with self.up_scope:
            await _guard(self.stats, self.nursery, fn, *args)
        if self.ended:
            await _client_grace(self.client, self.csock, self.grace_s, self.chunk_bytes, self.stats)

    def upstream_ended(self) -> None:
        """The broker → client direction reached the broker's EOF and passed it on."""
        if self.stats.first_eof != "upstream":
            return  # the client had ended first: both directions are done, a normal close
        self.ended = True
        self.up_scope.cancel()


async def _client_grace(client, csock, grace_s: float, chunk_bytes: int, stats: PumpStats) -> None:
    """The broker has ended and the client has its EOF: read (and drop) what the client still
    sends until its own EOF, for at most ``grace_s``. A client still there after that is
    closed both ways: a plain socket is set to reset on close (``SO_LINGER`` 0), so a client
    that only writes (proton waiting for its transport to close) fails its next write at once."""
    with trio.move_on_after(grace_s):
        while True:
            try:
                data = await client.receive_some(chunk_bytes)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the client reset or is gone: nothing is left to close gently
            if not data:
                return  # the client closed too: a normal end
            stats.dropped_up += len(data)
    if stats.reason is EndReason.CLOSED:
        stats.reason = EndReason.UPSTREAM_CLOSED
        stats.error = (f"upstream: ended the connection first; the client did not close within {grace_s:g} s "
                       f"({stats.dropped_up} bytes from it dropped); closed by the router")
    if csock is not None:
        try:
            csock.setsockopt(_stdlib_socket.SOL_SOCKET, _stdlib_socket.SO_LINGER, LINGER_RESET)
        except OSError:
            pass


def _count(stats: PumpStats, src_name: str, n: int) -> None:
    if src_name == "client":
        stats.bytes_up += n
    else:
        stats.bytes_down += n


async def _stream_dir(src: trio.abc.Stream, dst: trio.abc.Stream, src_name: str, dst_name: str,
                      refresh, chunk_bytes: int, pending: bytes = b"", flow: _Flow | None = None, *,
                      stats: PumpStats, nursery: trio.Nursery) -> None:
    if pending:  # read by _pump_small, not yet written
        try:
            await dst.send_all(pending)
        except trio.ClosedResourceError:
            return
        except trio.BrokenResourceError as exc:
            raise _Broken(dst_name, "send " + _detail(exc)) from None
        _count(stats, src_name, len(pending))
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
        if flow is not None:
            flow.upstream_ended()
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


async def _splice_dir(src, dst, src_name: str, dst_name: str, refresh, pending: bytes = b"",
                      bulk: bool = False, flow: _Flow | None = None, *, stats: PumpStats,
                      nursery: trio.Nursery) -> None:
    sfd, dfd = src.fileno(), dst.fileno()
    if pending:  # read by _pump_small, not yet written
        await _write_all(dst, dfd, pending, dst_name)
        _count(stats, src_name, len(pending))
    # Copy mode first: most AMQP connections move little data, and for them a pipe pair per
    # direction costs more than it saves. A read that fills the whole buffer means bulk traffic:
    # from then on this direction splices.
    while not bulk:
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
        await _write_all(dst, dfd, data, dst_name)
        _count(stats, src_name, len(data))
        await trio.lowlevel.checkpoint()
        if len(data) == DEFAULT_CHUNK_BYTES:
            bulk = True
    if bulk:
        await _splice_loop(src, dst, sfd, dfd, src_name, dst_name, refresh, stats)
    if stats.first_eof is None:
        stats.first_eof = src_name
    _shutdown(dst, dst_name)
    if flow is not None:
        flow.upstream_ended()


async def _write_all(dst, dfd: int, data: bytes, dst_name: str) -> None:
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
