"""Journal recovery: replay of the segment files into the live state, torn-tail repair, resync.

Theory of operation
===================

``Journal.open`` lists segments, deletes leftover ``*.compact`` files (an interrupted
compaction), finds the newest *compacted* segment and ignores (deletes) every segment older than
it, then replays records in order, verifying each CRC and that seqs increase. A bad record at
the end of the **last** segment, with no valid record after it, is a torn write: the file is
truncated there and the bytes are reported. A bad record with valid records after it, or in a
non-final segment, is corruption: ``JournalCorrupt`` names file and offset, unless opened with
``repair=True``, which skips to the next valid record, reports it and compacts at once.

To tell the two apart, :meth:`Recovery._resync` scans forward byte by byte for the next whole,
CRC-good record with a plausible seq: a torn tail has none. A last segment too short to hold
its header is a crash while it was being created: it is written again. Everything found is
counted in the :class:`RecoveryReport` (``journal.report``), one line per incident in
``problems``.

Records are applied with ``Journal._apply_record``, the very code a replica's ``apply`` uses.
:class:`Recovery` is a mixin of :class:`~broker.store.journal.Journal`; it runs before the
journal is shared with any other thread, so it takes no lock.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from broker.store.errors import BadRecord, JournalCorrupt
from broker.store.journal.records import (FLAG_COMPACTED, REC_HEADER_BYTES, SEG_HEADER_BYTES, _decode_payload,
                                          _parse_at, _parse_segment_header)
from broker.store.journal.segments import _SEG_NAME, _fsync_dir, _Segment


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


class Recovery:
    """Mixin of ``Journal``: rebuild the state from the segment files (``Journal.open``)."""

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
        rep.messages = sum(len(q) for q in self._state.messages.values())

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
