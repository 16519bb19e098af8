"""The journal's segment files: naming, creation, appending, rolling, fsync of files and directories.

Theory of operation
===================

Records are appended to ``journal-NNNNNNNN.log`` files in one directory. Each segment starts
with a 28-byte header: magic ``LODEJRNL``, version u16, flags u16, segment number u32,
``prev_seq`` u64 (the last seq assigned before this segment's first record), crc32 u32 (its
codec is in ``records``). The active segment is rolled (a new file started) once it reaches
``segment_bytes``.

Appends only queue encoded records in memory; a flush hands them to :meth:`_write_pending`,
which writes them with one ``os.write`` per segment (rolling as it goes) under ``_lock`` and
returns the file descriptors the caller must fsync -- outside ``_lock``, so that appends go on
while the disk works.

Whatever the sync mode, a segment is fsynced before the next one is created (so only the last
segment can have a torn tail), and a new segment file is fsynced, with its directory, before a
record goes into it. A failed write poisons the journal (``JournalFailed`` from then on): the
file may now end in a partial record.

:class:`SegmentFiles` is a mixin of :class:`~broker.store.journal.Journal` and works on its
attributes (``directory``, ``config``, ``_segments``, ``_fd``, ``_pending``, ``_failed`` ...);
fsyncs of records go through ``Journal._sync_or_fail``, which poisons the journal on error.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from broker.store.errors import JournalFailed
from broker.store.journal.records import SEG_HEADER_BYTES, _segment_header

_SEG_NAME = re.compile(r"^journal-(\d{8})\.log$")


def _segment_name(number: int) -> str:
    return f"journal-{number:08d}.log"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# fsync of record data. ``Journal._sync_or_fail`` calls it by its package name,
# ``broker.store.journal._datasync``: that one name is the hook to replace it (tests do).
_datasync = getattr(os, "fdatasync", os.fsync)


@dataclass
class _Segment:
    number: int
    path: Path
    size: int          # bytes in the file (incl. header)
    prev_seq: int
    compacted: bool = False


def _write_all(fd: int, data: bytes) -> int:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    return len(data)


class SegmentFiles:
    """Mixin of ``Journal``: writing pending records into segment files, rolling them."""

    def _write_pending(self, everything: bool = False) -> list[int]:
        """Under _flush_lock: write pending records (rolling segments as needed), except held
        ones (``Journal.hold``) unless ``everything``. Returns the fds needing fsync, the active
        one last; rolled ones must be closed by the caller."""
        with self._lock:
            return self._write_pending_locked(everything)

    def _write_pending_locked(self, everything: bool = True) -> list[int]:
        self._check_usable()
        fds = [self._fd]
        batch: list[bytes] = []
        seg = self._segments[-1]
        pending = self._pending
        keep: list[tuple[int, bytes]] = []
        hold = self._hold_from
        if hold is not None and not everything and pending and pending[-1][0] >= hold:
            cut = len(pending)
            while cut > 0 and pending[cut - 1][0] >= hold:
                cut -= 1
            pending, keep = pending[:cut], pending[cut:]
        for seq, rec in pending:
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
        if pending:
            self._written_seq = pending[-1][0]
        self._pending = keep
        self._pending_bytes = sum(len(rec) for _seq, rec in keep)
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
