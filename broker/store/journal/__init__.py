"""The broker's durable journal: append-only segment files, group commit, recovery, compaction.

Theory of operation
===================

Every mutation of durable state is one self-describing, CRC-checked *record* with a sequence
number ``seq`` that increases by exactly one per record for the life of the journal. Records
are appended to segment files in one directory; on open, the files are replayed into an
in-memory live state (the messages of each queue, KV namespaces); compaction rewrites the live
state when the files are mostly dead records; a backup node follows with the same records.
One module per concern, each with its own theory of operation:

``records``      the sans-IO record codec: record types (GROUP too), framing, CRC, payloads,
                 the segment header
``state``        the in-memory live state (:class:`StoredMessage` per queue, KV namespaces)
``segments``     segment files: naming, creation, appending, rolling, fsync of files and dirs
``recovery``     replay of the files on open, torn-tail truncation, resync, :class:`RecoveryReport`
``compaction``   live state as records, the crash-safe compacted-segment protocol
``replication``  ``records_after`` / ``apply`` / ``snapshot`` / ``install_snapshot`` and their
                 contract for a replica
``config``       :class:`JournalConfig` (the ``[journal]`` table)

This module is the facade: :class:`Journal` (assembled from the mixins of ``segments``,
``recovery``, ``compaction`` and ``replication``, which all work on the attributes set up in
``Journal.__init__``) and every public name, so ``from broker.store.journal import ...`` is
the one import.

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

A **hold** (``hold()`` … ``release()``) keeps the newest record and every later one out of
flushes until released (compaction and ``close()`` write them anyway): a caller that appends a
record about a change appended just before (a mirror's batch of events) gets both in one write.

Whatever the mode, a segment is fsynced before the next one is created (so only the last
segment can have a torn tail) and compaction fsyncs what it writes. A failed write or fsync
poisons the journal (``JournalFailed`` from then on): after a failed fsync the kernel may have
dropped the dirty pages, so nothing can be acknowledged any more; restart and recover.

Two locks: ``_lock`` (short, held by appends and by the ``os.write`` part of a flush) and
``_flush_lock`` (serialises flushers and compaction). fsync runs outside ``_lock``.
Every module of the package keeps to it: the live state, ``_pending``, ``_total_bytes`` and
``_last_seq`` change only under ``_lock``; the segment list, the active fd and ``_written_seq``
only under both; ``_synced_seq`` under ``_flush_lock``. Recovery runs inside ``open``, before
anyone else can see the journal, and takes neither.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from broker.store.errors import JournalClosed, JournalFailed, LocalStoreError
# Besides the public names, the private helpers of the single-file module are re-exported here
# (tests use _parse_at and _payload_group, and replace _datasync), so every import keeps working.
from broker.store.journal.compaction import Compaction, _encode_live
from broker.store.journal.config import SYNC_MODES, JournalConfig
from broker.store.journal.records import (_GROUP_OP_HEAD, _GROUP_OP_TYPES, _ID_COUNT, _REC_CRC, _REC_HEAD,
                                          _SEG_HEAD, _SEG_MAGIC, _SEG_VERSION, _TYPES, _U16, _U32, _U64,
                                          FLAG_COMPACTED, MAX_PAYLOAD_BYTES, REC_HEADER_BYTES, SEG_HEADER_BYTES,
                                          GroupOp, Record, RecordType, _decode_group, _decode_payload, _op_size,
                                          _parse_at, _parse_segment_header, _parts_add_message,
                                          _payload_add_message, _payload_group, encode_record_parts,
                                          _payload_kv, _payload_queue_id, _read_str16, _segment_header, _str16,
                                          decode_record, encode_record)
from broker.store.journal.recovery import Recovery, RecoveryReport
from broker.store.journal.replication import Replication, Snapshot
from broker.store.journal.segments import (_SEG_NAME, SegmentFiles, _datasync, _fsync_dir, _Segment,
                                           _segment_name, _write_all)
from broker.store.journal.state import _KV, LiveState, StoredMessage

_EMPTY: Mapping[str, Any] = MappingProxyType({})   # the properties of most messages: none

__all__ = [
    "RecordType", "Record", "StoredMessage", "JournalConfig", "RecoveryReport", "Snapshot",
    "Journal", "GroupOp", "encode_record", "decode_record", "SYNC_MODES",
]



class Journal(SegmentFiles, Recovery, Compaction, Replication):
    """An open journal directory. See the module docstring. Thread-safe as described there."""

    def __init__(self, directory: Path, config: JournalConfig):
        # use Journal.open()
        self.directory = directory
        self.config = config
        self.report = RecoveryReport()
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._state = LiveState()           # messages per queue, KV namespaces, live bytes
        self._last_seq = 0
        self._written_seq = 0
        self._synced_seq = 0
        self._pending: list[tuple[int, bytes]] = []
        self._pending_bytes = 0
        self._holds = 0                     # hold() calls not yet released
        self._hold_from: int | None = None  # while held: records from this seq on wait in _pending
        self._segments: list[_Segment] = []
        self._fd: int | None = None        # active segment, O_APPEND
        self._total_bytes = 0               # record bytes in segments + pending
        self._closed = False
        self._failed: OSError | None = None
        self.compactions = 0
        #: called as ``tap(seq, record_bytes)`` under the lock for every record appended (a
        #: primary's replication stream; set with ``Replication.snapshot(tap=...)``)
        self.tap = None

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

    def _apply_record(self, rec: Record, size: int) -> None:
        """Apply one decoded record to the in-memory state: shared by recovery and replicas."""
        self.report.orphan_records += self._state.apply(rec, size)
        self._last_seq = rec.seq

    @property
    def failure(self) -> str | None:
        """Why the journal refuses every write since a failed write or fsync (ENOSPC, EIO), else
        None: the node cannot store anything until it is restarted."""
        return None if self._failed is None else f"journal {self.directory}: {self._failed}"

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
            _datasync(fd)       # this module's name: the one to replace (see segments._datasync)
        except OSError as exc:
            self._failed = exc
            raise JournalFailed(f"fsync of journal {self.directory} failed: {exc}") from exc

    def _append(self, rtype: RecordType, payload: bytes | tuple, mutate) -> int:
        """``payload``: the bytes, or a tuple of their pieces (joined once, into the record)."""
        with self._lock:
            if self._closed or self._failed is not None:
                self._check_usable()
            seq = self._last_seq + 1
            rec = (encode_record_parts(rtype, seq, payload) if type(payload) is tuple
                   else encode_record(rtype, seq, payload))
            size = len(rec)
            mutate(seq, size)
            self._last_seq = seq
            self._pending.append((seq, rec))
            self._pending_bytes += size
            self._total_bytes += size
            if self.tap is not None:
                self.tap(seq, rec)
        if self.config.sync == "always":
            self.flush()
        return seq

    def add_message(self, queue: str, message_id: int, body: bytes,
                    properties: Mapping[str, Any] | None = None, delivery_count: int = 0) -> int:
        """Record a durable message in ``queue``; returns its seq. ``properties`` is a small
        JSON-able mapping (str keys; str/int/float/bool/None values) the broker needs on recovery
        (address, routing type, priority, expiry...). Re-adding an id replaces the message."""
        props = dict(properties) if properties else _EMPTY
        parts = _parts_add_message(queue, message_id, delivery_count, props, body)
        return self._append(RecordType.ADD_MESSAGE, parts, lambda seq, size: self._state.add(
            StoredMessage(queue, message_id, body, props, delivery_count, seq, size)))

    def ack(self, queue: str, message_id: int) -> int:
        """Record that a message left ``queue`` (acknowledged, expired, dead-lettered...)."""
        return self._append(RecordType.ACK, _payload_queue_id(queue, message_id),
                            lambda seq, size: self._state.ack(queue, message_id))

    def update_delivery_count(self, queue: str, message_id: int, count: int) -> int:
        """Record a message's new delivery count (so redelivery limits survive a restart)."""
        return self._append(RecordType.UPDATE_DELIVERY_COUNT,
                            _payload_queue_id(queue, message_id) + _U32.pack(count),
                            lambda seq, size: self._state.count(queue, message_id, count))

    def put_kv(self, namespace: str, key: str, value: bytes) -> int:
        """Set ``key`` in ``namespace`` (queue/address definitions, subscriptions, caches)."""
        value = bytes(value)
        return self._append(RecordType.ADD_KV, _payload_kv(namespace, key, value),
                            lambda seq, size: self._state.put_kv(namespace, key, _KV(value, seq, size)))

    def delete_kv(self, namespace: str, key: str) -> int:
        """Delete ``key`` from ``namespace`` (a no-op on the state if absent; still a record)."""
        return self._append(RecordType.DEL_KV, _payload_kv(namespace, key),
                            lambda seq, size: self._state.del_kv(namespace, key))

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
                if not self._state.apply_op(op.record(seq), _GROUP_OP_HEAD.size + len(p)):
                    self.report.orphan_records += 1

        return self._append(RecordType.GROUP, payload, mutate)

    # -- durability -----------------------------------------------------------------------------
    def hold(self) -> None:
        """Keep the newest record (if not written yet) and every later one out of flushes until
        :meth:`release`: a caller that appends a record *about* a change just appended (a
        mirror's batch of events) then has both in one write, whatever a concurrent flush does.
        Holds nest. Compaction and :meth:`close` write everything regardless. Whoever answers
        clients after a flush must release first (the node's committer does)."""
        with self._lock:
            self._holds += 1
            if self._hold_from is None:
                self._hold_from = max(self._last_seq, self._written_seq + 1)

    def release(self) -> None:
        """End one :meth:`hold`; the last one lets the next flush write what waited."""
        with self._lock:
            if self._holds > 0:
                self._holds -= 1
                if not self._holds:
                    self._hold_from = None

    @property
    def held_from(self) -> int | None:
        """While held: the first seq that waits (None when not held)."""
        return self._hold_from

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

    def flush(self, *, everything: bool = False) -> int:
        """Write every pending record and make it durable with one fsync; returns ``synced_seq``.
        Held records (:meth:`hold`) wait for a later flush unless ``everything``.

        Blocking: call it from a worker thread (``trio.to_thread.run_sync(journal.flush)``).
        Concurrent callers are serialised; appends may continue meanwhile.
        """
        with self._flush_lock:
            to_sync = self._write_pending(everything)
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

    # -- reading the state ----------------------------------------------------------------------
    def queues(self) -> list[str]:
        """Queues holding at least one live message."""
        with self._lock:
            return list(self._state.messages)

    def messages(self, queue: str) -> list[StoredMessage]:
        """Live messages of ``queue`` in the order they were added."""
        with self._lock:
            return list(self._state.messages.get(queue, {}).values())

    def live_messages(self) -> dict[str, list[StoredMessage]]:
        """Every live message, per queue, in order."""
        with self._lock:
            return {q: list(d.values()) for q, d in self._state.messages.items()}

    def get_message(self, queue: str, message_id: int) -> StoredMessage | None:
        with self._lock:
            return self._state.messages.get(queue, {}).get(message_id)

    def namespaces(self) -> list[str]:
        with self._lock:
            return list(self._state.kv)

    def kv(self, namespace: str) -> dict[str, bytes]:
        """A copy of one KV namespace."""
        with self._lock:
            return {k: e.value for k, e in self._state.kv.get(namespace, {}).items()}

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
            self.flush(everything=True)
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

