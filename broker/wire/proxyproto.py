"""Sans-IO PROXY protocol version 2 (HAProxy's ``proxy-protocol.txt``, section 2.2): parse and build.

Theory of operation
-------------------
A proxy that opens a TCP connection on behalf of a client may write, before anything else, a
binary header naming the client's real address. The router writes one on every upstream
connection of an acceptor with ``upstream-proxy-protocol = true``; the broker reads it on
connections from the addresses its acceptor trusts (``proxy-protocol-from``).

The header is 16 fixed bytes and an address block::

    12 bytes signature  \\r\\n\\r\\n\\x00\\r\\nQUIT\\n
    1 byte  version (high nibble, 2) and command (low nibble: 0 LOCAL, 1 PROXY)
    1 byte  family (high nibble: 0 UNSPEC, 1 INET, 2 INET6, 3 UNIX) and transport (low: 1 STREAM)
    2 bytes length of the rest, big-endian
    INET:  4 + 4 + 2 + 2 bytes (source address, destination address, source port, destination port)
    INET6: 16 + 16 + 2 + 2 bytes
    then TLVs (skipped: we neither need nor trust them)

:class:`ProxyHeaderReader` takes bytes with ``receive_data`` and answers ``next_event()`` with
``NEED_DATA`` or a :class:`ProxyHeader` whose ``leftover`` holds the bytes after the header
(the client's first AMQP bytes). Anything else — a PROXY v1 text header, another protocol, a
version other than 2, a command or family we do not accept, a length too short for the
family — raises :class:`ProxyProtocolError` (a ``RemoteProtocolError``) as soon as the bytes
seen prove it. A ``LOCAL`` header (the proxy's own health check) carries no address:
``ProxyHeader.source`` is None and the connection's own peer address stands.

:func:`build_header` writes a PROXY (TCP over IPv4/IPv6) or LOCAL header. No I/O here.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass

from broker.wire.frames import NEED_DATA
from broker.wire.errors import RemoteProtocolError

__all__ = ["SIGNATURE", "ProxyHeader", "ProxyHeaderReader", "ProxyProtocolError", "build_header",
           "parse_header", "NEED_DATA", "MAX_HEADER_BYTES"]

SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
_V1_PREFIX = b"PROXY "
_CMD_LOCAL, _CMD_PROXY = 0x0, 0x1
_AF_UNSPEC, _AF_INET, _AF_INET6, _AF_UNIX = 0x0, 0x1, 0x2, 0x3
_STREAM = 0x1
_ADDR_LEN = {_AF_INET: 12, _AF_INET6: 36}
#: 16 fixed bytes + the largest length the 16-bit field allows; we refuse larger TLV blocks
#: than this much earlier (a router sends none).
MAX_HEADER_BYTES = 16 + 1024


class ProxyProtocolError(RemoteProtocolError):
    """The bytes are not a PROXY v2 header we accept. The shell closes the connection."""

    condition = "amqp:connection:framing-error"


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    """A parsed header. ``source``/``destination`` are ``(ip, port)`` or None for LOCAL."""

    source: tuple[str, int] | None
    destination: tuple[str, int] | None
    leftover: bytes = b""
    length: int = 0  # bytes the header took

    @property
    def source_text(self) -> str | None:
        """``host:port`` (``[v6]:port``), the format of a connection's ``source``."""
        if self.source is None:
            return None
        host, port = self.source
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def build_header(source: tuple[str, int] | None, destination: tuple[str, int] | None = None) -> bytes:
    """A PROXY v2 header for a TCP connection from ``source`` to ``destination``.

    ``source`` None builds a LOCAL header (no address). Both addresses must be of one family;
    a missing ``destination`` is the unspecified address of the source's family, port 0.
    """
    if source is None:
        return SIGNATURE + bytes([0x20 | _CMD_LOCAL, 0x00]) + b"\x00\x00"
    src = ipaddress.ip_address(source[0])
    if destination is None:
        dst = ipaddress.ip_address("::" if src.version == 6 else "0.0.0.0")
        dport = 0
    else:
        dst = ipaddress.ip_address(destination[0])
        dport = destination[1]
    if isinstance(src, ipaddress.IPv6Address) and src.ipv4_mapped is not None and dst.version == 4:
        src = src.ipv4_mapped
    if isinstance(dst, ipaddress.IPv6Address) and dst.ipv4_mapped is not None and src.version == 4:
        dst = dst.ipv4_mapped
    if src.version != dst.version:
        # mixed families (an IPv6 client reaching an IPv4-only proxy socket): map to IPv6
        src = src if src.version == 6 else ipaddress.IPv6Address(f"::ffff:{src}")
        dst = dst if dst.version == 6 else ipaddress.IPv6Address(f"::ffff:{dst}")
    fam = _AF_INET if src.version == 4 else _AF_INET6
    body = src.packed + dst.packed + struct.pack(">HH", source[1], dport)
    return SIGNATURE + bytes([0x20 | _CMD_PROXY, (fam << 4) | _STREAM]) + struct.pack(">H", len(body)) + body


def _fail(description: str) -> ProxyProtocolError:
    return ProxyProtocolError(f"PROXY protocol: {description}")


class ProxyHeaderReader:
    """Incremental reader of one PROXY v2 header (see the module docstring)."""

    def __init__(self, max_header_bytes: int = MAX_HEADER_BYTES):
        self._buf = bytearray()
        self._max = max_header_bytes
        self._done = False

    def receive_data(self, data: bytes) -> None:
        self._buf += data

    @property
    def needed(self) -> int:
        """How many more bytes complete the header as far as we know (read exactly that many, so
        not one byte of the protocol that follows is consumed)."""
        if len(self._buf) < 16:
            return 16 - len(self._buf)
        return max(16 + struct.unpack_from(">H", self._buf, 14)[0] - len(self._buf), 0)

    def next_event(self):
        """``NEED_DATA`` or the :class:`ProxyHeader`; raises :class:`ProxyProtocolError`."""
        if self._done:
            raise _fail("header already read")
        buf = self._buf
        n = min(len(buf), len(SIGNATURE))
        if buf[:n] != SIGNATURE[:n]:
            if buf[:min(len(buf), len(_V1_PREFIX))] == _V1_PREFIX[:min(len(buf), len(_V1_PREFIX))]:
                if len(buf) < len(_V1_PREFIX):
                    return NEED_DATA
                raise _fail("version 1 (text) header; only version 2 is accepted")
            raise _fail("no PROXY v2 signature at the start of the connection")
        if len(buf) < 16:
            return NEED_DATA
        ver_cmd, fam_proto, length = buf[12], buf[13], struct.unpack_from(">H", buf, 14)[0]
        if ver_cmd >> 4 != 2:
            raise _fail(f"version {ver_cmd >> 4}, only 2 is accepted")
        cmd = ver_cmd & 0x0F
        if cmd not in (_CMD_LOCAL, _CMD_PROXY):
            raise _fail(f"unknown command 0x{cmd:x}")
        total = 16 + length
        if total > self._max:
            raise _fail(f"header of {total} bytes exceeds {self._max}")
        fam, proto = fam_proto >> 4, fam_proto & 0x0F
        if cmd == _CMD_PROXY:
            if fam not in _ADDR_LEN:
                raise _fail(f"address family 0x{fam:x} not supported (TCP over IPv4/IPv6 only)")
            if proto != _STREAM:
                raise _fail(f"transport 0x{proto:x} is not STREAM")
            if length < _ADDR_LEN[fam]:
                raise _fail(f"length {length} too short for its address family")
        if len(buf) < total:
            return NEED_DATA
        self._done = True
        leftover = bytes(buf[total:])
        if cmd == _CMD_LOCAL:
            return ProxyHeader(None, None, leftover, total)
        if fam == _AF_INET:
            src = str(ipaddress.IPv4Address(bytes(buf[16:20])))
            dst = str(ipaddress.IPv4Address(bytes(buf[20:24])))
            sport, dport = struct.unpack_from(">HH", buf, 24)
        else:
            s6 = ipaddress.IPv6Address(bytes(buf[16:32]))
            d6 = ipaddress.IPv6Address(bytes(buf[32:48]))
            src = str(s6.ipv4_mapped or s6)
            dst = str(d6.ipv4_mapped or d6)
            sport, dport = struct.unpack_from(">HH", buf, 48)
        return ProxyHeader((src, sport), (dst, dport), leftover, total)


def parse_header(data: bytes):
    """Parse a complete buffer: ``NEED_DATA`` or a :class:`ProxyHeader` (raises on bad input)."""
    r = ProxyHeaderReader()
    r.receive_data(data)
    return r.next_event()
