"""Sans-IO AMQP 1.0 frames (§2.3) and the handshake performatives (Open, Close, SASL §5.3).

Theory of operation
-------------------
A connection starts with an 8-byte protocol header (§2.2): ``AMQP`` + protocol id (0 AMQP,
2 TLS, 3 SASL) + version 1.0.0. After it the stream is a sequence of frames (§2.3.1)::

    SIZE (4, total frame length) | DOFF (1, header length in 4-byte words, >= 2) | TYPE (1)
    | type-specific (2: the channel for AMQP frames, ignored for SASL) | extended header
    | body (from DOFF*4 to SIZE)

``FrameReader`` is fed bytes with ``receive_data()``; ``next_event()`` returns the next complete
``Frame`` or ``NEED_DATA``, and raises ``FramingError`` (``amqp:connection:framing-error``) on a
bad header or a frame larger than ``max_frame_bytes``. It can also hand out the 8-byte protocol
header with ``next_protocol_header()`` and give back unread bytes with ``take_leftover()``, so
the SASL layer and the sniffer can switch layers on the same stream without copying it twice.

Performatives are described lists (§1.4): ``decode_performative()`` turns a frame body into one of
the dataclasses below (unknown descriptors come back as the raw ``Described``); each dataclass
has ``to_described()`` and ``encode_frame()`` writes a frame. ``redirect_frames``,
``refuse_frames`` and ``close_frames`` build the complete byte strings the router and broker
write when they turn a connection away.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, fields
from dataclasses import replace as dataclasses_replace
from typing import Any, ClassVar
from urllib.parse import urlsplit

from broker.wire.codec import (
    Array,
    Described,
    Symbol,
    UByte,
    UInt,
    ULong,
    UShort,
    Int,
    decode,
    encode_into,
)
from broker.wire.errors import DecodeError, FramingError, LocalProtocolError

__all__ = [
    "AMQP_HEADER", "SASL_HEADER", "TLS_HEADER", "NEED_DATA", "FRAME_AMQP", "FRAME_SASL",
    "Frame", "FrameReader", "Open", "Close", "Error", "SaslMechanisms", "SaslInit",
    "SaslChallenge", "SaslResponse", "SaslOutcome", "decode_performative", "encode_frame",
    "redirect_frames", "refuse_frames", "close_frames", "CONNECTION_ESTABLISHMENT_FAILED",
    "failed_open", "artemis_redirect_description", "artemis_rejected_description",
    "artemis_not_ready_description", "ARTEMIS_FAILED_OPEN_CONTAINER_ID",
    "MIN_MAX_FRAME_SIZE", "FOLLOWS_REDIRECT", "CLUSTER_MEMBERS", "MAX_CLUSTER_MEMBERS",
    "REDIRECT", "FAILOVER_SERVER_LIST", "redirect_info", "failover_server_entries",
]

#: §2.2 protocol headers: "AMQP" + protocol-id + major + minor + revision.
AMQP_HEADER = b"AMQP\x00\x01\x00\x00"
TLS_HEADER = b"AMQP\x02\x01\x00\x00"
SASL_HEADER = b"AMQP\x03\x01\x00\x00"

FRAME_AMQP = 0x00
FRAME_SASL = 0x01

#: §2.7.1: every peer accepts frames of at least this size before negotiation.
MIN_MAX_FRAME_SIZE = 512

#: Open property Artemis (and Qpid clients) use to mark "this Open is followed by a Close".
CONNECTION_ESTABLISHMENT_FAILED = Symbol("amqp:connection-establishment-failed")


class _NeedData:
    """Sentinel: more bytes are needed before another event can be produced."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = _NeedData()

_HDR = struct.Struct(">IBBH")


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame (§2.3.1). ``body`` excludes the (extended) header; ``size`` is the whole frame.

    ``raw`` is the frame's complete wire bytes when the reader was built with ``keep_raw=True``.
    """

    type: int
    channel: int
    body: bytes
    size: int
    raw: bytes | None = None


class FrameReader:
    """Incremental frame parser (§2.3.1); see the module docstring."""

    def __init__(self, max_frame_bytes: int = 1 << 20, *, keep_raw: bool = False):
        if max_frame_bytes < 8:
            raise LocalProtocolError(f"max_frame_bytes {max_frame_bytes} must be >= 8")
        self.max_frame_bytes = max_frame_bytes
        self.keep_raw = keep_raw
        self._buf = bytearray()
        self._pos = 0
        #: Total bytes consumed from the stream (frames and headers handed out).
        self.consumed = 0

    # -- input ---------------------------------------------------------------------------------
    def receive_data(self, data: bytes) -> None:
        """Append bytes received from the peer."""
        if self._pos:
            # Compact lazily: only when the consumed prefix is large relative to the buffer.
            if self._pos >= len(self._buf) or self._pos > 65536:
                del self._buf[: self._pos]
                self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        """Number of received bytes not consumed yet."""
        return len(self._buf) - self._pos

    def peek(self, n: int) -> bytes:
        """Up to ``n`` unconsumed bytes, without consuming them."""
        return bytes(self._buf[self._pos : self._pos + n])

    def take_leftover(self) -> bytes:
        """Consume and return every buffered byte (for handing the stream to another layer)."""
        data = bytes(self._buf[self._pos :])
        self.consumed += len(data)
        self._buf.clear()
        self._pos = 0
        return data

    # -- output events -------------------------------------------------------------------------
    def next_protocol_header(self):
        """Consume and return the 8-byte protocol header (§2.2), or ``NEED_DATA``.

        Does not validate it: callers compare against the headers they accept.
        """
        if self.buffered < 8:
            return NEED_DATA
        p = self._pos
        hdr = bytes(self._buf[p : p + 8])
        self._pos = p + 8
        self.consumed += 8
        return hdr

    def next_event(self):
        """Return the next complete ``Frame`` or ``NEED_DATA``; raise ``FramingError``."""
        buf = self._buf
        p = self._pos
        avail = len(buf) - p
        if avail < 8:
            # A size field already over the limit is reported as soon as we can see it.
            if avail >= 4:
                self._check_size(int.from_bytes(buf[p : p + 4], "big"))
            return NEED_DATA
        size, doff, ftype, channel = _HDR.unpack_from(buf, p)
        self._check_size(size)
        if doff < 2:
            raise FramingError(f"frame data offset {doff} is below the minimum of 2")
        if doff * 4 > size:
            raise FramingError(f"frame data offset {doff * 4} bytes exceeds frame size {size}")
        if avail < size:
            return NEED_DATA
        end = p + size
        body = bytes(buf[p + doff * 4 : end])
        raw = bytes(buf[p:end]) if self.keep_raw else None
        self._pos = end
        self.consumed += size
        return Frame(ftype, channel, body, size, raw)

    def _check_size(self, size: int) -> None:
        if size < 8:
            raise FramingError(f"frame size {size} is below the 8-byte frame header")
        if size > self.max_frame_bytes:
            raise FramingError(
                f"frame of {size} bytes exceeds the maximum frame size of "
                f"{self.max_frame_bytes} bytes"
            )


# ---------------------------------------------------------------------------------------------
# Performatives
# ---------------------------------------------------------------------------------------------

# Field kinds: how a field is checked on decode and wrapped on encode.
_STRING, _SYMBOL, _UINT, _USHORT, _UBYTE, _BINARY, _MULTI_SYMBOL, _FIELDS, _MAP, _ERROR = range(10)
_RANGES = {_UINT: 0xFFFFFFFF, _USHORT: 0xFFFF, _UBYTE: 0xFF}
_WRAP = {_UINT: UInt, _USHORT: UShort, _UBYTE: UByte}


class _Performative:
    """Mixin: a described list whose fields follow the dataclass field order."""

    DESCRIPTOR: ClassVar[int]
    NAME: ClassVar[str]
    KINDS: ClassVar[tuple[int, ...]]
    MANDATORY: ClassVar[tuple[str, ...]] = ()

    def to_described(self) -> Described:
        """The performative as a ``Described`` value ready to encode (trailing nulls trimmed)."""
        values = []
        for name, kind in zip(_field_names(type(self)), self.KINDS):
            values.append(_wrap_field(getattr(self, name), kind, name, self.NAME))
        while values and values[-1] is None:
            values.pop()
        return Described(ULong(self.DESCRIPTOR), values)

    @classmethod
    def from_list(cls, items: list):
        """Build from the decoded list of a described value; ``DecodeError`` on bad fields."""
        names = _field_names(cls)
        if len(items) > len(names):
            # §1.4: extra trailing fields from a future version are tolerated only if null.
            if any(x is not None for x in items[len(names):]):
                raise DecodeError(f"{cls.NAME} has {len(items)} fields, at most {len(names)} known")
            items = items[: len(names)]
        kwargs = {}
        for name, kind, v in zip(names, cls.KINDS, items):
            kwargs[name] = _check_field(v, kind, name, cls.NAME)
        for name in cls.MANDATORY:
            if kwargs.get(name) is None:
                raise DecodeError(f"{cls.NAME}: mandatory field {name} is missing")
        return cls(**kwargs)


@functools.cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _check_field(v, kind: int, name: str, where: str):
    if v is None:
        return None
    bad = False
    if kind == _STRING:
        if isinstance(v, str):
            return str(v)
        bad = True
    elif kind == _SYMBOL:
        if isinstance(v, str):
            return Symbol(v)
        bad = True
    elif kind in _RANGES:
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= _RANGES[kind]:
            return int(v)
        bad = True
    elif kind == _BINARY:
        if isinstance(v, bytes):
            return v
        bad = True
    elif kind == _MULTI_SYMBOL:
        # §1.3 "multiple": a single value or an array of values.
        if isinstance(v, str):
            return (Symbol(v),)
        if isinstance(v, list) and all(isinstance(x, str) for x in v):
            return tuple(Symbol(x) for x in v)
        bad = True
    elif kind == _FIELDS:
        if isinstance(v, dict) and all(isinstance(k, Symbol) for k in v):
            return v
        bad = True
    elif kind == _MAP:
        if isinstance(v, dict):
            return v
        bad = True
    elif kind == _ERROR:
        if isinstance(v, Described) and _descriptor_key(v.descriptor) == Error.DESCRIPTOR:
            if not isinstance(v.value, list):
                raise DecodeError(f"{where}.{name}: error is not a list")
            return Error.from_list(v.value)
        bad = True
    if bad:
        raise DecodeError(f"{where}.{name}: unexpected value {v!r:.60}")
    return v  # pragma: no cover


def _wrap_field(v, kind: int, name: str, where: str):
    if v is None:
        return None
    if kind == _STRING:
        return str(v)
    if kind == _SYMBOL:
        return Symbol(v)
    if kind in _WRAP:
        if not 0 <= v <= _RANGES[kind]:
            raise LocalProtocolError(f"{where}.{name}: {v} out of range")
        return _WRAP[kind](v)
    if kind == _BINARY:
        return bytes(v)
    if kind == _MULTI_SYMBOL:
        if isinstance(v, str):
            v = (v,)
        return Array([Symbol(x) for x in v], code=0xA3)
    if kind == _FIELDS:
        return {Symbol(k): x for k, x in v.items()}
    if kind == _ERROR:
        return v.to_described()
    return v


@dataclass(frozen=True, slots=True)
class Error(_Performative):
    """§2.8.14 error: ``condition`` symbol, optional ``description`` and ``info`` map."""

    condition: str
    description: str | None = None
    info: dict | None = None

    DESCRIPTOR: ClassVar[int] = 0x1D
    NAME: ClassVar[str] = "error"
    KINDS: ClassVar[tuple[int, ...]] = (_SYMBOL, _STRING, _FIELDS)
    MANDATORY: ClassVar[tuple[str, ...]] = ("condition",)


@dataclass(frozen=True, slots=True)
class Open(_Performative):
    """§2.7.1 open. ``None`` means "absent" (the spec default applies: max-frame-size
    4294967295, channel-max 65535, no idle timeout). ``idle_time_out`` is in milliseconds."""

    container_id: str
    hostname: str | None = None
    max_frame_size: int | None = None
    channel_max: int | None = None
    idle_time_out: int | None = None
    outgoing_locales: tuple[Symbol, ...] | None = None
    incoming_locales: tuple[Symbol, ...] | None = None
    offered_capabilities: tuple[Symbol, ...] | None = None
    desired_capabilities: tuple[Symbol, ...] | None = None
    properties: dict | None = None

    DESCRIPTOR: ClassVar[int] = 0x10
    NAME: ClassVar[str] = "open"
    KINDS: ClassVar[tuple[int, ...]] = (
        _STRING, _STRING, _UINT, _USHORT, _UINT, _MULTI_SYMBOL, _MULTI_SYMBOL, _MULTI_SYMBOL,
        _MULTI_SYMBOL, _FIELDS,
    )
    MANDATORY: ClassVar[tuple[str, ...]] = ("container_id",)


@dataclass(frozen=True, slots=True)
class Close(_Performative):
    """§2.7.9 close, with an optional ``Error``."""

    error: Error | None = None

    DESCRIPTOR: ClassVar[int] = 0x18
    NAME: ClassVar[str] = "close"
    KINDS: ClassVar[tuple[int, ...]] = (_ERROR,)


@dataclass(frozen=True, slots=True)
class SaslMechanisms(_Performative):
    """§5.3.3.1 sasl-mechanisms: the mechanisms the server offers."""

    sasl_server_mechanisms: tuple[Symbol, ...]

    DESCRIPTOR: ClassVar[int] = 0x40
    NAME: ClassVar[str] = "sasl-mechanisms"
    KINDS: ClassVar[tuple[int, ...]] = (_MULTI_SYMBOL,)
    MANDATORY: ClassVar[tuple[str, ...]] = ("sasl_server_mechanisms",)


@dataclass(frozen=True, slots=True)
class SaslInit(_Performative):
    """§5.3.3.2 sasl-init: chosen ``mechanism``, ``initial_response``, ``hostname``."""

    mechanism: str
    initial_response: bytes | None = None
    hostname: str | None = None

    DESCRIPTOR: ClassVar[int] = 0x41
    NAME: ClassVar[str] = "sasl-init"
    KINDS: ClassVar[tuple[int, ...]] = (_SYMBOL, _BINARY, _STRING)
    MANDATORY: ClassVar[tuple[str, ...]] = ("mechanism",)


@dataclass(frozen=True, slots=True)
class SaslChallenge(_Performative):
    """§5.3.3.3 sasl-challenge."""

    challenge: bytes

    DESCRIPTOR: ClassVar[int] = 0x42
    NAME: ClassVar[str] = "sasl-challenge"
    KINDS: ClassVar[tuple[int, ...]] = (_BINARY,)
    MANDATORY: ClassVar[tuple[str, ...]] = ("challenge",)


@dataclass(frozen=True, slots=True)
class SaslResponse(_Performative):
    """§5.3.3.4 sasl-response."""

    response: bytes

    DESCRIPTOR: ClassVar[int] = 0x43
    NAME: ClassVar[str] = "sasl-response"
    KINDS: ClassVar[tuple[int, ...]] = (_BINARY,)
    MANDATORY: ClassVar[tuple[str, ...]] = ("response",)


@dataclass(frozen=True, slots=True)
class SaslOutcome(_Performative):
    """§5.3.3.5 sasl-outcome. ``code``: 0 ok, 1 auth, 2 sys, 3 sys-perm, 4 sys-temp."""

    code: int
    additional_data: bytes | None = None

    OK: ClassVar[int] = 0
    AUTH: ClassVar[int] = 1
    SYS: ClassVar[int] = 2
    SYS_PERM: ClassVar[int] = 3
    SYS_TEMP: ClassVar[int] = 4

    DESCRIPTOR: ClassVar[int] = 0x44
    NAME: ClassVar[str] = "sasl-outcome"
    KINDS: ClassVar[tuple[int, ...]] = (_UBYTE, _BINARY)
    MANDATORY: ClassVar[tuple[str, ...]] = ("code",)


_BY_CODE: dict[int, type] = {
    c.DESCRIPTOR: c
    for c in (Open, Close, Error, SaslMechanisms, SaslInit, SaslChallenge, SaslResponse, SaslOutcome)
}
# §1.4 descriptors may also be sent as their symbolic names.
_SYMBOLIC = {
    "amqp:open:list": 0x10, "amqp:close:list": 0x18, "amqp:error:list": 0x1D,
    "amqp:sasl-mechanisms:list": 0x40, "amqp:sasl-init:list": 0x41,
    "amqp:sasl-challenge:list": 0x42, "amqp:sasl-response:list": 0x43,
    "amqp:sasl-outcome:list": 0x44,
}
# Descriptor codes are "domain-id:descriptor-id" as a ulong; AMQP's own domain id is 0.


def _descriptor_key(desc) -> int | None:
    if isinstance(desc, int) and not isinstance(desc, bool):
        return int(desc)
    if isinstance(desc, str):
        return _SYMBOLIC.get(desc)
    return None


def decode_performative(body) -> Any:
    """Decode a frame body holding one performative.

    Returns the matching dataclass (``Open``, ``Close``, ``SaslInit``…), or the raw
    ``Described`` for a performative this module does not model (e.g. begin, attach). Trailing
    bytes after a modelled performative are a ``DecodeError`` (only transfer carries payload).
    An empty body (heartbeat) returns ``None``.
    """
    if not body:
        return None
    value, end = decode(body)
    if not isinstance(value, Described):
        raise DecodeError(f"frame body is not a performative (got {type(value).__name__})")
    cls = _BY_CODE.get(_descriptor_key(value.descriptor))
    if cls is None or cls is Error:
        return value
    if end != len(body):
        raise DecodeError(f"{len(body) - end} unexpected bytes after {cls.NAME}")
    if not isinstance(value.value, list):
        raise DecodeError(f"{cls.NAME} body is not a list")
    return cls.from_list(value.value)


def encode_frame(ftype: int, channel: int, performative=None, payload: bytes = b"") -> bytes:
    """Encode one frame (§2.3.1) with doff 2.

    ``performative`` is a performative dataclass, a ``Described`` value, or ``None`` for an
    empty frame (heartbeat, §2.4.5). ``payload`` is appended after it (transfer only).
    """
    if not 0 <= channel <= 0xFFFF:
        raise LocalProtocolError(f"channel {channel} out of range")
    out = bytearray(8)
    if performative is not None:
        if isinstance(performative, _Performative):
            performative = performative.to_described()
        encode_into(out, performative)
    out += payload
    _HDR.pack_into(out, 0, len(out), 2, ftype, channel)
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Turning a connection away
# ---------------------------------------------------------------------------------------------

# What Artemis writes when it turns an AMQP connection away (router redirect/refusal, failed
# login): ``AMQPConnectionContext.onRemoteOpen`` calls ``connection.close()`` without ``open()``,
# so ``setContainer`` never runs and proton-j's ``TransportImpl.processOpen`` writes
# ``container-id = ""`` (``cid == null ? "" : cid``), no hostname, the transport's
# ``max-frame-size`` (``AmqpSupport.MAX_FRAME_SIZE_DEFAULT`` 131072), ``channel-max``
# (``AMQPConstants.Connection.DEFAULT_CHANNEL_MAX`` 65535), ``idle-time-out`` = half the
# connection TTL (``ActiveMQDefaultConfiguration`` 60000 ms → 30000), and the properties set by
# ``AMQPRoutingHandler`` / ``validateUser``: ``{amqp:connection-establishment-failed: true}``.
ARTEMIS_FAILED_OPEN_CONTAINER_ID = ""
ARTEMIS_MAX_FRAME_SIZE = 131072
ARTEMIS_CHANNEL_MAX = 65535
ARTEMIS_IDLE_TIME_OUT_MS = 30000
DEFAULT_CONTAINER_ID = ARTEMIS_FAILED_OPEN_CONTAINER_ID


def artemis_redirect_description(router: str, host: str, port: int) -> str:
    """``AMQPRoutingHandler.redirect``: ``"Connection router %s redirected this connection to %s:%d"``."""
    return f"Connection router {router} redirected this connection to {host}:{int(port)}"


def artemis_rejected_description(router: str) -> str:
    """``AMQPRoutingHandler.refuse``, REFUSED_USE_ANOTHER: ``"Connection router %s rejected this connection"``."""
    return f"Connection router {router} rejected this connection"


def artemis_not_ready_description(router: str) -> str:
    """``AMQPRoutingHandler.refuse``, REFUSED_UNAVAILABLE: ``"Connection router %s is not ready"``."""
    return f"Connection router {router} is not ready"


def failed_open(container_id: str = ARTEMIS_FAILED_OPEN_CONTAINER_ID) -> Open:
    """The Open performative Artemis sends before the Close that turns a connection away."""
    return Open(container_id=container_id, max_frame_size=ARTEMIS_MAX_FRAME_SIZE,
                channel_max=ARTEMIS_CHANNEL_MAX, idle_time_out=ARTEMIS_IDLE_TIME_OUT_MS,
                properties={CONNECTION_ESTABLISHMENT_FAILED: True})


def _failed_open(container_id: str, hostname: str | None = None) -> bytes:
    # Artemis marks an Open that is immediately followed by a Close with this property so the
    # client reports the Close's error rather than "connection opened then dropped".
    op = failed_open(container_id)
    if hostname is not None:
        op = dataclasses_replace(op, hostname=hostname)
    return encode_frame(FRAME_AMQP, 0, op)


#: Desired capability (Open ``desired-capabilities``, §2.7.1) a client sends to say it follows
#: ``amqp:connection:redirect`` (Lodestone's client helpers do: ``router.client``,
#: ``clients/node/lodestone-redirect.js``). An ``auto`` acceptor may redirect such clients and
#: proxy the rest (``mode = "auto"``). A plain string: write it as an AMQP symbol.
FOLLOWS_REDIRECT = "lodestone:follows-redirect"

#: Open property of a cluster node (connections it accepts): the cluster's live members, a list
#: of maps ``{"node-id": str, "connector": "amqp://host:port"}``, the answering node first, at
#: most :data:`MAX_CLUSTER_MEMBERS` entries (docs/cluster.md, "Topology to clients";
#: ``router.client.topology`` reads it). A plain string: written as an AMQP symbol.
#: addresses only the broker itself serves (the cluster's links); a client cannot send to, read
#: from or create them: an attach to one goes to the internal service the engine's host registered for it
INTERNAL_PREFIX = "$lodestone."
#: a mirror link's target address starts so (Artemis's AMQP mirror; broker.connections.mirror_wire):
#: like INTERNAL_PREFIX, the engine hands such an attach to the service registered for it
MIRROR_PREFIX = "$ACTIVEMQ_ARTEMIS_MIRROR"
#: longest JMS selector (``apache.org:selector-filter:string``) accepted, in UTF-8 bytes
MAX_SELECTOR_BYTES = 64 * 1024
CLUSTER_MEMBERS = "lodestone:cluster-members"
MAX_CLUSTER_MEMBERS = 256


REDIRECT = "amqp:connection:redirect"
FAILOVER_SERVER_LIST = "failover-server-list"


def failover_server_entries(connectors) -> list:
    """Artemis's ``failover-server-list`` entries (``AMQPConnectionContext``, an Open property;
    also in our redirects) for connectors ``amqp[s]://host:port`` — others are left out: maps
    with the symbol keys ``network-host``, ``scheme``, ``hostname``, ``port``."""
    out = []
    for c in connectors:
        parts = urlsplit(c)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.hostname and port:
            out.append({Symbol("network-host"): parts.hostname, Symbol("scheme"): parts.scheme,
                        Symbol("hostname"): parts.hostname, Symbol("port"): Int(port)})
    return out


def redirect_info(host: str, port: int, *, hostname: str | None = None, failover=()) -> dict:
    """The info map of an ``amqp:connection:redirect`` error (§2.8.17), as Artemis writes it
    and the router and the broker send it: ``{port, network-host}``, plus ``hostname`` (the
    virtual host for the client's Open) when given, plus ``failover-server-list`` (entries of
    :func:`failover_server_entries` for the ``failover`` connectors: the new node's backups)
    when there are any. Values are codec types (:mod:`broker.wire.codec`)."""
    # Key order as Artemis puts them on the wire: AMQPRoutingHandler fills a java.util.HashMap,
    # whose iteration order (bucket = String.hashCode spread, 16 buckets) is "port" (5) then
    # "network-host" (7); proton-j encodes the map in that order.
    info: dict = {Symbol("port"): Int(port), Symbol("network-host"): str(host)}
    if hostname is not None:
        info[Symbol("hostname")] = str(hostname)
    entries = failover_server_entries(failover)
    if entries:
        info[Symbol(FAILOVER_SERVER_LIST)] = entries
    return info


def redirect_frames(
    host: str,
    port: int,
    description: str,
    hostname: str | None = None,
    container_id: str = DEFAULT_CONTAINER_ID,
    *,
    include_header: bool = True,
) -> bytes:
    """Bytes of an Artemis-style native redirect (§2.8.17 ``amqp:connection:redirect``).

    AMQP header (unless ``include_header`` is false) + Open with properties
    ``{amqp:connection-establishment-failed: true}`` + Close whose error has condition
    ``amqp:connection:redirect``, ``description`` and info ``{network-host: host, port: port}``
    (plus ``hostname`` — the virtual host the client should put in its Open — only when given).
    """
    err = Error(Symbol(REDIRECT), description, redirect_info(host, port, hostname=hostname))
    return (
        (AMQP_HEADER if include_header else b"")
        + _failed_open(container_id)
        + encode_frame(FRAME_AMQP, 0, Close(err))
    )


def refuse_frames(
    condition: str,
    description: str,
    container_id: str = DEFAULT_CONTAINER_ID,
    *,
    include_header: bool = True,
) -> bytes:
    """Bytes that refuse a connection: AMQP header + failed-establishment Open + Close(error)."""
    return (
        (AMQP_HEADER if include_header else b"")
        + _failed_open(container_id)
        + encode_frame(FRAME_AMQP, 0, Close(Error(Symbol(condition), description)))
    )


def close_frames(
    condition: str,
    description: str,
    *,
    header_sent: bool = False,
    open_sent: bool = False,
    container_id: str = DEFAULT_CONTAINER_ID,
) -> bytes:
    """Bytes that close a connection with an error after the peer misbehaved.

    §2.4.1/§2.7.9: a Close must follow our Open, and frames must follow our protocol header, so
    whatever of header and Open we have not sent yet is written first (the Open marked with
    ``amqp:connection-establishment-failed``).
    """
    out = b"" if header_sent else AMQP_HEADER
    if not open_sent:
        out += _failed_open(container_id)
    return out + encode_frame(FRAME_AMQP, 0, Close(Error(Symbol(condition), description)))
