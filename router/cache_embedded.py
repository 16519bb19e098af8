"""Embedded persisted sticky cache: one small append-only file, no server needed.

Theory of operation
-------------------
Each line is ``<crc32 hex> <json>\\n`` where the JSON is one record:

* ``["P", key, identity, last_access, stored_at]`` — put (wall-clock seconds, so expiry survives
  a restart: the shell converts to and from its monotonic clock);
* ``["T", key, last_access]`` — access-time update (batched: at most one per key per flush);
* ``["D", key]`` — delete (expired or replaced).

``load()`` replays the file; a line with a bad CRC or a torn last line (crash during a write) is
skipped, so a crash loses at most the last unflushed batch. A torn tail (no final newline) is cut
off, else the next append would be glued onto it and fail its CRC too. ``write()`` appends one batch with one
``os.write`` and an optional fsync; it is called from a worker thread by the shell. A write that
fails half-way (ENOSPC) is cut back to where it began, so the file never keeps a torn record the
next append would be glued to; the shell retries the batch. When the file holds more than twice
as many records as live entries (and at least ``compact_min_records``), ``compact()`` rewrites it
(temp file + ``os.replace``), so its size follows the live entries — which ``max-entries`` and
``max-key-length`` bound — and so does the replay at start.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Iterable


class EmbeddedCacheStore:
    """The append-only cache file of one router."""

    def __init__(self, path: str | Path, *, fsync: bool = True, compact_min_records: int = 4096):
        self.path = Path(path)
        self.fsync = fsync
        self.compact_min_records = compact_min_records
        self.records = 0
        self.skipped = 0
        self._fd: int | None = None
        self._pad = b""

    @staticmethod
    def _line(rec: list) -> bytes:
        body = json.dumps(rec, separators=(",", ":"), ensure_ascii=True).encode("ascii")
        return b"%08x %s\n" % (zlib.crc32(body), body)

    def load(self) -> dict[str, tuple[str, float, float]]:
        """Replay the file: ``key -> (identity, last_access_wall, stored_at_wall)``."""
        out: dict[str, tuple[str, float, float]] = {}
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return out
        self.records = 0
        self.skipped = 0
        cut = data.rfind(b"\n") + 1
        for raw in data[:cut].split(b"\n"):
            if raw:
                self._replay(raw, out)
        tail = data[cut:]  # empty unless the last write was cut short
        if tail:
            if self._replay(tail, out):
                self._pad = b"\n"  # a whole record that only lacks its newline
            else:
                self._cut_torn_tail(cut)
        return out

    def _replay(self, raw: bytes, out: dict[str, tuple[str, float, float]]) -> bool:
        """Apply one line to ``out``; False (and counted in ``skipped``) if it is damaged."""
        crc, _, body = raw.partition(b" ")
        try:
            if int(crc, 16) != zlib.crc32(body):
                raise ValueError("crc")
            rec = json.loads(body)
            op = rec[0]
            if op == "P":
                out[rec[1]] = (rec[2], float(rec[3]), float(rec[4]))
            elif op == "T":
                if rec[1] in out:
                    ident, _, stored = out[rec[1]]
                    out[rec[1]] = (ident, float(rec[2]), stored)
            elif op == "D":
                out.pop(rec[1], None)
            else:
                raise ValueError(op)
        except (ValueError, IndexError, TypeError, KeyError):
            self.skipped += 1
            return False
        self.records += 1
        return True

    def _cut_torn_tail(self, size: int) -> None:
        """Drop the bytes after the last newline (a write cut short by a crash)."""
        try:
            os.truncate(self.path, size)
        except OSError:
            self._pad = b"\n"  # cannot truncate: start the next append on a fresh line

    def _open(self) -> int:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return self._fd

    def write(self, puts: Iterable[tuple[str, str, float, float]],
              touches: Iterable[tuple[str, float]], deletes: Iterable[str]) -> int:
        """Append one batch; returns the number of records written."""
        lines = [self._line(["P", k, ident, la, st]) for k, ident, la, st in puts]
        lines += [self._line(["T", k, la]) for k, la in touches]
        lines += [self._line(["D", k]) for k in deletes]
        if not lines:
            return 0
        fd = self._open()
        data = self._pad + b"".join(lines)
        start = os.lseek(fd, 0, os.SEEK_END)
        view = memoryview(data)
        try:
            while view:
                n = os.write(fd, view)
                view = view[n:]
            if self.fsync:
                os.fsync(fd)
        except OSError:
            try:
                os.ftruncate(fd, start)  # no torn record left behind
            except OSError:
                self._pad = b"\n"
            self.close()  # reopened by the retry (EMFILE/EIO may have been about this fd)
            raise
        self._pad = b""
        self.records += len(lines)
        return len(lines)

    def needs_compaction(self, live_entries: int) -> bool:
        return self.records > max(self.compact_min_records, 2 * live_entries)

    def compact(self, entries: Iterable[tuple[str, str, float, float]]) -> None:
        """Rewrite the file with one put per live entry (atomic replace)."""
        tmp = self.path.with_name(self.path.name + ".compact")
        lines = [self._line(["P", k, ident, la, st]) for k, ident, la, st in entries]
        try:
            with open(tmp, "wb") as fh:
                fh.write(b"".join(lines))
                fh.flush()
                if self.fsync:
                    os.fsync(fh.fileno())
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk must not keep half a copy
            raise
        self.close()
        os.replace(tmp, self.path)
        self.records = len(lines)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
