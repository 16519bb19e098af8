"""The journal's replication hooks: what a backup node uses to follow a live one.

Theory of operation
===================

``records_after(seq)`` yields the raw records after ``seq`` (from files, then from memory) for a
backup node; ``JournalGap`` if compaction already summarised them, in which case the backup
installs ``snapshot()`` via ``install_snapshot()`` and continues with ``records_after`` of the
snapshot's ``through_seq``. The backup feeds each record to ``apply(record_bytes)``, which decodes
and applies it with the very code recovery uses, and queues the same bytes for its own flush.

The contract, live side (the node that appends):

* ``records_after(seq)`` sees the journal as it is at the call: every record with a seq above
  ``seq`` up to ``last_seq`` at that moment, each exactly once, in strictly increasing seq
  order with no gap (seqs go up by one per record), whether flushed or still pending (so a
  replica may hold a record before the live node has made it durable). Records
  appended after the call are not included: call again with the last seq applied. It raises
  ``JournalGap`` at the call, never halfway through, when compaction has summarised records
  after ``seq``. The iterator reads files outside the journal's locks and may be consumed on
  any thread; the records are the bytes on disk (the same framing and CRC, see ``records``).
* ``snapshot()`` is the live state as records, consistent as of ``through_seq`` (taken under
  the lock), in seq order, with the original seqs; several live messages of one GROUP come as
  one GROUP record.

Replica side (the backup's own journal, written *only* through these two hooks: its own
appends would assign seqs of their own and the journals would diverge):

* feed every record to ``apply(record_bytes)`` in the order received. It is idempotent: a
  record with ``seq <= last_seq`` is a duplicate, ignored (its seq is returned), so after a
  reconnect the live node may resend from any earlier seq. A record past ``last_seq + 1``
  raises ``JournalGap`` and changes nothing: ask again with ``records_after(last_seq)``.
  Damaged bytes raise ``BadRecord`` and change nothing; a GROUP is applied whole or not at all.
* ``apply`` only queues the bytes (as an append does): the replica holds a record durably once
  its own ``flush()`` has returned a ``synced_seq`` covering it -- only then may it tell the
  live node it has it. (With ``sync = "always"`` ``apply`` flushes itself.)
* on ``JournalGap`` from ``records_after``, ``install_snapshot(live.snapshot())`` replaces the
  replica's whole state (crash-safe: written and fsynced as a compacted segment newer than every
  existing one before the old ones are deleted; durable on return, ``last_seq == synced_seq ==
  through_seq``), then continue with ``records_after(snapshot.through_seq)``. It does not compare
  seqs: installing the same snapshot again gives the same state, but an older snapshot would
  take the replica back -- install one only in answer to a gap.

:class:`Replication` is a mixin of :class:`~broker.store.journal.Journal`.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass
from typing import Iterator

from broker.store.errors import BadRecord, JournalGap
from broker.store.journal.records import (SEG_HEADER_BYTES, RecordType, _parse_at, _payload_add_message,
                                          _payload_group, _payload_kv, decode_record, encode_record)
from broker.store.journal.segments import _Segment, _segment_name
from broker.store.journal.state import StoredMessage


@dataclass(frozen=True)
class Snapshot:
    """The live state as records, covering every seq up to ``through_seq``."""

    through_seq: int
    records: list[bytes]


class SnapshotOrderError(Exception):
    """A queue's live messages were not in seq order (an invariant of ``LiveState``)."""


def _first(x):
    return x[0]


def iter_snapshot(items: tuple) -> Iterator[bytes]:
    """The records of :meth:`Replication.snapshot_items`' ``items``, in seq order, one at a time:
    the same records as :func:`~broker.store.journal.compaction._encode_live`, but a generator,
    so a caller that sends as it goes (a backup's initial sync) never holds the whole encoded
    journal nor spends one long stretch encoding it. Each queue's messages are already in seq
    order (``LiveState.add`` appends a new seq, ``count`` replaces in place), so a lazy merge
    orders them without sorting the live set; the key-value entries (few) are sorted."""
    queues, kv = items
    kv = sorted(kv, key=_first)
    merged = heapq.merge(*[((m.seq, m) for m in q) for q in queues], kv, key=_first)
    cur_seq, cur = -1, []
    for seq, item in merged:
        if seq < cur_seq:
            raise SnapshotOrderError(f"seq {seq} after {cur_seq}")
        if isinstance(item, StoredMessage):
            if seq == cur_seq:
                cur.append(item)        # live messages of one GROUP share its seq
                continue
            if cur:
                yield _message_record(cur_seq, cur)
            cur_seq, cur = seq, [item]
            continue
        if cur:
            yield _message_record(cur_seq, cur)
            cur = []
        cur_seq = seq
        ns, k, e = item
        yield encode_record(RecordType.ADD_KV, seq, _payload_kv(ns, k, e.value))
    if cur:
        yield _message_record(cur_seq, cur)


def _message_record(seq: int, msgs: list) -> bytes:
    payloads = [_payload_add_message(m.queue, m.message_id, m.delivery_count, m.properties, m.body) for m in msgs]
    if len(payloads) == 1:
        return encode_record(RecordType.ADD_MESSAGE, seq, payloads[0])
    return encode_record(RecordType.GROUP, seq, _payload_group([(RecordType.ADD_MESSAGE, p) for p in payloads]))


class Replication:
    """Mixin of ``Journal``: the hooks a backup node uses (see the module docstring)."""

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

    def snapshot(self, tap=None) -> Snapshot:
        """The live state as records (for a replica that fell behind compaction, or a backup's
        initial sync). ``tap``: installed as ``self.tap`` under the same lock, so it sees every
        record appended after ``through_seq`` and none before (a replication stream that starts
        exactly where the snapshot ends); ``tap=None`` leaves the current tap alone."""
        through, items = self.snapshot_items(tap)
        return Snapshot(through, list(iter_snapshot(items)))

    def snapshot_items(self, tap=None) -> tuple[int, tuple]:
        """:meth:`snapshot` without the encoding: ``(through_seq, items)``, where
        :func:`iter_snapshot` makes ``items`` the snapshot's records. Only the capture holds
        the lock: a list of each queue's live messages and of the key-value entries (references;
        the values are immutable, so the node goes on appending while they are encoded)."""
        st = self._state
        with self._lock:
            queues = [list(q.values()) for q in st.messages.values()]
            kv = [(e.seq, (ns, k, e)) for ns, d in st.kv.items() for k, e in d.items()]
            through = self._last_seq
            if tap is not None:
                self.tap = tap
        return through, (queues, kv)

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
            self._state.clear()
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
