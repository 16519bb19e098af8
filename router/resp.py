"""A sans-IO codec for the subset of RESP2 (the Redis protocol) the router's read path uses.

Theory of operation
-------------------
``encode_command(*args)`` gives the bytes of one command (an array of bulk strings).
``RespParser`` is fed bytes with ``receive_data`` and hands out one reply per ``next_event()``
call, or ``NEED_DATA``: simple strings (``str``), errors (``RespError``, not raised: a reply),
integers, bulk strings (``bytes``, ``None`` for nil) and arrays (``list``, ``None`` for nil).
Replies come in the order the commands were sent, which is what lets one connection carry many
commands at once (pipelining). A malformed reply raises ``ValueError``. No socket, clock or trio
here; the shell is ``router.cache_redis.PipelinedRedisReader``.
"""

from __future__ import annotations

NEED_DATA = object()
_MAX_BULK = 64 * 1024 * 1024


class RespError(str):
    """An error reply (``-ERR …``)."""


def _arg(a) -> bytes:
    if isinstance(a, bytes):
        return a
    if isinstance(a, int):
        return str(a).encode("ascii")
    return a.encode("utf-8", "surrogatepass")  # keys are Python str: lone surrogates round trip


def encode_command(*args) -> bytes:
    """``*<n>\\r\\n`` then ``$<len>\\r\\n<arg>\\r\\n`` per argument."""
    parts = [b"*%d\r\n" % len(args)]
    for a in args:
        b = _arg(a)
        parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


class RespParser:
    """Incremental RESP2 reply parser (see the module docstring)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def receive_data(self, data: bytes) -> None:
        self._buf += data

    def next_event(self):
        """One complete reply, or ``NEED_DATA``."""
        got = self._parse(0)
        if got is None:
            return NEED_DATA
        value, end = got
        del self._buf[:end]
        return value

    def _line(self, pos: int):
        end = self._buf.find(b"\r\n", pos)
        if end < 0:
            return None
        return bytes(self._buf[pos:end]), end + 2

    def _parse(self, pos: int):
        if pos >= len(self._buf):
            return None
        kind = self._buf[pos]
        got = self._line(pos + 1)
        if got is None:
            return None
        line, pos = got
        if kind == 0x2B:  # +
            return line.decode("utf-8", "surrogatepass"), pos
        if kind == 0x2D:  # -
            return RespError(line.decode("utf-8", "replace")), pos
        if kind == 0x3A:  # :
            return int(line), pos
        if kind == 0x24:  # $
            n = int(line)
            if n < 0:
                return None, pos
            if n > _MAX_BULK:
                raise ValueError(f"bulk string of {n} bytes")
            if len(self._buf) < pos + n + 2:
                return None
            if self._buf[pos + n:pos + n + 2] != b"\r\n":
                raise ValueError("bulk string not terminated by CRLF")
            return bytes(self._buf[pos:pos + n]), pos + n + 2
        if kind == 0x2A:  # *
            n = int(line)
            if n < 0:
                return None, pos
            items = []
            for _ in range(n):
                got = self._parse(pos)
                if got is None:
                    return None
                value, pos = got
                items.append(value)
            return items, pos
        raise ValueError(f"unknown RESP type byte {kind!r}")
