"""The cluster link's wire format: forwarded messages and binding notifications (sans-IO).

Theory of operation
-------------------
Two nodes of a cluster talk AMQP 1.0 over a *cluster connection* that one of them dials (the
bridge, :mod:`broker.cluster.bridge`), logged in with the cluster credential. On it the dialling
node attaches two links to addresses only the cluster user may use:

* ``$lodestone.cluster.forward`` — a sending link: every message this node forwards to the other,
  one transfer each (Artemis: the bridge's producer on the remote store-and-forward address);
* ``$lodestone.cluster.notifications`` — a receiving link: the other node's *binding
  notifications* (Artemis: the bridge's consumer on the management notification address), so
  the dialling node learns which queues the other has, with their filters and consumers.

A transfer on the forward link carries one or more **forwarded messages** back to back (a
bridge puts whatever it has to send in one transfer; the receiving node's acknowledgement covers
them all). A forwarded message is one AMQP value, a described list:

``lodestone:forward:v1`` [dup-id (binary), origin node id (string), address (string),
targets (list of [node id, queue] pairs), hops (uint), durable (bool), priority (ubyte),
expires (timestamp, 0: never), message (binary: the producer's encoded message, byte for byte)
[, create [, moved]]]

where the optional tenth field ``create`` (scale-down only; else null when ``moved`` follows) is
[routing type, filter (string or null)]: the receiving node creates a missing target queue with
that routing type and filter (Artemis's scale-down creates the queues it moves messages to); the
optional eleventh, ``moved`` (boolean), says the message was stored on the sending node already
and is moving (redistribution, scale-down): its ``_AMQ_DUPL_ID`` is checked only against the
copies the receiving queue holds (``DuplicateIds.holds``; Artemis skips the producer's duplicate
id for a bridged message, ``PostOfficeImpl.checkDuplicateID``).

so the message itself crosses untouched (its header, annotations, properties and body), and what
the sending node decided rides beside it (Artemis's ``_AMQ_ROUTE_TO`` queue ids and
``_AMQ_BRIDGE_DUP`` duplicate id travel as message properties there). ``dup-id`` names the
forward uniquely within the cluster and lets the receiving node drop a copy it already stored
(a bridge that reconnects resends what was not acknowledged). ``hops`` counts the bridges
crossed so far (``max-hops``).

A **notification** is one described list, ``lodestone:notify:v1`` [kind, …]:

=============  ========================================================================
kind           fields after the kind
=============  ========================================================================
``hello``      node id, cluster name, connector URL, management URL, start time (ms),
               members (list of [node id, connector, management URL]), scale-down group
               (string or null)
``reset``      (none): forget every binding learned through this link; a snapshot follows
``binding``    node id, queue, address, routing type, filter (string or null), consumers
               (uint), consumer filters (list of strings), distance (uint: 0 = the sender's
               own queue)
``unbinding``  node id, queue
``backups``    node id, backups (list of [connector, management URL (may be empty), in sync
               (bool)], at most :data:`MAX_BACKUPS`): the sender's HA backups, the whole truth
               (docs/ha.md "Topology"); sent after the hello when there are any, and whenever
               they change (an empty list: none any more)
``address``    name, routing types (list), queue filter (string or null), version (timestamp
               ms; 0: from a config file), origin node id, deleted (bool)[, shared (bool),
               present only when true]: one entry of the replicated cluster state (OpenAMQ),
               see ``broker.cluster.state``; shared: OpenAMQ's shared queue
               (``broker.cluster.shared``)
``election``   node id, partition ("primary" or "secondary"), state ("starting" or
               "active"), start time (ms), vote (the node id it votes for as root, or null),
               root (bool): the sender's part in OpenAMQ's root election
               (``broker.cluster.root``); sent in the snapshot by a node in a cluster with
               ``primaries``, and whenever any of these changes
=============  ========================================================================

Only a node configured with ``primaries`` sends ``election``; a node older than that kind cuts
the link off when it receives one, so every node of such a cluster runs a version that knows it.

A node older than the ``backups`` kind cuts the link off when it receives one ("unknown
notification kind"): a node sends it only while it has (or has just lost) a backup, so a cluster
being upgraded node by node works as long as no backup is attached before every node is upgraded.

``binding`` adds or replaces (its consumer count and consumer filters are the whole truth, so
a lost or repeated notification heals with the next one). Every decode checks types, lengths
and counts and raises :class:`ProtocolError` (condition ``amqp:decode-error`` for bytes that
are not the format, ``amqp:invalid-field`` for values that break its rules); the receiving
node then cuts that link's connection off and logs it (see the bridge).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from broker.wire.codec import Described, Symbol, Timestamp, UByte, UInt, decode as amqp_decode, decode_all, encode
from broker.wire.errors import DecodeError
from broker.wire.frames import INTERNAL_PREFIX, MAX_SELECTOR_BYTES

__all__ = ["FORWARD_ADDRESS", "NOTIFY_ADDRESS", "CLUSTER_PREFIX", "INTERNAL_PREFIX", "Forwarded", "Hello", "Reset",
           "BindingNote", "Unbinding", "AddressNote", "BackupsNote", "ElectionNote", "MAX_BACKUPS", "ProtocolError", "encode_forward", "decode_forward", "decode_forwards", "MAX_BATCH", "encode_note",
           "decode_note", "MAX_NAME", "MAX_FILTER", "MAX_TARGETS", "MAX_MEMBERS"]

CLUSTER_PREFIX = "$lodestone.cluster."   # the cluster user's link addresses
FORWARD_ADDRESS = CLUSTER_PREFIX + "forward"
SHARED_ADDRESS = CLUSTER_PREFIX + "shared"   # a producer's send relayed to the root (broker.cluster.shared)
NOTIFY_ADDRESS = CLUSTER_PREFIX + "notifications"

FORWARD_DESCRIPTOR = Symbol("lodestone:forward:v1")
NOTIFY_DESCRIPTOR = Symbol("lodestone:notify:v1")
_FORWARD_HEAD = b"\x00\xa3" + bytes((len(FORWARD_DESCRIPTOR),)) + FORWARD_DESCRIPTOR.encode()

# The limits must admit everything a node may have to announce: a binding the receiving node
# refuses cuts the cluster link off, again after every reconnect (its snapshot repeats it).
MAX_NAME = 0xFFFF      # characters in a node id, queue, address or URL (the journal's name limit, in bytes)
MAX_FILTER = MAX_SELECTOR_BYTES  # characters in a queue or consumer filter (a selector's limit, in bytes)
MAX_BATCH = 65536     # forwarded messages in one transfer
MAX_TARGETS = 65536    # (node, queue) targets of one forwarded message
MAX_MEMBERS = 4096     # members in a hello
MAX_BACKUPS = 16       # backups in a backups notification
MAX_FILTERS = 65536    # consumer filters of one binding
ROUTING_TYPES = ("anycast", "multicast")


MAX_DESCRIPTION = 256  # characters of a ProtocolError's description (it may quote what the peer sent)


class ProtocolError(Exception):
    """A forwarded message or notification that is not the format (``condition`` says how)."""

    def __init__(self, condition: str, description: str):
        # the description goes into a log line and the Close we send: a quoted 64 KiB name
        # would make a Close frame larger than the peer's max-frame-size
        if len(description) > MAX_DESCRIPTION:
            description = description[:MAX_DESCRIPTION - 3] + "..."
        super().__init__(description)
        self.condition = condition
        self.description = description


def _invalid(what: str) -> ProtocolError:
    return ProtocolError("amqp:invalid-field", what)


# -- forwarded messages ------------------------------------------------------------------------

@dataclass(slots=True)
class Forwarded:
    """One forwarded message (see the module doc). Not frozen: one is made per forwarded message,
    and a frozen dataclass's ``__init__`` costs three times as much; treat it as a value."""

    dup_id: bytes
    origin: str
    address: str
    targets: tuple[tuple[str, str], ...]
    hops: int
    durable: bool
    priority: int
    expires: float
    message: bytes
    create: tuple[str, str | None] | None = None   # scale-down: (routing type, filter) of a missing queue
    moved: bool = False   # redistribution, scale-down: _AMQ_DUPL_ID checked only per queue held


def encode_forward(f: Forwarded) -> bytes:
    """The bytes of one forwarded message: exactly what the generic codec writes for the
    described list (``encode_forward_generic``; a test holds the two equal), built directly —
    every forwarded message pays for this, so it skips the codec's per-value dispatch."""
    parts = [_vbin(f.dup_id), _str_cached(f.origin), _str_cached(f.address)]
    targets = f.targets
    enc = _TARGETS.get(targets)
    if enc is None:
        enc = _list([_list([_str(n), _str(q)], 2) for n, q in targets], len(targets)) if targets else b"\x45"
        if len(_TARGETS) >= _CACHE_ENTRIES:
            _TARGETS.clear()
        _TARGETS[targets] = enc
    parts.append(enc)
    hops = f.hops
    parts.append(b"\x43" if hops == 0 else (b"\x52" + _P_B(hops) if 0 < hops <= 0xFF else b"\x70" + _P_I(hops)))
    parts.append(b"\x41" if f.durable else b"\x42")
    parts.append(b"\x50" + _P_B(f.priority))
    parts.append(b"\x83" + _P_q(int(f.expires)))
    parts.append(_vbin(f.message))
    count = 9
    if f.create is not None:
        rtype, ftext = f.create
        parts.append(_list([_str(rtype), _str(ftext) if ftext is not None else b"\x40"], 2))
        count = 10
    elif f.moved:
        parts.append(b"\x40")
        count = 10
    if f.moved:
        parts.append(b"\x41")
        count = 11
    return _FORWARD_HEAD + _list(parts, count)


def encode_forward_generic(f: Forwarded) -> bytes:
    """:func:`encode_forward` through the generic codec (the reference the fast path must equal)."""
    fields = [f.dup_id, f.origin, f.address, [[n, q] for n, q in f.targets], UInt(f.hops), f.durable,
              UByte(f.priority), Timestamp(int(f.expires)), f.message]
    if f.create is not None or f.moved:
        fields.append([f.create[0], f.create[1]] if f.create is not None else None)
    if f.moved:
        fields.append(True)
    return encode(Described(FORWARD_DESCRIPTOR, fields))


_P_B = struct.Struct(">B").pack
_P_I = struct.Struct(">I").pack
_P_q = struct.Struct(">q").pack
_P_II = struct.Struct(">II").pack
_U_I = struct.Struct(">I").unpack_from
_U_II = struct.Struct(">II").unpack_from
_U_q = struct.Struct(">q").unpack_from


# the strings and target lists a node forwards to are few (its addresses, its neighbours' queues):
# their encodings are kept, up to a bound
_CACHE_ENTRIES = 4096
_STRS: dict[str, bytes] = {}
_TARGETS: dict[tuple, bytes] = {}


def _str_cached(v: str) -> bytes:
    enc = _STRS.get(v)
    if enc is None:
        enc = _str(v)
        if len(_STRS) >= _CACHE_ENTRIES:
            _STRS.clear()
        _STRS[v] = enc
    return enc


def _vbin(b: bytes) -> bytes:
    n = len(b)
    return (bytes((0xA0, n)) if n <= 0xFF else b"\xb0" + _P_I(n)) + b


def _str(v: str) -> bytes:
    raw = v.encode("utf-8")
    n = len(raw)
    return (bytes((0xA1, n)) if n <= 0xFF else b"\xb1" + _P_I(n)) + raw


def _list(parts: list, count: int) -> bytes:
    body = b"".join(parts)
    size = len(body)
    if size + 1 <= 0xFF and count <= 0xFF:
        return bytes((0xC0, size + 1, count)) + body
    return b"\xd0" + _P_II(size + 4, count) + body


class _NotFast(Exception):
    """The bytes are not in the one layout the fast decoder reads: use the generic codec."""


def _fvar(data: bytes, mv: memoryview, end: int, pos: int, c8: int, c32: int) -> tuple[memoryview, int]:
    c = data[pos]
    if c == c8:
        n = data[pos + 1]
        pos += 2
    elif c == c32:
        (n,) = _U_I(data, pos + 1)
        pos += 5
    else:
        raise _NotFast
    if pos + n > end:
        raise _NotFast
    return mv[pos:pos + n], pos + n


def _ftext(data: bytes, mv: memoryview, end: int, pos: int) -> tuple[str, int]:
    raw, pos = _fvar(data, mv, end, pos, 0xA1, 0xB1)
    try:
        return str(raw, "utf-8"), pos
    except UnicodeDecodeError:
        raise _NotFast from None


def _flst(data: bytes, end: int, pos: int) -> tuple[int, int]:
    c = data[pos]
    if c == 0xC0:
        return data[pos + 2], pos + 3
    if c == 0xD0:
        return _U_II(data, pos + 1)[1], pos + 9
    raise _NotFast


def _fast_forward_fields(data: bytes) -> list:
    """The fields of a forwarded message as the fast layout has them (plain Python values), or
    :class:`_NotFast`. Anything unusual — another encoding of a value, a wrong type — goes to the
    generic decoder, which says exactly what is wrong."""
    mv = memoryview(data)
    end = len(data)
    head = len(_FORWARD_HEAD)
    if data[:head] != _FORWARD_HEAD or end < head + 3:
        raise _NotFast
    pos = head
    code = data[pos]
    if code == 0xC0:
        size, count = data[pos + 1], data[pos + 2]
        pos += 3
        if pos - 1 + size != end:
            raise _NotFast
    elif code == 0xD0:
        if end < pos + 9:
            raise _NotFast
        size, count = _U_II(data, pos + 1)
        pos += 9
        if pos - 4 + size != end:
            raise _NotFast
    else:
        raise _NotFast
    if count not in (9, 10, 11):
        raise _NotFast

    dup, pos = _fvar(data, mv, end, pos, 0xA0, 0xB0)
    origin, pos = _ftext(data, mv, end, pos)
    address, pos = _ftext(data, mv, end, pos)
    n, pos = _flst(data, end, pos)
    targets = []
    for _ in range(n):
        two, pos = _flst(data, end, pos)
        if two != 2:
            raise _NotFast
        node, pos = _ftext(data, mv, end, pos)
        queue, pos = _ftext(data, mv, end, pos)
        targets.append([node, queue])
    if pos + 13 > end:
        raise _NotFast
    c = data[pos]
    if c == 0x43:
        hops, pos = 0, pos + 1
    elif c == 0x52:
        hops, pos = data[pos + 1], pos + 2
    elif c == 0x70:
        (hops,), pos = _U_I(data, pos + 1), pos + 5
    else:
        raise _NotFast
    c = data[pos]
    if c == 0x41:
        durable = True
    elif c == 0x42:
        durable = False
    else:
        raise _NotFast
    if data[pos + 1] != 0x50 or data[pos + 3] != 0x83:
        raise _NotFast
    priority = data[pos + 2]
    (expires,) = _U_q(data, pos + 4)
    pos += 12
    message, pos = _fvar(data, mv, end, pos, 0xA0, 0xB0)
    fields = [bytes(dup), origin, address, targets, hops, durable, priority, expires, bytes(message)]
    if count >= 10:
        if pos < end and data[pos] == 0x40:
            fields.append(None)
            pos += 1
        else:
            two, pos = _flst(data, end, pos)
            if two != 2:
                raise _NotFast
            rtype, pos = _ftext(data, mv, end, pos)
            if pos < end and data[pos] == 0x40:
                ftext, pos = None, pos + 1
            else:
                ftext, pos = _ftext(data, mv, end, pos)
            fields.append([rtype, ftext])
    if count == 11:
        if pos >= end or data[pos] not in (0x41, 0x42):
            raise _NotFast
        fields.append(data[pos] == 0x41)
        pos += 1
    if pos != end:
        raise _NotFast
    return fields


def _name(v, what: str, *, empty: bool = False, limit: int = MAX_NAME) -> str:
    if not isinstance(v, str) or isinstance(v, Symbol):
        raise _invalid(f"{what} must be a string")
    if (not v and not empty) or len(v) > limit:
        raise _invalid(f"{what} must be 1..{limit} characters")
    return v


def _uint(v, what: str, limit: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > limit:
        raise _invalid(f"{what} must be an unsigned integer <= {limit}")
    return int(v)


def _body(data: bytes, descriptor: Symbol, what: str) -> list:
    try:
        value = decode_all(data)
    except DecodeError as exc:
        raise ProtocolError("amqp:decode-error", f"{what}: {exc}") from None
    if not isinstance(value, Described) or not isinstance(value.descriptor, Symbol) \
            or value.descriptor != descriptor or not isinstance(value.value, list):
        raise ProtocolError("amqp:decode-error", f"{what}: not a {descriptor} value")
    return value.value


def decode_forward(data: bytes) -> Forwarded:
    """Decode and check one forwarded message; :class:`ProtocolError` if it is not the format."""
    try:
        v = _fast_forward_fields(data)
    except (_NotFast, IndexError, struct.error):
        v = _body(data, FORWARD_DESCRIPTOR, "forwarded message")
    return _forward_from_fields(v)


def decode_forwards(data: bytes) -> list[Forwarded]:
    """Decode one transfer of the forward link: one or more forwarded messages, back to back
    (a bridge sends what it has in one transfer); :class:`ProtocolError` if any is not the format."""
    out: list[Forwarded] = []
    end = len(data)
    pos = 0
    head = len(_FORWARD_HEAD)
    while pos < end:
        if len(out) >= MAX_BATCH:
            raise _invalid(f"more than {MAX_BATCH} forwarded messages in one transfer")
        nxt = -1
        if data[pos:pos + head] == _FORWARD_HEAD and pos + head + 3 <= end:
            c = data[pos + head]
            if c == 0xC0:
                nxt = pos + head + 2 + data[pos + head + 1]
            elif c == 0xD0 and pos + head + 9 <= end:
                nxt = pos + head + 5 + _U_I(data, pos + head + 1)[0]
        if 0 < nxt <= end:
            out.append(decode_forward(data[pos:nxt] if (pos or nxt != end) else data))
            pos = nxt
            continue
        try:  # not the usual layout: the generic codec finds where this value ends, or says why not
            value, nxt = amqp_decode(data, pos)
        except DecodeError as exc:
            raise ProtocolError("amqp:decode-error", f"forwarded message: {exc}") from None
        out.append(decode_forward(data[pos:nxt]))
        pos = nxt
    if not out:
        raise ProtocolError("amqp:decode-error", "forwarded message: empty transfer")
    return out


def _forward_from_fields(v: list) -> Forwarded:
    """Check a forwarded message's fields (fast or generic decoding) and build it."""
    if len(v) not in (9, 10, 11):
        raise _invalid(f"forwarded message has {len(v)} fields, expected 9 to 11")
    dup, origin, address, targets, hops, durable, priority, expires, message = v[:9]
    create = None
    moved = False
    if len(v) == 11:
        moved = v[10]
        if not isinstance(moved, bool):
            raise _invalid("moved must be a boolean")
    if len(v) >= 10 and v[9] is not None:
        c = v[9]
        if not isinstance(c, list) or len(c) != 2 or c[0] not in ROUTING_TYPES:
            raise _invalid("create must be [routing type, filter]")
        if isinstance(c[0], Symbol):
            raise _invalid("create must be [routing type, filter]")
        create = (c[0], _name(c[1], "create filter", limit=MAX_FILTER) if c[1] is not None else None)
    if not isinstance(dup, bytes) or not 1 <= len(dup) <= 256:
        raise _invalid("dup-id must be 1..256 bytes")
    if not isinstance(targets, list) or not 1 <= len(targets) <= MAX_TARGETS:
        raise _invalid(f"targets must be a list of 1..{MAX_TARGETS} [node, queue] pairs")
    pairs = []
    for t in targets:
        if not isinstance(t, list) or len(t) != 2:
            raise _invalid("a target must be a [node id, queue] pair")
        pairs.append((_name(t[0], "target node id"), _name(t[1], "target queue")))
    if not isinstance(durable, bool):
        raise _invalid("durable must be a boolean")
    if not isinstance(message, bytes) or not message:
        raise _invalid("message must be non-empty binary")
    if not isinstance(expires, int) or isinstance(expires, bool) or expires < 0:
        raise _invalid("expires must be a timestamp")
    return Forwarded(bytes(dup), _name(origin, "origin"), _name(address, "address"), tuple(pairs),
                     _uint(hops, "hops", 255), durable, _uint(priority, "priority", 9), int(expires), bytes(message),
                     create, moved)


# -- notifications -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Hello:
    node_id: str
    cluster: str
    connector: str
    management_url: str
    started_ms: int
    members: tuple[tuple[str, str, str], ...] = ()
    group: str | None = None   # the node's scale-down-group-name


@dataclass(frozen=True)
class Reset:
    pass


@dataclass(frozen=True)
class BindingNote:
    node_id: str
    queue: str
    address: str
    routing_type: str
    filter_text: str | None
    consumers: int
    consumer_filters: tuple[str, ...]
    distance: int


@dataclass(frozen=True)
class AddressNote:
    """One entry of the replicated cluster state: an address declared in config or through the
    management API (``deleted``: a tombstone)."""

    name: str
    routing_types: tuple[str, ...]
    filter_text: str | None
    version: int
    origin: str
    deleted: bool = False
    shared: bool = False   # OpenAMQ's shared queue: active on the cluster's root only (broker.cluster.shared)


@dataclass(frozen=True)
class BackupsNote:
    """A node's HA backups (``ClusterNode.own_backups``): ``(connector, management URL, in sync)``."""

    node_id: str
    backups: tuple[tuple[str, str, bool], ...] = ()


@dataclass(frozen=True)
class ElectionNote:
    """A node's part in the root election (``broker.cluster.root``)."""

    node_id: str
    partition: str        # "primary" | "secondary"
    state: str            # "starting" | "active"
    started_ms: int
    vote: str | None      # whom it votes for as root (None: no vote)
    root: bool            # it is root now


PARTITION_NAMES = ("primary", "secondary")
ELECTION_STATES = ("starting", "active")


@dataclass(frozen=True)
class Unbinding:
    node_id: str
    queue: str


def encode_note(n) -> bytes:
    if isinstance(n, BindingNote):
        fields = ["binding", n.node_id, n.queue, n.address, n.routing_type, n.filter_text, UInt(n.consumers),
                  list(n.consumer_filters), UInt(n.distance)]
    elif isinstance(n, Unbinding):
        fields = ["unbinding", n.node_id, n.queue]
    elif isinstance(n, AddressNote):
        fields = ["address", n.name, list(n.routing_types), n.filter_text, Timestamp(n.version), n.origin, n.deleted]
        if n.shared:   # a seventh field only when set: a node older than shared queues reads the rest as before
            fields.append(True)
    elif isinstance(n, Reset):
        fields = ["reset"]
    elif isinstance(n, BackupsNote):
        fields = ["backups", n.node_id, [[c, m, bool(ok)] for c, m, ok in n.backups]]
    elif isinstance(n, ElectionNote):
        fields = ["election", n.node_id, n.partition, n.state, Timestamp(n.started_ms), n.vote, n.root]
    elif isinstance(n, Hello):
        fields = ["hello", n.node_id, n.cluster, n.connector, n.management_url, Timestamp(n.started_ms),
                  [[a, b, c] for a, b, c in n.members], n.group]
    else:  # pragma: no cover - programming error
        raise TypeError(f"not a notification: {n!r}")
    return encode(Described(NOTIFY_DESCRIPTOR, fields))


def decode_note(data: bytes):
    """Decode and check one notification; :class:`ProtocolError` if it is not the format."""
    v = _body(data, NOTIFY_DESCRIPTOR, "notification")
    if not v or not isinstance(v[0], str) or isinstance(v[0], Symbol):
        raise _invalid("notification without a kind")
    kind, rest = v[0], v[1:]
    if kind == "binding":
        if len(rest) != 8:
            raise _invalid("binding notification needs 8 fields")
        node, queue, address, rtype, ftext, consumers, cfilters, distance = rest
        if not isinstance(rtype, str) or isinstance(rtype, Symbol) or rtype not in ROUTING_TYPES:
            raise _invalid(f"routing type {rtype!r} must be anycast or multicast")
        if ftext is not None:
            ftext = _name(ftext, "filter", limit=MAX_FILTER)
        if not isinstance(cfilters, list) or len(cfilters) > MAX_FILTERS:
            raise _invalid("consumer filters must be a list")
        cf = tuple(_name(t, "consumer filter", limit=MAX_FILTER) for t in cfilters)
        n = _uint(consumers, "consumers", 1 << 31)
        if len(cf) > n:
            raise _invalid("more consumer filters than consumers")
        return BindingNote(_name(node, "node id"), _name(queue, "queue"), _name(address, "address"), rtype, ftext,
                           n, cf, _uint(distance, "distance", 255))
    if kind == "unbinding":
        if len(rest) != 2:
            raise _invalid("unbinding notification needs 2 fields")
        return Unbinding(_name(rest[0], "node id"), _name(rest[1], "queue"))
    if kind == "address":
        if len(rest) not in (6, 7):
            raise _invalid("address notification needs 6 or 7 fields")
        name, types, ftext, version, origin, deleted = rest[:6]
        shared = rest[6] if len(rest) == 7 else False
        if not isinstance(shared, bool):
            raise _invalid("shared must be a boolean")
        if not isinstance(types, list) or not types or any(isinstance(t, Symbol) or t not in ROUTING_TYPES
                                                           for t in types) \
                or len(set(types)) != len(types):
            raise _invalid("routing types must be a non-empty list of anycast/multicast")
        if shared and "anycast" not in types:
            raise _invalid("a shared address needs the anycast routing type")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise _invalid("version must be a timestamp")
        if not isinstance(deleted, bool):
            raise _invalid("deleted must be a boolean")
        return AddressNote(_name(name, "address"), tuple(types),
                           _name(ftext, "filter", limit=MAX_FILTER) if ftext is not None else None,
                           int(version), _name(origin, "origin"), deleted, shared)
    if kind == "reset":
        if rest:
            raise _invalid("reset notification has no fields")
        return Reset()
    if kind == "backups":
        if len(rest) != 2:
            raise _invalid("backups notification needs 2 fields")
        node, backups = rest
        if not isinstance(backups, list) or len(backups) > MAX_BACKUPS:
            raise _invalid(f"backups must be a list of at most {MAX_BACKUPS}")
        bs = []
        for b in backups:
            if not isinstance(b, list) or len(b) != 3 or not isinstance(b[2], bool):
                raise _invalid("a backup must be [connector, management URL, in sync]")
            bs.append((_name(b[0], "backup connector"), _name(b[1], "backup management URL", empty=True), b[2]))
        return BackupsNote(_name(node, "node id"), tuple(bs))
    if kind == "hello":
        if len(rest) != 7:
            raise _invalid("hello notification needs 7 fields")
        node, cluster, connector, mgmt, started, members, group = rest
        if group is not None:
            group = _name(group, "group")
        if not isinstance(members, list) or len(members) > MAX_MEMBERS:
            raise _invalid("members must be a list")
        ms = []
        for m in members:
            if not isinstance(m, list) or len(m) != 3:
                raise _invalid("a member must be [node id, connector, management URL]")
            ms.append((_name(m[0], "member node id"), _name(m[1], "member connector"),
                       _name(m[2], "member management URL", empty=True)))
        if not isinstance(started, int) or isinstance(started, bool) or started < 0:
            raise _invalid("start time must be a timestamp")
        return Hello(_name(node, "node id"), _name(cluster, "cluster name"), _name(connector, "connector"),
                     _name(mgmt, "management URL", empty=True), int(started), tuple(ms), group)
    if kind == "election":
        if len(rest) != 6:
            raise _invalid("election notification needs 6 fields")
        node, partition, state, started, vote, root = rest
        if partition not in PARTITION_NAMES or isinstance(partition, Symbol):
            raise _invalid(f"partition {str(partition)[:64]!r} must be primary or secondary")
        if state not in ELECTION_STATES or isinstance(state, Symbol):
            raise _invalid(f"state {str(state)[:64]!r} must be starting or active")
        if not isinstance(started, int) or isinstance(started, bool) or started < 0:
            raise _invalid("start time must be a timestamp")
        if not isinstance(root, bool):
            raise _invalid("root must be a boolean")
        if partition == "secondary" and (root or vote is not None):
            raise _invalid("a secondary neither votes nor is root")
        if root and state != "active":
            raise _invalid("a root must be active")
        return ElectionNote(_name(node, "node id"), partition, state, int(started),
                            None if vote is None else _name(vote, "vote"), root)
    raise _invalid(f"unknown notification kind {kind[:64]!r}")
