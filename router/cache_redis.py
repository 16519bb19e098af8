"""Redis tier of the sticky cache, shared by every router replica (redis-py, blocking calls).

The shell calls these methods from worker threads (``trio.to_thread.run_sync``) under a short
deadline; every Redis error surfaces as ``CacheBackendError`` and the router carries on from its
local tier (degraded). Keys are ``<prefix><router>:<key>``; values are target identities (node
ids). Expiry is Redis's: ``PX timeout`` on write, ``GETEX PX`` on read and batched ``PEXPIRE``
for keys hit in the local tier (expire after access); ``timeout = 0`` means no TTL.

Reads on a local miss do not take a thread: ``PipelinedRedisReader`` (below) carries every
concurrent read of the process on one persistent trio connection (see its docstring for why).

Writes use a compare-and-set script so replicas converge: a write wins only if the key is
absent, already holds our value, or holds the value we replaced (a dead node); otherwise Redis
keeps the other replica's choice and returns it, and the caller adopts it locally.
"""

from __future__ import annotations

import errno
import os
import socket
from collections import deque
from typing import Iterable

import logging

import redis
import trio

from router.errors import CacheBackendError, CacheBackendTimeout
from router.resp import NEED_DATA, RespError, RespParser, encode_command
from router.net.fastio import connect_tcp
from redis.connection import SSLConnection, parse_url

log = logging.getLogger("lodestone.router.redis")

_CAS = """
local cur = redis.call('GET', KEYS[1])
if (not cur) or cur == ARGV[1] or cur == ARGV[2] then
  if ARGV[3] ~= '0' then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  else
    redis.call('SET', KEYS[1], ARGV[1])
  end
  return false
end
if ARGV[3] ~= '0' then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return cur
"""


class RedisCache:
    """Blocking Redis client for one router's shared cache."""

    def __init__(self, url: str, *, router: str, prefix: str = "lodestone:",
                 timeout_ms: int = 0, socket_timeout_s: float = 0.25,
                 connect_timeout_s: float | None = None) -> None:
        self.prefix = f"{prefix}{router}:"
        self.timeout_ms = timeout_ms
        self.client = redis.Redis.from_url(
            url, socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s if connect_timeout_s is None else connect_timeout_s,
            decode_responses=True, retry_on_timeout=False, health_check_interval=0,
            encoding_errors="surrogatepass")  # keys are Python str: lone surrogates round trip
        self._cas = self.client.register_script(_CAS)
        #: the thread-free read path (None for rediss://: reads then use ``get`` in a thread)
        try:
            self.reader: PipelinedRedisReader | None = PipelinedRedisReader(
                url, prefix=self.prefix, timeout_ms=timeout_ms,
                connect_timeout_s=socket_timeout_s if connect_timeout_s is None else connect_timeout_s)
        except ValueError:
            self.reader = None

    def _k(self, key: str) -> str:
        return self.prefix + key

    def get(self, key: str) -> str | None:
        """The identity stored for ``key`` (refreshing its TTL), or None."""
        try:
            if self.timeout_ms:
                return self.client.getex(self._k(key), px=self.timeout_ms)
            return self.client.get(self._k(key))
        except redis.RedisError as exc:
            raise CacheBackendError(f"redis GET failed: {exc}") from exc

    def write(self, puts: Iterable[tuple[str, str, str]], touches: Iterable[str],
              deletes: Iterable[str]) -> dict[str, str]:
        """One pipelined batch: ``puts`` = (key, identity, replaced identity or "").

        Returns ``{key: identity}`` for puts that lost to another replica's live value.
        """
        puts = list(puts)
        px = str(self.timeout_ms)
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, ident, old in puts:
                self._cas(keys=[self._k(key)], args=[ident, old or "", px], client=pipe)
            if self.timeout_ms:
                for key in touches:
                    pipe.pexpire(self._k(key), self.timeout_ms)
            for key in deletes:
                pipe.delete(self._k(key))
            results = pipe.execute()
        except redis.RedisError as exc:
            raise CacheBackendError(f"redis write failed: {exc}") from exc
        return {key: res for (key, _, _), res in zip(puts, results) if res}

    def ping(self) -> None:
        try:
            self.client.ping()
        except redis.RedisError as exc:
            raise CacheBackendError(f"redis PING failed: {exc}") from exc

    def entries(self, limit: int = 1000) -> dict[str, str]:
        """Up to ``limit`` shared entries (management/debug)."""
        try:
            out = {}
            for k in self.client.scan_iter(match=self.prefix + "*", count=200):
                v = self.client.get(k)
                if v is not None:
                    out[k[len(self.prefix):]] = v
                if len(out) >= limit:
                    break
            return out
        except redis.RedisError as exc:
            raise CacheBackendError(f"redis SCAN failed: {exc}") from exc

    def close(self) -> None:
        try:
            self.client.close()
        except redis.RedisError:
            pass


class _Slot:
    __slots__ = ("done", "value", "error", "event")

    def __init__(self) -> None:
        self.done = False
        self.value = None
        self.error: str | None = None
        self.event = trio.Event()


class PipelinedRedisReader:
    """The read path (``GET``/``GETEX``) on one connection to Redis, pipelined, no thread.

    Why (measured with ``loadtest/bench_redis_tier.py``, see docs/router.md): the blocking client
    read from a worker thread per call; under connection load the event loop holds the GIL most
    of the time and each such thread needs it several times per call, handed over at most every
    5 ms (``sys.getswitchinterval``), so a healthy local Redis "timed out" at 50 ms. And the
    deadline measured the wait in the event loop's run queue as much as Redis: a reply that had
    arrived in time still timed out if the waiting task ran late.

    Here every concurrent read of the process shares one persistent non-blocking socket: the
    command is written at once, replies come back in order (RESP), and one reader task
    (:meth:`run`, in the service's nursery) waits for the socket and wakes every caller whose
    reply came, all in the same scheduling round. (Without ``run`` — an embedder — callers take
    turns reading under a lock; handing that lock from task to task costs one scheduling round
    per waiting caller, which is why the service runs the reader task.) A reader whose
    deadline passed first reads what the socket already holds (without waiting): only a reply
    that really is not there is a timeout. A reader that gave up leaves its slot, so its late
    reply is read and dropped and the order stays right. Any connection error fails every read in
    flight; the next read reconnects (``connect_timeout_s``).

    ``rediss://`` is not handled here (the caller keeps the threaded client for it).
    """

    def __init__(self, url: str, *, prefix: str, timeout_ms: int, connect_timeout_s: float) -> None:

        kw = parse_url(url)
        if kw.get("connection_class") is SSLConnection:
            raise ValueError("rediss:// is served by the threaded client")
        self._path = kw.get("path")
        self._host = kw.get("host", "localhost")
        self._port = int(kw.get("port", 6379))
        self._db = int(kw.get("db", 0) or 0)
        self._username = kw.get("username")
        self._password = kw.get("password")
        self.prefix = prefix
        self.timeout_ms = timeout_ms
        self.connect_timeout_s = connect_timeout_s
        #: trio time of the last reply (or connect): tells a slow Redis from a silent one
        self.last_reply_at = 0.0
        self._sock: socket.socket | None = None
        self._parser = RespParser()
        self._pending: "deque[_Slot]" = deque()
        self._outbuf = bytearray()
        self._send_lock = trio.Lock()
        self._recv_lock = trio.Lock()
        self._connect_lock = trio.Lock()
        self._running = False
        self._connected = trio.Event()

    # -- connection ------------------------------------------------------------------------------
    async def _open_socket(self) -> socket.socket:
        if self._path:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                err = sock.connect_ex(self._path)
                if err in (errno.EINPROGRESS, errno.EAGAIN):
                    await trio.lowlevel.wait_writable(sock)
                    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, os.strerror(err))
            except BaseException:
                trio.lowlevel.notify_closing(sock)
                sock.close()
                raise
            return sock

        infos = await trio.socket.getaddrinfo(self._host, self._port, type=socket.SOCK_STREAM)
        last: OSError = OSError(f"{self._host} has no address")
        for family, _t, _p, _c, sockaddr in infos:
            try:
                return await connect_tcp(family, sockaddr)
            except OSError as exc:
                last = exc
        raise last

    async def _connect(self) -> socket.socket:
        async with self._connect_lock:
            if self._sock is not None:
                return self._sock
            try:
                with trio.fail_after(self.connect_timeout_s):
                    sock = await self._open_socket()
                    try:
                        await self._setup(sock)
                    except BaseException:
                        trio.lowlevel.notify_closing(sock)
                        sock.close()
                        raise
            except trio.TooSlowError:
                raise CacheBackendError(
                    f"redis connect timeout after {self.connect_timeout_s * 1000:.0f} ms") from None
            except OSError as exc:
                raise CacheBackendError(f"redis connect failed: {exc}") from exc
            self._sock = sock
            self._parser = RespParser()
            self.last_reply_at = trio.current_time()
            self._connected.set()
            return sock

    async def _setup(self, sock: socket.socket) -> None:
        """AUTH / SELECT as the URL asks (before any read shares the connection)."""
        hello, n = b"", 0
        if self._password:
            hello += (encode_command("AUTH", self._username, self._password) if self._username
                      else encode_command("AUTH", self._password))
            n += 1
        if self._db:
            hello += encode_command("SELECT", self._db)
            n += 1
        if not n:
            return
        await self._send(sock, hello)
        parser = RespParser()
        while n:
            ev = parser.next_event()
            if ev is NEED_DATA:
                await trio.lowlevel.wait_readable(sock)
                data = sock.recv(65536)
                if not data:
                    raise OSError(errno.ECONNRESET, "redis closed the connection")
                parser.receive_data(data)
                continue
            if isinstance(ev, RespError):
                raise CacheBackendError(f"redis refused the connection setup: {ev}")
            n -= 1

    @staticmethod
    async def _send(sock: socket.socket, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[sock.send(view):]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)

    async def _flush(self, sock: socket.socket) -> None:
        """Write ``_outbuf`` (under ``_send_lock``); cancellation leaves the rest queued."""
        while self._outbuf and self._sock is sock:
            try:
                n = sock.send(self._outbuf)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                continue
            except OSError as exc:
                self._fail(sock, f"redis write failed: {exc}")
                return
            del self._outbuf[:n]

    def _fail(self, sock: socket.socket, why: str) -> None:
        if self._sock is sock:
            self._sock = None
            self._outbuf = bytearray()
            self._connected = trio.Event()
            pending, self._pending = self._pending, deque()
            for slot in pending:
                slot.done = True
                slot.error = why
                slot.event.set()
            trio.lowlevel.notify_closing(sock)
            sock.close()

    def _drain(self, sock: socket.socket) -> None:
        """Read whatever the socket holds now (never waits) and hand out complete replies."""
        while self._sock is sock:
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as exc:
                self._fail(sock, f"redis read failed: {exc}")
                return
            if not data:
                self._fail(sock, "redis closed the connection")
                return
            parser = self._parser
            parser.receive_data(data)
            try:
                while True:
                    ev = parser.next_event()
                    if ev is NEED_DATA:
                        break
                    s = self._pending.popleft()
                    s.value = ev
                    s.done = True
                    s.event.set()
                    self.last_reply_at = trio.current_time()
            except (ValueError, IndexError) as exc:
                self._fail(sock, f"redis protocol error: {exc}")
                return

    # -- the read --------------------------------------------------------------------------------
    async def get(self, key: str, timeout_s: float) -> str | None:
        """The identity stored for ``key`` (refreshing its TTL), or None. Raises
        ``CacheBackendTimeout`` when Redis has not answered ``timeout_s`` after the call (the
        connect, when one is needed, has its own ``connect_timeout_s``), ``CacheBackendError``
        for anything else."""
        sock = self._sock or await self._connect()
        sent_at = trio.current_time()
        deadline = sent_at + timeout_s
        k = self.prefix + key
        cmd = (encode_command("GETEX", k, "PX", self.timeout_ms) if self.timeout_ms
               else encode_command("GET", k))
        slot = _Slot()
        # No lock and no yield on the way out: a lock taken per command costs a scheduling
        # round per waiting caller (trio's Lock checkpoints while held), which under load was
        # itself longer than the deadline. Commands are whole and in order in the socket or,
        # if it is full (rare: a few dozen bytes each), in ``_outbuf`` behind it.
        self._pending.append(slot)
        if self._outbuf:
            self._outbuf += cmd
        else:
            try:
                n = sock.send(cmd)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                n = len(cmd)
                self._fail(sock, f"redis write failed: {exc}")
            if n < len(cmd):
                self._outbuf += cmd[n:]
        if self._outbuf and not slot.done:
            with trio.move_on_at(deadline):
                async with self._send_lock:
                    await self._flush(sock)
        with trio.move_on_at(deadline):
            if self._running:
                await slot.event.wait()
            while not slot.done:
                self._drain(sock)
                if slot.done:
                    break
                async with self._recv_lock:
                    if slot.done or self._sock is not sock:
                        break
                    self._drain(sock)
                    if not slot.done and self._sock is sock:
                        await trio.lowlevel.wait_readable(sock)
        if not slot.done:
            self._drain(sock)  # a reply that arrived while this task waited to run is in time
        if not slot.done:
            exc = CacheBackendTimeout(f"redis timeout after {timeout_s * 1000:.0f} ms")
            # nothing at all came back while we waited: Redis is not answering (hung, gone),
            # as opposed to answering the commands ahead of ours late
            exc.silent = self.last_reply_at <= sent_at
            raise exc
        if slot.error is not None:
            raise CacheBackendError(slot.error)
        value = slot.value
        if isinstance(value, RespError):
            raise CacheBackendError(f"redis GET failed: {value}")
        if value is None:
            return None
        if isinstance(value, bytes):
            return value.decode("utf-8", "surrogatepass")
        raise CacheBackendError(f"redis GET answered {type(value).__name__}")

    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The reader task: connect now (so the first misses do not pay for it), then read
        replies as they come and wake their callers. Never returns; connection errors only
        fail the reads in flight (the next read reconnects)."""
        self._running = True
        try:
            try:
                await self._connect()
            except CacheBackendError as exc:
                log.info("redis not reachable yet: %s", exc)
            task_status.started()
            while True:
                sock = self._sock
                if sock is None:
                    await self._connected.wait()
                    continue
                try:
                    await trio.lowlevel.wait_readable(sock)
                except (trio.ClosedResourceError, OSError):
                    continue  # failed and closed meanwhile
                self._drain(sock)
        finally:
            self._running = False
            for slot in self._pending:  # nobody reads for them any more
                slot.event.set()

    async def aclose(self) -> None:
        if self._sock is not None:
            self._fail(self._sock, "closed")
