"""The routing log: one JSON object per line for every routing decision, and one more when a
proxied connection closes. The schema is documented in docs/router.md ("Routing log"); the Spark
job reads it, so fields are only ever added, never renamed.

The hot path only appends an encoded line to an in-memory list (:meth:`RouteLog.write`). A
background task (:meth:`RouteLog.run`) hands the batch to a worker thread every
``flush_interval_s``, which appends it to the file and rotates by size (``path`` →
``path.1`` → … → ``path.<backup_count>``). Nothing waits for fsync: a crash can lose at most
one flush interval of lines, never corrupt earlier ones. Each process writes its own file (see
:func:`worker_log_path`), so several workers never interleave writes.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from json.encoder import encode_basestring as _encode_str  # what json.dumps(ensure_ascii=False) uses
from pathlib import Path
from typing import Any

import trio

SCHEMA_VERSION = 1


def worker_log_path(path: Path, worker: int, workers: int) -> Path:
    """The file one worker writes: ``routing.log`` with one worker, ``routing-w<N>.log`` with
    several (one file per worker, so no two processes share a file)."""
    if workers <= 1:
        return path
    return path.with_name(f"{path.stem}-w{worker}{path.suffix}")


_ts_cache: list = [None, ""]  # [whole second, "YYYY-MM-DDTHH:MM:SS"]


def utc_timestamp(epoch_s: float) -> str:
    """RFC 3339 UTC with microseconds, e.g. ``2025-01-02T03:04:05.123456Z`` (the date part is
    formatted once per second: this runs for every routing-log line)."""
    sec = int(epoch_s // 1)
    if _ts_cache[0] != sec:
        _ts_cache[0] = sec
        _ts_cache[1] = datetime.fromtimestamp(sec, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{_ts_cache[1]}.{int((epoch_s - sec) * 1e6):06d}Z"


# -- hand-rolled JSON for the hot path ----------------------------------------------------------
# The edge writes two lines per proxied connection; building a dict and running json.dumps on it
# cost more than the routing decision. These helpers let it format a line directly with
# f-strings; each produces exactly what ``json.dumps(x, separators=(",", ":"),
# ensure_ascii=False)`` would (anything unusual falls back to it).


def _dumps(x: Any) -> str:
    return json.dumps(x, separators=(",", ":"), ensure_ascii=False)


def json_str(x: Any) -> str:
    """A JSON string (or ``null``) for a str-or-None field."""
    if x is None:
        return "null"
    if isinstance(x, str):
        return _encode_str(x)
    return _dumps(x)


def json_int(x: Any) -> str:
    """A JSON number for an int field."""
    return str(x) if x.__class__ is int else _dumps(x)


def json_bool(x: Any) -> str:
    """``true``/``false`` for a bool field."""
    if x is True:
        return "true"
    if x is False:
        return "false"
    return _dumps(x)


def json_float(x: Any) -> str:
    """A JSON number for a float field (``float.__repr__``, as json does)."""
    if x.__class__ is float and x == x and x not in (float("inf"), float("-inf")):
        return float.__repr__(x)
    return _dumps(x)


def json_str_list(xs) -> str:
    """A JSON array of strings."""
    return "[" + ",".join([json_str(x) for x in xs]) + "]"


class RouteLog:
    """A buffered, size-rotated JSON-lines file. ``path`` None makes a log that drops lines
    (routing log disabled) but still counts them."""

    def __init__(self, path: Path | None, *, max_bytes: int = 50 * 1024 * 1024, backup_count: int = 5,
                 flush_interval_s: float = 0.5, max_buffered_lines: int = 100_000):
        self.path = Path(path) if path is not None else None
        self.max_bytes = max_bytes
        self.backup_count = backup_count
        self.flush_interval_s = flush_interval_s
        self.max_buffered_lines = max_buffered_lines
        self._buffer: list[str] = []
        self._lock = trio.Lock()  # one flush at a time
        self._file = None
        self._size = 0
        self.lines_written = 0
        self.lines_dropped = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    # -- hot path ----------------------------------------------------------------------------
    def write(self, record: dict[str, Any]) -> None:
        """Queue one record (a JSON object). Never blocks; if the writer has fallen hopelessly
        behind (``max_buffered_lines``), the line is dropped and counted instead of growing memory."""
        if self.path is None:
            return
        if len(self._buffer) >= self.max_buffered_lines:
            self.lines_dropped += 1
            return
        self._buffer.append(_dumps(record))

    def write_line(self, line: str) -> None:
        """Queue one already-encoded JSON object (one line, no newline); same rules as
        :meth:`write`. The edge formats its lines itself with the ``json_*`` helpers."""
        if self.path is None:
            return
        if len(self._buffer) >= self.max_buffered_lines:
            self.lines_dropped += 1
            return
        self._buffer.append(line)

    # -- background --------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Flush periodically until cancelled; the final flush happens in :meth:`aclose`."""
        task_status.started()
        while True:
            await trio.sleep(self.flush_interval_s)
            await self.flush()

    async def flush(self) -> None:
        """Write the buffered lines now (in a worker thread)."""
        if not self._buffer or self.path is None:
            return
        async with self._lock:
            batch, self._buffer = self._buffer, []
            await trio.to_thread.run_sync(self._write_batch, batch)

    async def aclose(self) -> None:
        """Flush what is left and close the file. Shielded: it runs during shutdown."""
        with trio.CancelScope(shield=True):
            await self.flush()
            if self._file is not None:
                await trio.to_thread.run_sync(self._file.close)
                self._file = None

    # -- file handling (worker thread) --------------------------------------------------------
    def _open(self) -> None:
        self._file = open(self.path, "a", encoding="utf-8")
        self._size = self._file.tell()

    def _write_batch(self, lines: list[str]) -> None:
        if self._file is None:
            self._open()
        for line in lines:
            data = line + "\n"
            n = len(data.encode("utf-8")) if not data.isascii() else len(data)
            if self._size and self._size + n > self.max_bytes:
                self._rotate()
            self._file.write(data)
            self._size += n
        self._file.flush()
        self.lines_written += len(lines)

    def _rotate(self) -> None:
        self._file.close()
        if self.backup_count > 0:
            for i in range(self.backup_count - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._open()
