"""The broker's durable journal: append-only segment files, group commit, recovery, compaction.

Theory of operation
===================

Records
-------
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

Segments
--------
Records are appended to ``journal-NNNNNNNN.log`` files in one directory. Each segment starts
with a 28-byte header: magic ``LODEJRNL``, version u16, flags u16, segment number u32,
``prev_seq`` u64 (the last seq assigned before this segment's first record), crc32 u32. The
active segment is rolled (a new file started) once it reaches ``segment_bytes``.

Durability (group commit)
-------------------------
``add_message()`` & co. assign the seq, update the in-memory state and queue the encoded record;
they never touch the disk (except with ``sync = "always"``). ``flush()`` writes every queued
record with one ``os.write`` per segment and then makes them durable with **one** fsync, however
many records that was, and returns ``synced_seq``. The broker shell runs ``flush()`` in
``trio.to_thread.run_sync`` and then settles every send whose seq <= the returned value. While a
flush is fsyncing, appends continue and queue up for the next flush: that is the batching.
Modes (``JournalConfig.sync``):

* ``"batch"`` (default) -- as above: a record is durable once a ``flush()`` covering it returns.
* ``"always"`` -- every append writes and fsyncs before returning (one fsync per record;
  call appends from a worker thread). ``flush()`` then has nothing left to do.
* ``"never"`` -- ``flush()`` writes to the OS but never fsyncs: records survive a crash of the
  process but not of the machine. ``synced_seq`` then means "handed to the OS".

Whatever the mode, a segment is fsynced before the next one is created (so only the last
segment can have a torn tail) and compaction fsyncs what it writes. A failed write or fsync
poisons the journal (``JournalFailed`` from then on): after a failed fsync the kernel may have
dropped the dirty pages, so nothing can be acknowledged any more; restart and recover.

Two locks: ``_lock`` (short, held by appends and by the ``os.write`` part of a flush) and
``_flush_lock`` (serialises flushers and compaction). fsync runs outside ``_lock``.

Recovery
--------
``Journal.open`` lists segments, deletes leftover ``*.compact`` files (an interrupted
compaction), finds the newest *compacted* segment and ignores (deletes) every segment older than
it, then replays records in order, verifying each CRC and that seqs increase. A bad record at
the end of the **last** segment, with no valid record after it, is a torn write: the file is
truncated there and the bytes are reported. A bad record with valid records after it, or in a
non-final segment, is corruption: ``JournalCorrupt`` names file and offset, unless opened with
``repair=True``, which skips to the next valid record, reports it and compacts at once.

Compaction (crash-safe protocol)
--------------------------------
When dead bytes exceed ``compact_dead_ratio`` of the total (and the total exceeds
``compact_min_bytes``):

1. write pending records, then roll: segment K is closed, K+1 is the new active segment whose
   ``prev_seq`` is the current last seq; copy the live state (cheap: values are immutable);
2. fsync K and the directory;
3. write the live records (re-encoded with their original seqs, in seq order) to
   ``journal-K.compact`` with the COMPACTED flag and ``prev_seq`` = last seq of K; fsync it;
4. ``rename`` it over ``journal-K.log`` (atomic) and fsync the directory;
5. unlink segments older than K and fsync the directory.

A crash before 4 leaves a ``.compact`` file that recovery deletes (old segments intact). After 4,
recovery sees compacted K and ignores any older segment still present: the compacted segment
holds the complete state up to its ``prev_seq``, and later segments replay on top of it.

Replication
-----------
``records_after(seq)`` yields the raw records after ``seq`` (from files, then from memory) for a
backup node; ``JournalGap`` if compaction already summarised them, in which case the backup
installs ``snapshot()`` via ``install_snapshot()`` and continues with ``records_after`` of the
snapshot's ``through_seq``. The backup feeds each record to ``apply(record_bytes)``, which decodes
and applies it with the very code recovery uses, and queues the same bytes for its own flush.
"""

from __future__ import annotations

import enum
import json
import os
import re
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from broker.store.errors import (BadRecord, JournalClosed, JournalCorrupt, JournalFailed, JournalGap,
                                 LocalStoreError)

__all__ = [
    "RecordType", "Record", "StoredMessage", "JournalConfig", "RecoveryReport", "Snapshot",
    "Journal", "GroupOp", "encode_record", "decode_record", "SYNC_MODES",
]

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

_SEG_NAME = re.compile(r"^journal-(\d{8})\.log$")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_ID_COUNT = struct.Struct(">QI")

SYNC_MODES = ("batch", "always", "never")


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


def _str16(s: str) -> bytes:
    b = s.encode("utf-8")
    if len(b) > 0xFFFF:
        raise LocalStoreError(f"name too long for the journal ({len(b)} bytes > 65535): {s[:40]!r}...")
    return _U16.pack(len(b)) + b


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
    props = (json.dumps(dict(properties), separators=(",", ":"), ensure_ascii=False).encode()
             if properties else b"")
    return b"".join((_str16(queue), _ID_COUNT.pack(message_id, delivery_count),
                     _U32.pack(len(props)), props, body))


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


def _segment_name(number: int) -> str:
    return f"journal-{number:08d}.log"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_datasync = getattr(os, "fdatasync", os.fsync)

# -- state ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """A live durable message in one queue. Immutable: updates replace it."""

    queue: str
    message_id: int
    body: bytes
    properties: Mapping[str, Any]
    delivery_count: int
    seq: int        # seq of its ADD_MESSAGE record
    size: int       # bytes of that record on disk


@dataclass(frozen=True, slots=True)
class _KV:
    value: bytes
    seq: int
    size: int


@dataclass(frozen=True)
class JournalConfig:
    """Journal settings (the ``[journal]`` table of a broker config).

    ``sync``: ``"batch"`` | ``"always"`` | ``"never"`` (see the module docstring).
    ``segment_bytes``: roll the active segment once it reaches this size.
    ``compact_min_bytes``: never compact a journal smaller than this.
    ``compact_dead_ratio``: compact when dead bytes / total bytes reaches this (0 < r < 1).
    ``auto_compact``: let ``flush()`` compact (after it has made its records durable).
    """

    sync: str = "batch"
    segment_bytes: int = 16 * 1024 * 1024
    compact_min_bytes: int = 32 * 1024 * 1024
    compact_dead_ratio: float = 0.5
    auto_compact: bool = True

    def __post_init__(self) -> None:
        if self.sync not in SYNC_MODES:
            raise ValueError(f"sync {self.sync!r} must be one of {', '.join(SYNC_MODES)}")
        if self.segment_bytes < 4096:
            raise ValueError(f"segment_bytes {self.segment_bytes} must be >= 4096")
        if not 0.0 < self.compact_dead_ratio < 1.0:
            raise ValueError(f"compact_dead_ratio {self.compact_dead_ratio} must be between 0 and 1")

    @classmethod
    def from_table(cls, t: "Any") -> "JournalConfig":
        """Read a ``broker.tomlconfig.Table`` (keys: sync, segment-bytes, compact-min-bytes,
        compact-dead-ratio, auto-compact); calls ``t.done()``."""
        ratio = t.float("compact-dead-ratio", cls.compact_dead_ratio, min=0.01)
        if ratio >= 1.0:
            raise t.error("compact-dead-ratio", f"{ratio} must be < 1")
        cfg = cls(
            sync=t.choice("sync", SYNC_MODES, "batch"),
            segment_bytes=t.int("segment-bytes", cls.segment_bytes, min=4096),
            compact_min_bytes=t.int("compact-min-bytes", cls.compact_min_bytes, min=0),
            compact_dead_ratio=ratio,
            auto_compact=t.bool("auto-compact", True),
        )
        t.done()
        return cfg


@dataclass
class RecoveryReport:
    """What ``Journal.open`` found. ``problems`` has one human-readable line per incident."""

    segments: int = 0
    records_read: int = 0
    torn_bytes_truncated: int = 0
    corrupt_records: int = 0        # damaged regions skipped (repair=True only)
    corrupt_bytes: int = 0
    stale_segments_removed: int = 0  # older than a compacted segment (interrupted compaction)
    leftover_compactions_removed: int = 0
    orphan_records: int = 0         # ACK/UPDATE for a message not in the journal (harmless)
    last_seq: int = 0
    messages: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.torn_bytes_truncated or self.corrupt_records)


@dataclass(frozen=True)
class Snapshot:
    """The live state as records, covering every seq up to ``through_seq``."""

    through_seq: int
    records: list[bytes]


@dataclass
class _Segment:
    number: int
    path: Path
    size: int          # bytes in the file (incl. header)
    prev_seq: int
    compacted: bool = False


class Journal:
    """An open journal directory. See the module docstring. Thread-safe as described there."""

    def __init__(self, directory: Path, config: JournalConfig):
        # use Journal.open()
        self.directory = directory
        self.config = config
        self.report = RecoveryReport()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._messages: dict[str, dict[int, StoredMessage]] = {}
        self._kv: dict[str, dict[str, _KV]] = {}
        self._last_seq = 0
        self._written_seq = 0
        self._synced_seq = 0
        self._pending: list[tuple[int, bytes]] = []
        self._pending_bytes = 0
        self._segments: list[_Segment] = []
        self._fd: int | None = None        # active segment, O_APPEND
        self._total_bytes = 0               # record bytes in segments + pending
        self._live_bytes = 0
        self._closed = False
        self._failed: OSError | None = None
        self.compactions = 0

    # -- opening / recovery -------------------------------------------------------------------
    @classmethod
    def open(cls, directory: str | Path, config: JournalConfig | None = None, *,
             repair: bool = False) -> "Journal":
        """Open (creating if needed) the journal in ``directory`` and recover its state.

        The recovery outcome is in ``journal.report`` (a :class:`RecoveryReport`). Raises
        ``JournalCorrupt`` for damage that is not a torn tail, unless ``repair`` is true.
        The caller must hold the data directory lock (see ``broker.store.datadir``).
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        j = cls(d, config or JournalConfig())
        j._recover(repair)
        if repair and j.report.corrupt_records:
            j.compact()
        return j

    def _recover(self, repair: bool) -> None:
        rep = self.report
        for leftover in self.directory.glob("journal-*.compact"):
            leftover.unlink()
            rep.leftover_compactions_removed += 1
            rep.problems.append(f"removed {leftover.name}: an interrupted compaction")
        numbered = sorted((int(m.group(1)), self.directory / name)
                          for name in os.listdir(self.directory) if (m := _SEG_NAME.match(name)))
        headers: dict[int, tuple[int, int, int] | str] = {}
        for number, path in numbered:
            with path.open("rb") as fh:
                headers[number] = _parse_segment_header(fh.read(SEG_HEADER_BYTES))
        # The newest compacted segment holds everything before it: older files are leftovers.
        start = 0
        for i, (number, _) in enumerate(numbered):
            h = headers[number]
            if not isinstance(h, str) and h[0] & FLAG_COMPACTED:
                start = i
        for number, path in numbered[:start]:
            path.unlink()
            rep.stale_segments_removed += 1
        if start:
            _fsync_dir(self.directory)
        numbered = numbered[start:]

        last = len(numbered) - 1
        for i, (number, path) in enumerate(numbered):
            h = headers[number]
            data = path.read_bytes()
            if isinstance(h, str):
                if i == last and len(data) < SEG_HEADER_BYTES:
                    # crashed while creating the segment: start it again
                    rep.torn_bytes_truncated += len(data)
                    rep.problems.append(f"{path.name}: {h} ({len(data)} bytes); rewritten")
                    self._write_new_segment_file(path, number, self._last_seq)
                    self._segments.append(_Segment(number, path, SEG_HEADER_BYTES, self._last_seq))
                    continue
                raise JournalCorrupt(path, 0, h)
            flags, hnum, prev_seq = h
            if hnum != number:
                raise JournalCorrupt(path, 0, f"segment header says number {hnum}")
            end = self._replay_segment(path, data, is_last=(i == last), repair=repair)
            if end < len(data):
                with path.open("r+b") as fh:
                    fh.truncate(end)
                    fh.flush()
                    os.fsync(fh.fileno())
            self._last_seq = max(self._last_seq, prev_seq)
            self._segments.append(_Segment(number, path, end, prev_seq, bool(flags & FLAG_COMPACTED)))
            self._total_bytes += end - SEG_HEADER_BYTES
            rep.segments += 1
        if not self._segments or self._segments[-1].compacted:
            # never append to a compacted segment: replication skips those files
            self._start_segment(self._segments[-1].number + 1 if self._segments else 1, self._last_seq)
        self._fd = os.open(self._segments[-1].path, os.O_WRONLY | os.O_APPEND)
        self._written_seq = self._synced_seq = self._last_seq
        rep.last_seq = self._last_seq
        rep.messages = sum(len(q) for q in self._messages.values())

    def _replay_segment(self, path: Path, data: bytes, *, is_last: bool, repair: bool) -> int:
        """Apply the records of one segment; returns the offset where valid data ends."""
        rep = self.report
        pos = SEG_HEADER_BYTES
        mv = memoryview(data)
        while pos < len(data):
            got = _parse_at(data, pos)
            reason = got if isinstance(got, str) else None
            if reason is None:
                rtype, seq, end = got  # type: ignore[misc]
                if seq <= self._last_seq:
                    reason = f"seq {seq} does not follow {self._last_seq}"
                else:
                    try:
                        rec = _decode_payload(rtype, seq, mv[pos + REC_HEADER_BYTES:end])
                    except BadRecord as exc:
                        reason = str(exc)
            if reason is None:
                self._apply_record(rec, end - pos)
                rep.records_read += 1
                pos = end
                continue
            nxt = self._resync(data, pos + 1)
            if nxt is None and is_last:
                rep.torn_bytes_truncated += len(data) - pos
                rep.problems.append(f"{path.name}: torn tail at byte {pos} ({reason}); "
                                    f"truncated {len(data) - pos} bytes")
                return pos
            if not repair:
                raise JournalCorrupt(path, pos, reason)
            skip_to = len(data) if nxt is None else nxt
            rep.corrupt_records += 1
            rep.corrupt_bytes += skip_to - pos
            rep.problems.append(f"{path.name}: corrupt at byte {pos} ({reason}); "
                                f"skipped {skip_to - pos} bytes")
            if nxt is None:
                # a non-final segment damaged to its end: kept as is, compaction rewrites it
                return len(data)
            pos = nxt
        return pos

    def _resync(self, data: bytes, start: int) -> int | None:
        """The offset of the next whole, CRC-good record with a plausible seq at or after
        ``start``, or None. Used to tell a torn tail (nothing valid follows) from corruption."""
        for pos in range(start, len(data) - REC_HEADER_BYTES + 1):
            got = _parse_at(data, pos)
            if not isinstance(got, str) and got[1] > self._last_seq:
                return pos
        return None

    def _apply_record(self, rec: Record, size: int) -> None:
        """Apply one decoded record to the in-memory state: shared by recovery and replicas."""
        t = rec.type
        if t == RecordType.ADD_MESSAGE:
            self._state_add(StoredMessage(rec.queue, rec.message_id, rec.body, rec.properties or {},
                                          rec.delivery_count, rec.seq, size))
        elif t == RecordType.ACK:
            if not self._state_ack(rec.queue, rec.message_id):
                self.report.orphan_records += 1
        elif t == RecordType.UPDATE_DELIVERY_COUNT:
            if not self._state_count(rec.queue, rec.message_id, rec.delivery_count):
                self.report.orphan_records += 1
        elif t == RecordType.ADD_KV:
            self._state_put_kv(rec.namespace, rec.key, _KV(rec.value, rec.seq, size))
        elif t == RecordType.DEL_KV:
            self._state_del_kv(rec.namespace, rec.key)
        elif t == RecordType.GROUP:
            for op in rec.ops or ():
                self._apply_op(op, _op_size(op))
        self._last_seq = rec.seq

    def _apply_op(self, rec: Record, size: int) -> None:
        """One operation of a GROUP record (the record's own seq is set by the caller)."""
        t = rec.type
        if t == RecordType.ADD_MESSAGE:
            self._state_add(StoredMessage(rec.queue, rec.message_id, rec.body, rec.properties or {},
                                          rec.delivery_count, rec.seq, size))
        elif t == RecordType.ACK:
            if not self._state_ack(rec.queue, rec.message_id):
                self.report.orphan_records += 1
        elif t == RecordType.UPDATE_DELIVERY_COUNT:
            if not self._state_count(rec.queue, rec.message_id, rec.delivery_count):
                self.report.orphan_records += 1

    # -- state mutations (callers hold _lock or are single-threaded) -----------------------------
    def _state_add(self, m: StoredMessage) -> None:
        q = self._messages.setdefault(m.queue, {})
        old = q.pop(m.message_id, None)
        if old is not None:
            self._live_bytes -= old.size
        q[m.message_id] = m
        self._live_bytes += m.size

    def _state_ack(self, queue: str, message_id: int) -> bool:
        q = self._messages.get(queue)
        m = q.pop(message_id, None) if q is not None else None
        if m is None:
            return False
        self._live_bytes -= m.size
        if not q:
            del self._messages[queue]
        return True

    def _state_count(self, queue: str, message_id: int, count: int) -> bool:
        q = self._messages.get(queue)
        m = q.get(message_id) if q is not None else None
        if m is None:
            return False
        q[message_id] = StoredMessage(m.queue, m.message_id, m.body, m.properties, count, m.seq, m.size)
        return True

    def _state_put_kv(self, ns: str, key: str, entry: _KV) -> None:
        d = self._kv.setdefault(ns, {})
        old = d.get(key)
        if old is not None:
            self._live_bytes -= old.size
        d[key] = entry
        self._live_bytes += entry.size

    def _state_del_kv(self, ns: str, key: str) -> None:
        d = self._kv.get(ns)
        old = d.pop(key, None) if d is not None else None
        if old is not None:
            self._live_bytes -= old.size
            if not d:
                del self._kv[ns]

    # -- appends --------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._closed:
            raise JournalClosed("journal is closed")
        if self._failed is not None:
            raise JournalFailed(f"journal {self.directory} failed to write or fsync "
                                f"({self._failed}); restart the broker to recover from disk")

    def _sync_or_fail(self, fd: int) -> None:
        """fsync; an error poisons the journal: after a failed fsync Linux may drop the dirty
        pages and report success next time, so nothing written since can be trusted."""
        try:
            _datasync(fd)
        except OSError as exc:
            self._failed = exc
            raise JournalFailed(f"fsync of journal {self.directory} failed: {exc}") from exc

    def _append(self, rtype: RecordType, payload: bytes, mutate) -> int:
        with self._lock:
            self._check_usable()
            seq = self._last_seq + 1
            rec = encode_record(rtype, seq, payload)
            mutate(seq, len(rec))
            self._last_seq = seq
            self._pending.append((seq, rec))
            self._pending_bytes += len(rec)
            self._total_bytes += len(rec)
        if self.config.sync == "always":
            self.flush()
        return seq

    def add_message(self, queue: str, message_id: int, body: bytes,
                    properties: Mapping[str, Any] | None = None, delivery_count: int = 0) -> int:
        """Record a durable message in ``queue``; returns its seq. ``properties`` is a small
        JSON-able mapping (str keys; str/int/float/bool/None values) the broker needs on recovery
        (address, routing type, priority, expiry...). Re-adding an id replaces the message."""
        props = dict(properties) if properties else {}
        payload = _payload_add_message(queue, message_id, delivery_count, props, body)
        return self._append(RecordType.ADD_MESSAGE, payload, lambda seq, size: self._state_add(
            StoredMessage(queue, message_id, body, props, delivery_count, seq, size)))

    def ack(self, queue: str, message_id: int) -> int:
        """Record that a message left ``queue`` (acknowledged, expired, dead-lettered...)."""
        return self._append(RecordType.ACK, _payload_queue_id(queue, message_id),
                            lambda seq, size: self._state_ack(queue, message_id))

    def update_delivery_count(self, queue: str, message_id: int, count: int) -> int:
        """Record a message's new delivery count (so redelivery limits survive a restart)."""
        return self._append(RecordType.UPDATE_DELIVERY_COUNT,
                            _payload_queue_id(queue, message_id) + _U32.pack(count),
                            lambda seq, size: self._state_count(queue, message_id, count))

    def put_kv(self, namespace: str, key: str, value: bytes) -> int:
        """Set ``key`` in ``namespace`` (queue/address definitions, subscriptions, caches)."""
        value = bytes(value)
        return self._append(RecordType.ADD_KV, _payload_kv(namespace, key, value),
                            lambda seq, size: self._state_put_kv(namespace, key, _KV(value, seq, size)))

    def delete_kv(self, namespace: str, key: str) -> int:
        """Delete ``key`` from ``namespace`` (a no-op on the state if absent; still a record)."""
        return self._append(RecordType.DEL_KV, _payload_kv(namespace, key),
                            lambda seq, size: self._state_del_kv(namespace, key))

    def append_group(self, ops: list["GroupOp"]) -> int:
        """Record several message operations atomically, as one GROUP record; returns its seq.

        ``ops`` are :class:`GroupOp` values (``GroupOp.add`` / ``.ack`` / ``.count``), applied in
        order. A committed transaction is one group: after a crash (or on a replica) either
        every operation is there or none is.
        """
        if not ops:
            raise LocalStoreError("an empty group")
        encoded = [(op.type, op.payload()) for op in ops]
        payload = _payload_group(encoded)

        def mutate(seq: int, size: int) -> None:
            for op, (_, p) in zip(ops, encoded):
                self._apply_op(op.record(seq), _GROUP_OP_HEAD.size + len(p))

        return self._append(RecordType.GROUP, payload, mutate)

    # -- durability -----------------------------------------------------------------------------
    @property
    def last_seq(self) -> int:
        """The seq of the newest record appended (durable or not)."""
        return self._last_seq

    @property
    def written_seq(self) -> int:
        """Every record up to this seq has been handed to the OS."""
        return self._written_seq

    @property
    def synced_seq(self) -> int:
        """Every record up to this seq is durable (per the sync mode)."""
        return self._synced_seq

    def flush(self) -> int:
        """Write every pending record and make it durable with one fsync; returns ``synced_seq``.

        Blocking: call it from a worker thread (``trio.to_thread.run_sync(journal.flush)``).
        Concurrent callers are serialised; appends may continue meanwhile.
        """
        with self._flush_lock:
            to_sync = self._write_pending()
            if self.config.sync != "never":
                for fd in to_sync:
                    self._sync_or_fail(fd)
            for fd in to_sync[:-1]:
                os.close(fd)     # rolled segments: durable now, no longer written
            self._synced_seq = max(self._synced_seq, self._written_seq)
            synced = self._synced_seq
            if self.config.auto_compact and self.needs_compaction():
                self._compact_locked()
        return synced

    def _write_pending(self) -> list[int]:
        """Under _flush_lock: write pending records (rolling segments as needed). Returns the
        fds needing fsync, the active one last; rolled ones must be closed by the caller."""
        with self._lock:
            return self._write_pending_locked()

    def _write_pending_locked(self) -> list[int]:
        self._check_usable()
        fds = [self._fd]
        batch: list[bytes] = []
        seg = self._segments[-1]
        for seq, rec in self._pending:
            if seg.size + len(rec) > self.config.segment_bytes and seg.size > SEG_HEADER_BYTES:
                if batch:
                    try:
                        _write_all(self._fd, b"".join(batch))
                    except OSError as exc:
                        self._failed = exc
                        raise JournalFailed(f"write to journal {self.directory} failed: {exc}") from exc
                    batch = []
                seg = self._roll(prev_seq=seq - 1)
                fds.append(self._fd)
            batch.append(rec)
            seg.size += len(rec)
        if batch:
            try:
                _write_all(self._fd, b"".join(batch))
            except OSError as exc:      # e.g. ENOSPC: the file may now end in a partial record
                self._failed = exc
                raise JournalFailed(f"write to journal {self.directory} failed: {exc}") from exc
        if self._pending:
            self._written_seq = self._pending[-1][0]
        self._pending = []
        self._pending_bytes = 0
        return fds

    def _roll(self, prev_seq: int) -> _Segment:
        """Start a new active segment (caller holds _lock and keeps the old fd to close).

        The old segment is fsynced *before* the new one exists, whatever the sync mode, so a
        non-final segment is always complete and damage in one is real corruption, never a
        torn write."""
        self._sync_or_fail(self._fd)
        seg = self._start_segment(self._segments[-1].number + 1, prev_seq)
        self._fd = os.open(seg.path, os.O_WRONLY | os.O_APPEND)
        return seg

    def _start_segment(self, number: int, prev_seq: int) -> _Segment:
        path = self.directory / _segment_name(number)
        self._write_new_segment_file(path, number, prev_seq)
        seg = _Segment(number, path, SEG_HEADER_BYTES, prev_seq)
        self._segments.append(seg)
        return seg

    def _write_new_segment_file(self, path: Path, number: int, prev_seq: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, _segment_header(number, prev_seq))
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(self.directory)

    # -- compaction -----------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        """Record bytes in all segments plus pending records."""
        return self._total_bytes

    @property
    def live_bytes(self) -> int:
        """Bytes a compacted journal would need for the current state."""
        return self._live_bytes

    def needs_compaction(self) -> bool:
        """True when the journal is big enough and mostly dead records."""
        total = self._total_bytes
        if total < self.config.compact_min_bytes or total == 0:
            return False
        return (total - self._live_bytes) / total >= self.config.compact_dead_ratio

    def compact(self) -> int:
        """Rewrite the live records into one segment and delete the old ones (see the module
        docstring for the crash-safe protocol). Blocking. Returns the bytes reclaimed."""
        with self._flush_lock:
            return self._compact_locked()

    def _compact_locked(self) -> int:
        before = self._total_bytes
        # step 1: write everything pending, roll, and capture the live set
        with self._lock:
            self._check_usable()
            fds = self._write_pending_locked()
            through = self._last_seq
            closing = self._segments[-1]
            self._roll(prev_seq=through)
            fds.append(self._fd)
            live_state = [(m.seq, m) for q in self._messages.values() for m in q.values()]
            live_kv = [(e.seq, (ns, k, e)) for ns, d in self._kv.items() for k, e in d.items()]
        # step 2: make closed segments durable
        for fd in fds[:-1]:
            self._sync_or_fail(fd)
            os.close(fd)
        self._synced_seq = max(self._synced_seq, through)
        records = self._encode_live(live_state, live_kv)
        # steps 3-5
        old = [s for s in self._segments if s.number <= closing.number]
        size = self._write_compacted(closing.number, through, records)
        for s in old:
            if s.number < closing.number:
                s.path.unlink()
        _fsync_dir(self.directory)
        with self._lock:
            keep = [s for s in self._segments if s.number > closing.number]
            new_seg = _Segment(closing.number, closing.path, size, through, compacted=True)
            self._segments = [new_seg] + keep
            written_after = sum(s.size - SEG_HEADER_BYTES for s in keep)
            self._total_bytes = (size - SEG_HEADER_BYTES) + written_after + self._pending_bytes
        self.compactions += 1
        return max(0, before - self._total_bytes)

    @staticmethod
    def _encode_live(live_state, live_kv) -> list[bytes]:
        items = sorted(live_state + live_kv, key=lambda x: x[0])
        out = []
        i = 0
        while i < len(items):
            seq, item = items[i]
            if isinstance(item, StoredMessage):
                # live messages of one GROUP share its seq: keep them together in one GROUP
                j = i + 1
                while j < len(items) and items[j][0] == seq:
                    j += 1
                payloads = [_payload_add_message(m.queue, m.message_id, m.delivery_count, m.properties, m.body)
                            for _, m in items[i:j]]
                if j - i == 1:
                    out.append(encode_record(RecordType.ADD_MESSAGE, seq, payloads[0]))
                else:
                    out.append(encode_record(RecordType.GROUP, seq, _payload_group(
                        [(RecordType.ADD_MESSAGE, p) for p in payloads])))
                i = j
                continue
            i += 1
            ns, k, e = item
            out.append(encode_record(RecordType.ADD_KV, seq, _payload_kv(ns, k, e.value)))
        return out

    def _write_compacted(self, number: int, through: int, records: list[bytes]) -> int:
        """Steps 3-4: write ``journal-N.compact``, fsync, rename over ``journal-N.log``,
        fsync the directory. Returns the file size."""
        tmp = self.directory / f"journal-{number:08d}.compact"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        size = 0
        try:
            chunk: list[bytes] = [_segment_header(number, through, FLAG_COMPACTED)]
            chunk_bytes = 0
            for rec in records:
                chunk.append(rec)
                chunk_bytes += len(rec)
                if chunk_bytes >= 1 << 20:
                    size += _write_all(fd, b"".join(chunk))
                    chunk, chunk_bytes = [], 0
            size += _write_all(fd, b"".join(chunk))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, self.directory / _segment_name(number))
        _fsync_dir(self.directory)
        return size

    # -- replication ----------------------------------------------------------------------------
    def records_after(self, seq: int) -> Iterator[bytes]:
        """Raw records with seq > ``seq``, in order: those written to files, then pending ones.

        Raises ``JournalGap`` (immediately) if compaction has summarised records after ``seq``;
        the replica must then ``install_snapshot(snapshot())``.
        """
        with self._lock:
            self._check_usable()
            segs = list(self._segments)
            first = segs[0]
            if first.compacted and seq < first.prev_seq:
                raise JournalGap(f"records after seq {seq} were compacted (history starts after "
                                 f"seq {first.prev_seq}); install a snapshot")
            files = []
            for s in segs:
                if s.compacted:
                    continue
                files.append((os.open(s.path, os.O_RDONLY), s.size))
            pending = list(self._pending)
        return self._iter_records_after(seq, files, pending)

    @staticmethod
    def _iter_records_after(seq: int, files: list[tuple[int, int]],
                            pending: list[tuple[int, bytes]]) -> Iterator[bytes]:
        try:
            for fd, size in files:
                data = os.pread(fd, size, 0)
                pos = SEG_HEADER_BYTES
                while pos < len(data):
                    got = _parse_at(data, pos)
                    if isinstance(got, str):
                        raise BadRecord(f"journal changed under a reader: {got}")
                    _, rseq, end = got
                    if rseq > seq:
                        yield data[pos:end]
                    pos = end
        finally:
            for fd, _ in files:
                os.close(fd)
        for rseq, rec in pending:
            if rseq > seq:
                yield rec

    def apply(self, record_bytes: bytes) -> int:
        """Replica side: apply one record received from the live node and queue it for this
        journal's own flush. The record must be the next seq (``last_seq + 1``); an older one is
        a duplicate and ignored (returns its seq), a newer one raises ``JournalGap``."""
        rec = decode_record(bytes(record_bytes))
        with self._lock:
            self._check_usable()
            if rec.seq <= self._last_seq:
                return rec.seq
            if rec.seq != self._last_seq + 1:
                raise JournalGap(f"replica at seq {self._last_seq} received seq {rec.seq}")
            data = bytes(record_bytes)
            self._apply_record(rec, len(data))
            self._pending.append((rec.seq, data))
            self._pending_bytes += len(data)
            self._total_bytes += len(data)
        if self.config.sync == "always":
            self.flush()
        return rec.seq

    def snapshot(self) -> Snapshot:
        """The live state as records (for a replica that fell behind compaction)."""
        with self._lock:
            live_state = [(m.seq, m) for q in self._messages.values() for m in q.values()]
            live_kv = [(e.seq, (ns, k, e)) for ns, d in self._kv.items() for k, e in d.items()]
            through = self._last_seq
        return Snapshot(through, self._encode_live(live_state, live_kv))

    def install_snapshot(self, snap: Snapshot) -> None:
        """Replica side: replace this journal's whole state by ``snap`` (crash-safe: the
        snapshot is written as a compacted segment newer than every existing one)."""
        decoded = [decode_record(r) for r in snap.records]
        with self._flush_lock, self._lock:
            self._check_usable()
            os.close(self._fd)
            number = self._segments[-1].number + 1
            size = self._write_compacted(number, snap.through_seq, list(snap.records))
            for s in self._segments:
                s.path.unlink()
            self._messages.clear()
            self._kv.clear()
            self._live_bytes = 0
            self._last_seq = 0
            for rec, raw in zip(decoded, snap.records):
                self._apply_record(rec, len(raw))
            self._last_seq = self._written_seq = self._synced_seq = snap.through_seq
            self._pending = []
            self._pending_bytes = 0
            self._segments = [_Segment(number, self.directory / _segment_name(number), size,
                                       snap.through_seq, compacted=True)]
            self._total_bytes = size - SEG_HEADER_BYTES
            self._start_segment(number + 1, snap.through_seq)
            self._fd = os.open(self._segments[-1].path, os.O_WRONLY | os.O_APPEND)

    # -- reading the state ----------------------------------------------------------------------
    def queues(self) -> list[str]:
        """Queues holding at least one live message."""
        with self._lock:
            return list(self._messages)

    def messages(self, queue: str) -> list[StoredMessage]:
        """Live messages of ``queue`` in the order they were added."""
        with self._lock:
            return list(self._messages.get(queue, {}).values())

    def live_messages(self) -> dict[str, list[StoredMessage]]:
        """Every live message, per queue, in order."""
        with self._lock:
            return {q: list(d.values()) for q, d in self._messages.items()}

    def get_message(self, queue: str, message_id: int) -> StoredMessage | None:
        with self._lock:
            return self._messages.get(queue, {}).get(message_id)

    def namespaces(self) -> list[str]:
        with self._lock:
            return list(self._kv)

    def kv(self, namespace: str) -> dict[str, bytes]:
        """A copy of one KV namespace."""
        with self._lock:
            return {k: e.value for k, e in self._kv.get(namespace, {}).items()}

    def segment_files(self) -> list[Path]:
        """The segment files, oldest first (for tests and operations)."""
        with self._lock:
            return [s.path for s in self._segments]

    # -- closing --------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush (and fsync, per the sync mode) everything pending, then close the files."""
        if self._closed:
            return
        try:
            self.flush()
        except JournalFailed:
            pass            # already reported to whoever appended; just release the files
        with self._flush_lock, self._lock:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    return len(data)
