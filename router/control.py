"""The control channel between a multi-worker router's supervisor and each worker process.

Theory of operation
-------------------
The supervisor (``router.workers``) creates one ``socketpair`` per worker and hands one end to
the worker process (``--control-fd``); nothing else can connect to it. Both ends speak the same
framing: a 4-byte big-endian length, then one UTF-8 JSON object (keys that are lone surrogates
survive: ``json`` escapes them). A message with ``"op"`` is a command; when it also carries an
``"id"`` the peer answers with ``{"re": <id>, ...}`` or ``{"re": <id>, "error": "<text>"}``.

``Link.run`` reads and dispatches messages **in arrival order, synchronously** (the handler is a
plain function): a reply wakes the task waiting in ``request``; a command is handled before the
next message is read. A handler may instead return a coroutine (a reload's steps, which bind
sockets and start services): it runs as a task of the link and its result is the reply, while
later messages are dispatched meanwhile (a reload's step changes nothing until its commit). So the first message a worker reads (``state``: filters and pool) is always
applied before any later filter change or pool update, and changes apply in the order the
supervisor made them. Writes go through an unbounded in-memory queue drained by one writer task
(``send`` never blocks, so a pool or filter callback may call it); queued messages are coalesced
into one ``send_all``.

Either side closing (process exit, kill -9) ends ``run``; ``closed`` is set, waiting requests get
``ChannelClosed``. Messages (all JSON objects):

supervisor → worker: ``config {text}`` (always the first message: the configuration file's
content in force, which a worker runs even when the file has changed since; read before trio
starts by ``read_config_message``), ``state {filters, pools}``, ``set_filter {router, field, value}`` (id),
``pool {router, states}`` (the probe results and the held targets; with an id after a hold or
readmit, answered once applied), ``stats`` (id), ``reload_prepare {text, files, ports, pools}``
(id), ``reload_commit`` (id), ``reload_abort`` (id) (``router.reload``).
worker → supervisor: ``ready {ports}``, ``cache_get {router, key}`` (id),
``cache_write {router, puts, touches, deletes}`` (id), ``ping`` (id),
``upstream_failed {router, slot, error}`` (the worker's proxy could not connect to that target),
``diverted {router, group}`` (a connection went elsewhere while that target was down).
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import math
import socket
from typing import Any, Callable

import trio
from router.errors import CacheBackendError

log = logging.getLogger("router.control")

MAX_MESSAGE_BYTES = 16 << 20

Handler = Callable[[dict], "dict | None"]


_BROKEN = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class ChannelClosed(Exception):
    """The peer went away (or the link was closed) before answering."""


class RemoteFailure(Exception):
    """The peer answered a request with an error."""


def _encode(msg: dict) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    return len(body).to_bytes(4, "big") + body


def stream_from_fd(fd: int) -> trio.SocketStream:
    """A trio stream over an inherited socket file descriptor (the worker's end of the pair)."""
    sock = socket.socket(fileno=fd)
    sock.setblocking(False)
    return trio.SocketStream(trio.socket.from_stdlib_socket(sock))


def stream_from_socket(sock: socket.socket) -> trio.SocketStream:
    """A trio stream over one end of a ``socket.socketpair()``."""
    sock.setblocking(False)
    return trio.SocketStream(trio.socket.from_stdlib_socket(sock))


class Link:
    """One end of a control channel: ``send``, ``await request``, ``await run``."""

    def __init__(self, stream: trio.abc.Stream, handler: Handler, *, name: str = "link") -> None:
        self.name = name
        self._stream = stream
        self.handler = handler
        self._out_send, self._out_recv = trio.open_memory_channel(math.inf)
        self._pending: dict[int, list] = {}
        self._ids = itertools.count(1)
        self.closed = trio.Event()
        self._nursery: trio.Nursery | None = None

    def send(self, msg: dict) -> None:
        """Queue one message (never blocks). Raises ChannelClosed once the link is closed."""
        if self.closed.is_set():
            raise ChannelClosed(f"{self.name}: closed")
        self._out_send.send_nowait(_encode(msg))

    async def request(self, msg: dict, *, timeout_s: float) -> dict:
        """Send ``msg`` with a fresh id and wait for the reply. Raises ChannelClosed,
        RemoteFailure, or trio.TooSlowError after ``timeout_s``."""
        rid = next(self._ids)
        slot: list[Any] = [trio.Event(), None]
        self._pending[rid] = slot
        try:
            self.send({**msg, "id": rid})
            with trio.fail_after(timeout_s):
                await slot[0].wait()
        finally:
            self._pending.pop(rid, None)
        reply = slot[1]
        if reply is None:
            raise ChannelClosed(f"{self.name}: closed before answering {msg.get('op')!r}")
        if "error" in reply:
            raise RemoteFailure(reply["error"])
        return reply

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Read and dispatch until the peer closes; then mark the link closed."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer, nursery.cancel_scope)
                task_status.started()
                try:
                    await self._reader()
                except _BROKEN as exc:
                    log.debug("%s: %s", self.name, exc)
                except ValueError as exc:  # not our framing/JSON: a bug on the other side
                    log.error("%s: bad control message, closing: %s", self.name, exc)
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._close()
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(self._stream)

    def _close(self) -> None:
        self.closed.set()
        self._out_send.close()
        for slot in list(self._pending.values()):
            slot[0].set()

    async def _writer(self, scope: trio.CancelScope) -> None:
        try:
            async for first in self._out_recv:
                batch = [first]
                while True:
                    try:
                        batch.append(self._out_recv.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                await self._stream.send_all(b"".join(batch))
        except _BROKEN as exc:  # the peer is gone: stop reading too
            log.debug("%s: %s", self.name, exc)
            scope.cancel()

    async def _reader(self) -> None:
        buf = bytearray()
        while True:
            data = await self._stream.receive_some(1 << 16)
            if not data:
                return
            buf += data
            while len(buf) >= 4:
                n = int.from_bytes(buf[:4], "big")
                if n > MAX_MESSAGE_BYTES:
                    raise trio.BrokenResourceError(f"{self.name}: message of {n} bytes")
                if len(buf) < 4 + n:
                    break
                msg = json.loads(bytes(buf[4:4 + n]))
                del buf[:4 + n]
                self._dispatch(msg)

    def _dispatch(self, msg: dict) -> None:
        re_id = msg.get("re")
        if re_id is not None:
            slot = self._pending.get(re_id)
            if slot is not None:
                slot[1] = msg
                slot[0].set()
            return
        rid = msg.get("id")
        try:
            reply = self.handler(msg)
        except Exception as exc:  # noqa: BLE001 - the peer gets the error text; we keep serving
            reply = self._failed(msg.get("op"), exc)
        if inspect.iscoroutine(reply):
            self._nursery.start_soon(self._answer_later, rid, msg.get("op"), reply)
            return
        self._answer(rid, reply)

    async def _answer_later(self, rid, op, coro) -> None:
        try:
            reply = await coro
        except Exception as exc:  # noqa: BLE001 - as _dispatch
            reply = self._failed(op, exc)
        self._answer(rid, reply)

    def _failed(self, op, exc: Exception) -> dict:
        """The error answer (a ValueError or KeyError is the peer's mistake; anything else is
        logged with its traceback)."""
        if not isinstance(exc, (ValueError, KeyError)):
            log.exception("%s: handling %r failed", self.name, op)
        return {"error": f"{type(exc).__name__}: {exc}"}

    def _answer(self, rid, reply) -> None:
        if rid is not None and not self.closed.is_set():
            self.send({**(reply or {}), "re": rid})


def read_config_message(fd: int) -> str:
    """The worker's first control message (``config``), read with a blocking socket before trio
    starts; what follows stays in the socket for ``Link.run``. Raises OSError or ValueError."""
    sock = socket.socket(fileno=fd)
    try:
        sock.setblocking(True)
        head = _read_exactly(sock, 4)
        n = int.from_bytes(head, "big")
        if n > MAX_MESSAGE_BYTES:
            raise ValueError(f"control message of {n} bytes")
        msg = json.loads(_read_exactly(sock, n))
    finally:
        sock.detach()   # the fd stays open for the link
    if msg.get("op") != "config" or not isinstance(msg.get("text"), str):
        raise ValueError(f"expected the config message first, got {msg.get('op')!r}")
    return msg["text"]


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise OSError("control channel closed before the config message")
        buf += chunk
    return bytes(buf)


class SharedCacheTier:
    """A worker's view of the supervisor's sticky cache, with the Redis tier's interface
    (``get``, ``write``, ``ping``, ``close``) but async; used by ``RouterService`` (shared tier).
    Every failure surfaces as ``CacheBackendError`` so the service degrades to its local tier."""

    def __init__(self, link: Link, router: str) -> None:
        self.link = link
        self.router = router

    async def _ask(self, msg: dict) -> dict:

        try:
            return await self.link.request(msg, timeout_s=30.0)  # the caller sets the real deadline
        except (ChannelClosed, RemoteFailure, trio.TooSlowError) as exc:
            raise CacheBackendError(f"supervisor cache: {exc}") from exc

    async def get(self, key: str) -> str | None:
        """The identity the supervisor holds for ``key`` (access time refreshed), or None."""
        return (await self._ask({"op": "cache_get", "router": self.router, "key": key})).get("value")

    async def write(self, puts, touches, deletes) -> dict[str, str]:
        """Compare-and-set puts ``(key, identity, replaced)``, touches, deletes; returns the
        ``{key: identity}`` of puts another worker won."""
        reply = await self._ask({"op": "cache_write", "router": self.router,
                                 "puts": [list(p) for p in puts], "touches": list(touches),
                                 "deletes": list(deletes)})
        return reply.get("conflicts") or {}

    async def ping(self) -> None:
        await self._ask({"op": "ping"})

    def close(self) -> None:
        """Nothing to release: the link belongs to the worker process."""
