"""Journal compaction: the live state encoded as records, written as one compacted segment.

Theory of operation
===================

When dead bytes exceed ``compact_dead_ratio`` of the total (and the total exceeds
``compact_min_bytes``), ``flush()`` compacts (or call :meth:`Compaction.compact`). The protocol
is crash-safe:

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

Compaction runs under ``_flush_lock`` (it is a flush that also rewrites); it holds ``_lock``
only for step 1 and to swap the segment list at the end, so appends continue while it encodes
and writes. :func:`_encode_live` is also what a replication snapshot is made of, and
:meth:`Compaction._write_compacted` is how a replica installs one.

:class:`Compaction` is a mixin of :class:`~broker.store.journal.Journal`.
"""

from __future__ import annotations

import os

from broker.store.journal.records import (FLAG_COMPACTED, SEG_HEADER_BYTES, RecordType, _payload_add_message,
                                          _payload_group, _payload_kv, _segment_header, encode_record)
from broker.store.journal.segments import _fsync_dir, _Segment, _segment_name, _write_all
from broker.store.journal.state import StoredMessage


def _encode_live(live_state, live_kv) -> list[bytes]:
    """The live items (``LiveState.live_items()``) as records, in seq order, with their seqs."""
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


class Compaction:
    """Mixin of ``Journal``: deciding when to compact, and compacting."""

    @property
    def total_bytes(self) -> int:
        """Record bytes in all segments plus pending records."""
        return self._total_bytes

    @property
    def live_bytes(self) -> int:
        """Bytes a compacted journal would need for the current state."""
        return self._state.live_bytes

    def needs_compaction(self) -> bool:
        """True when the journal is big enough and mostly dead records."""
        total = self._total_bytes
        if total < self.config.compact_min_bytes or total == 0:
            return False
        return (total - self._state.live_bytes) / total >= self.config.compact_dead_ratio

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
            live_state, live_kv = self._state.live_items()
        # step 2: make closed segments durable
        for fd in fds[:-1]:
            self._sync_or_fail(fd)
            os.close(fd)
        self._synced_seq = max(self._synced_seq, through)
        records = _encode_live(live_state, live_kv)
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
