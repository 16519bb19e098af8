"""The journal's record codec: sans-IO, bytes in and records out; no files, no clock, no locks.

Theory of operation
===================

Every mutation of durable state is one self-describing *record* with a sequence number ``seq``
that increases by exactly one per record, for the life of the journal (it survives restarts and
compaction). On disk and on the replication wire a record is::

    length u32 | type u8 | seq u64 | crc u32 | payload[length]         (big-endian)

``crc`` is ``zlib.crc32`` over the 13 header bytes before it followed by the payload. Types:

=====================  ===============================================================
ADD_MESSAGE (1)        queue str16, message_id u64, delivery_count u32,
                       properties bytes32 (compact JSON object, b"" for none), body (rest)
ACK (2)                queue str16, message_id u64
UPDATE_DELIVERY_COUNT  queue str16, message_id u64, count u32
(3)
ADD_KV (4)             namespace str16, key str16, value (rest)
DEL_KV (5)             namespace str16, key str16
GROUP (6)              count u32, then ``count`` times: type u8, length u32, payload --
                       an ADD_MESSAGE, ACK or UPDATE_DELIVERY_COUNT payload as above
=====================  ===============================================================

(``str16`` is a u16 length then UTF-8; ``bytes32`` a u32 length then bytes.)

A GROUP record is a committed transaction (AMQP 1.0 §4, ``broker.core.transactions``): every
message add, ack and delivery-count change of one commit in **one** record, so one CRC covers
them all and the group is atomic by construction -- recovery, a replica's ``apply`` and a torn
tail see all of it or none of it (a torn GROUP at the end of the last segment is truncated like
any torn record). Its operations share the group's seq and are applied in order. Work of a
transaction that was never committed is never written. Compaction keeps a live message of a
group under the group's seq; if several live messages share one, it writes them as one GROUP
of ADD_MESSAGE operations (seqs stay strictly increasing on disk).

A message lives in
one queue: the broker writes one ADD_MESSAGE per queue a message was routed to. KV namespaces
hold queue/address definitions, durable subscriptions and the router's persisted caches.

Each segment file starts with a 28-byte header (see ``segments``): magic ``LODEJRNL``, version
u16, flags u16, segment number u32, ``prev_seq`` u64, crc32 u32 over the bytes before it. Its
codec is here too (:func:`_segment_header`, :func:`_parse_segment_header`).

:func:`_parse_at` checks one record in a buffer without decoding its payload and returns a
reason string instead of raising: recovery uses the reason to tell a torn tail from corruption.
Names with a leading underscore are private to the ``broker.store.journal`` package.
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Mapping

from broker.store.errors import BadRecord, LocalStoreError

# -- wire format ---------------------------------------------------------------------------------

_REC_HEAD = struct.Struct(">IBQ")       # length, type, seq
_REC_CRC = struct.Struct(">I")
REC_HEADER_BYTES = _REC_HEAD.size + _REC_CRC.size   # 17
MAX_PAYLOAD_BYTES = 1 << 30              # sanity bound; a larger length means a damaged header

_SEG_HEAD = struct.Struct(">8sHHIQ")    # magic, version, flags, number, prev_seq
_SEG_MAGIC = b"LODEJRNL"
_SEG_VERSION = 1
SEG_HEADER_BYTES = _SEG_HEAD.size + _REC_CRC.size   # 28
FLAG_COMPACTED = 0x0001

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_ID_COUNT = struct.Struct(">QI")



class RecordType(enum.IntEnum):
    """Record types; the numbers are on disk and on the replication wire, never reuse one."""

    ADD_MESSAGE = 1
    ACK = 2
    UPDATE_DELIVERY_COUNT = 3
    ADD_KV = 4
    DEL_KV = 5
    GROUP = 6


_TYPES = frozenset(int(t) for t in RecordType)
_GROUP_OP_TYPES = frozenset((RecordType.ADD_MESSAGE, RecordType.ACK, RecordType.UPDATE_DELIVERY_COUNT))
_GROUP_OP_HEAD = struct.Struct(">BI")   # type, length


_STR16: dict[str, bytes] = {}     # queue and namespace names repeat: encoded once (bounded)


def _str16(s: str) -> bytes:
    out = _STR16.get(s)
    if out is not None:
        return out
    b = s.encode("utf-8")
    if len(b) > 0xFFFF:
        raise LocalStoreError(f"name too long for the journal ({len(b)} bytes > 65535): {s[:40]!r}...")
    out = _U16.pack(len(b)) + b
    if len(_STR16) < 4096:
        _STR16[s] = out
    return out


def _read_str16(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = _U16.unpack_from(buf, pos)
    pos += 2
    if pos + n > len(buf):
        raise BadRecord("string runs past the end of the record")
    return bytes(buf[pos:pos + n]).decode("utf-8"), pos + n


def encode_record(rtype: int, seq: int, payload: bytes) -> bytes:
    """Frame one record: header, CRC and payload."""
    head = _REC_HEAD.pack(len(payload), rtype, seq)
    crc = zlib.crc32(payload, zlib.crc32(head))
    return head + _REC_CRC.pack(crc) + payload


def encode_record_parts(rtype: int, seq: int, parts: tuple) -> bytes:
    """:func:`encode_record` of the payload ``b"".join(parts)``, copying the parts once."""
    head = _REC_HEAD.pack(sum(map(len, parts)), rtype, seq)
    crc = zlib.crc32(head)
    for part in parts:
        crc = zlib.crc32(part, crc)
    return b"".join((head, _REC_CRC.pack(crc), *parts))


@dataclass(frozen=True, slots=True)
class Record:
    """One decoded record. Fields not used by the type are None."""

    type: RecordType
    seq: int
    queue: str | None = None
    message_id: int | None = None
    delivery_count: int | None = None
    properties: dict[str, Any] | None = None
    body: bytes | None = None
    namespace: str | None = None
    key: str | None = None
    value: bytes | None = None
    ops: tuple["Record", ...] | None = None    # GROUP: its operations (each with the group's seq)


def _payload_add_message(queue: str, message_id: int, delivery_count: int,
                         properties: Mapping[str, Any] | None, body: bytes) -> bytes:
    return b"".join(_parts_add_message(queue, message_id, delivery_count, properties, body))


_NO_PROPS = _U32.pack(0)


def _parts_add_message(queue: str, message_id: int, delivery_count: int,
                       properties: Mapping[str, Any] | None, body: bytes) -> tuple:
    """The pieces of an ADD_MESSAGE payload (:func:`encode_record_parts` joins them once)."""
    if properties:
        props = json.dumps(dict(properties), separators=(",", ":"), ensure_ascii=False).encode()
        return _str16(queue), _ID_COUNT.pack(message_id, delivery_count), _U32.pack(len(props)), props, body
    return _str16(queue), _ID_COUNT.pack(message_id, delivery_count), _NO_PROPS, body


def _payload_queue_id(queue: str, message_id: int) -> bytes:
    return _str16(queue) + _U64.pack(message_id)


def _payload_kv(namespace: str, key: str, value: bytes = b"") -> bytes:
    return _str16(namespace) + _str16(key) + value


def _payload_group(ops: list[tuple[int, bytes]]) -> bytes:
    parts = [_U32.pack(len(ops))]
    for rtype, payload in ops:
        if rtype not in _GROUP_OP_TYPES:
            raise LocalStoreError(f"record type {rtype} cannot be part of a group")
        parts.append(_GROUP_OP_HEAD.pack(rtype, len(payload)))
        parts.append(payload)
    return b"".join(parts)


def _decode_group(seq: int, payload: memoryview) -> Record:
    (count,) = _U32.unpack_from(payload, 0)
    pos = 4
    ops = []
    for _ in range(count):
        rtype, n = _GROUP_OP_HEAD.unpack_from(payload, pos)
        pos += _GROUP_OP_HEAD.size
        if rtype not in _GROUP_OP_TYPES:
            raise BadRecord(f"record type {rtype} inside a GROUP")
        if pos + n > len(payload):
            raise BadRecord("group operation runs past the end of the record")
        ops.append(_decode_payload(rtype, seq, payload[pos:pos + n]))
        pos += n
    if pos != len(payload):
        raise BadRecord("trailing bytes after GROUP")
    return Record(RecordType.GROUP, seq, ops=tuple(ops))


def _decode_payload(rtype: int, seq: int, payload: memoryview) -> Record:
    try:
        if rtype == RecordType.GROUP:
            return _decode_group(seq, payload)
        if rtype == RecordType.ADD_MESSAGE:
            queue, pos = _read_str16(payload, 0)
            mid, count = _ID_COUNT.unpack_from(payload, pos)
            pos += _ID_COUNT.size
            (plen,) = _U32.unpack_from(payload, pos)
            pos += 4
            if pos + plen > len(payload):
                raise BadRecord("properties run past the end of the record")
            props = json.loads(bytes(payload[pos:pos + plen])) if plen else {}
            if not isinstance(props, dict):
                raise BadRecord("properties are not a JSON object")
            return Record(RecordType.ADD_MESSAGE, seq, queue=queue, message_id=mid,
                          delivery_count=count, properties=props, body=bytes(payload[pos + plen:]))
        if rtype in (RecordType.ACK, RecordType.UPDATE_DELIVERY_COUNT):
            queue, pos = _read_str16(payload, 0)
            (mid,) = _U64.unpack_from(payload, pos)
            pos += 8
            if rtype == RecordType.ACK:
                if pos != len(payload):
                    raise BadRecord("trailing bytes after ACK")
                return Record(RecordType.ACK, seq, queue=queue, message_id=mid)
            (count,) = _U32.unpack_from(payload, pos)
            if pos + 4 != len(payload):
                raise BadRecord("trailing bytes after UPDATE_DELIVERY_COUNT")
            return Record(RecordType.UPDATE_DELIVERY_COUNT, seq, queue=queue, message_id=mid,
                          delivery_count=count)
        if rtype in (RecordType.ADD_KV, RecordType.DEL_KV):
            ns, pos = _read_str16(payload, 0)
            key, pos = _read_str16(payload, pos)
            if rtype == RecordType.ADD_KV:
                return Record(RecordType.ADD_KV, seq, namespace=ns, key=key, value=bytes(payload[pos:]))
            if pos != len(payload):
                raise BadRecord("trailing bytes after DEL_KV")
            return Record(RecordType.DEL_KV, seq, namespace=ns, key=key)
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise BadRecord(f"bad {RecordType(rtype).name} payload: {exc}") from None
    raise BadRecord(f"unknown record type {rtype}")


def _op_size(op: Record) -> int:
    """Bytes one GROUP operation takes in its record (its share of the live bytes)."""
    if op.type == RecordType.ADD_MESSAGE:
        return _GROUP_OP_HEAD.size + len(_payload_add_message(op.queue, op.message_id, op.delivery_count,
                                                              op.properties, op.body))
    return _GROUP_OP_HEAD.size + 2 + len(op.queue.encode()) + 8 + (4 if op.type == RecordType.UPDATE_DELIVERY_COUNT else 0)


@dataclass(frozen=True, slots=True)
class GroupOp:
    """One operation of :meth:`Journal.append_group` (build with ``add`` / ``ack`` / ``count``)."""

    type: RecordType
    queue: str
    message_id: int
    body: bytes = b""
    properties: Mapping[str, Any] | None = None
    delivery_count: int = 0

    @classmethod
    def add(cls, queue: str, message_id: int, body: bytes, properties: Mapping[str, Any] | None = None,
            delivery_count: int = 0) -> "GroupOp":
        return cls(RecordType.ADD_MESSAGE, queue, message_id, bytes(body), dict(properties or {}), delivery_count)

    @classmethod
    def ack(cls, queue: str, message_id: int) -> "GroupOp":
        return cls(RecordType.ACK, queue, message_id)

    @classmethod
    def count(cls, queue: str, message_id: int, delivery_count: int) -> "GroupOp":
        return cls(RecordType.UPDATE_DELIVERY_COUNT, queue, message_id, delivery_count=delivery_count)

    def payload(self) -> bytes:
        if self.type == RecordType.ADD_MESSAGE:
            return _payload_add_message(self.queue, self.message_id, self.delivery_count, self.properties,
                                        self.body)
        if self.type == RecordType.ACK:
            return _payload_queue_id(self.queue, self.message_id)
        return _payload_queue_id(self.queue, self.message_id) + _U32.pack(self.delivery_count)

    def record(self, seq: int) -> Record:
        if self.type == RecordType.ADD_MESSAGE:
            return Record(self.type, seq, queue=self.queue, message_id=self.message_id,
                          delivery_count=self.delivery_count, properties=dict(self.properties or {}),
                          body=self.body)
        if self.type == RecordType.ACK:
            return Record(self.type, seq, queue=self.queue, message_id=self.message_id)
        return Record(self.type, seq, queue=self.queue, message_id=self.message_id,
                      delivery_count=self.delivery_count)


def _parse_at(buf: bytes | memoryview, pos: int) -> tuple[int, int, int] | str:
    """Check the record at ``pos``: ``(type, seq, end)`` if whole and CRC-good, else a reason."""
    if len(buf) - pos < REC_HEADER_BYTES:
        return "partial header"
    length, rtype, seq = _REC_HEAD.unpack_from(buf, pos)
    if rtype not in _TYPES:
        return f"unknown record type {rtype}"
    if length > MAX_PAYLOAD_BYTES:
        return f"implausible length {length}"
    end = pos + REC_HEADER_BYTES + length
    if end > len(buf):
        return "partial record"
    (crc,) = _REC_CRC.unpack_from(buf, pos + _REC_HEAD.size)
    mv = memoryview(buf)
    if zlib.crc32(mv[pos + REC_HEADER_BYTES:end], zlib.crc32(mv[pos:pos + _REC_HEAD.size])) != crc:
        return "CRC mismatch"
    return rtype, seq, end


def decode_record(data: bytes) -> Record:
    """Decode exactly one record (as produced by :func:`encode_record`); ``BadRecord`` if not."""
    got = _parse_at(data, 0)
    if isinstance(got, str):
        raise BadRecord(got)
    rtype, seq, end = got
    if end != len(data):
        raise BadRecord(f"{len(data) - end} trailing bytes after the record")
    return _decode_payload(rtype, seq, memoryview(data)[REC_HEADER_BYTES:end])


def _segment_header(number: int, prev_seq: int, flags: int = 0) -> bytes:
    head = _SEG_HEAD.pack(_SEG_MAGIC, _SEG_VERSION, flags, number, prev_seq)
    return head + _REC_CRC.pack(zlib.crc32(head))


def _parse_segment_header(buf: bytes) -> tuple[int, int, int] | str:
    """``(flags, number, prev_seq)`` or a reason string."""
    if len(buf) < SEG_HEADER_BYTES:
        return "partial segment header"
    magic, version, flags, number, prev_seq = _SEG_HEAD.unpack_from(buf, 0)
    (crc,) = _REC_CRC.unpack_from(buf, _SEG_HEAD.size)
    if magic != _SEG_MAGIC:
        return "not a journal segment (bad magic)"
    if zlib.crc32(buf[:_SEG_HEAD.size]) != crc:
        return "segment header CRC mismatch"
    if version != _SEG_VERSION:
        return f"unsupported segment version {version}"
    return flags, number, prev_seq
