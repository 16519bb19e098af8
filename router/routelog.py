"""The routing log: one JSON object per line for every routing decision, and one more when a
proxied connection closes. The schema is documented in docs/router.md ("Routing log"); the Spark
job reads it, so fields are only ever added, never renamed.

The hot path only appends an encoded line to an in-memory list (:meth:`RouteLog.write`). A
background task (:meth:`RouteLog.run`) hands the batch to a worker thread every
``flush_interval_s``, which appends it to the file and rotates by size (``path`` →
``path.1`` → … → ``path.<backup_count>``). Nothing waits for fsync: a crash can lose at most
one flush interval of lines, never corrupt earlier ones. Each process writes its own file (see
:func:`worker_log_path`), so several workers never interleave writes.

Bounded: a line never carries an unbounded string (the edge formats client-supplied fields with
:func:`json_str_bounded`: at most ``max_field_chars`` characters, then a marker with the original
length), and the buffer holds at most ``max_buffered_lines`` lines and ``max_buffered_bytes``
characters; beyond that lines are dropped and counted.

Never fatal: a failed write or rotation (ENOSPC, EMFILE, EIO, a vanished directory…) is cut back
to the last whole line, counted (``write_errors``), reported (``error``: the management API's
/health and /metrics show the routing log as degraded) and retried with a back-off (0.5 s
doubling to 5 s; the file is reopened). Lines not yet written stay buffered within the bounds
above, so a disk that fills and empties again loses only what did not fit in the buffer.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import datetime, timezone
from json.encoder import encode_basestring as _encode_str  # what json.dumps(ensure_ascii=False) uses
from pathlib import Path
from typing import Any

import trio

SCHEMA_VERSION = 1

log = logging.getLogger("router.routelog")


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


TRUNCATION_MARKER = "...[truncated, {n} chars]"


def truncate_field(x: str, limit: int) -> str:
    """``x`` itself when it has at most ``limit`` characters, else its first ``limit``
    characters followed by ``...[truncated, <original length> chars]``."""
    if len(x) <= limit:
        return x
    return x[:limit] + TRUNCATION_MARKER.format(n=len(x))


def json_str_bounded(x: Any, limit: int) -> str:
    """:func:`json_str` for a client-supplied field: longer strings are truncated with a marker
    (:func:`truncate_field`)."""
    if x.__class__ is str and len(x) > limit:
        return _encode_str(truncate_field(x, limit))
    return json_str(x)


def json_str_list(xs) -> str:
    """A JSON array of strings."""
    return "[" + ",".join([json_str(x) for x in xs]) + "]"


# -- the schema (docs/router.md "Routing log"): the two lines the edge writes ---------------------
# ``c`` is the edge's per-connection record (``router.net.edge.context.ConnState``): id, host,
# port, sni, user, roles, mechanism, container_id, open_hostname, started (trio clock).
# Client-supplied strings are bounded with json_str_bounded; the field order is the documented one.
_V = f'{{"v":{SCHEMA_VERSION},'


def _target_json(t) -> tuple[str, str, str]:
    """The routing log's target_name, target_node_id and target_address, as JSON text."""
    if t is None:
        return "null", "null", "null"
    return json_str(t.name), json_str(t.node_id), json_str(f"{t.host}:{t.port}")


def route_line(wall: float, worker: int, router: str, acceptor: str, mode: str, c, decision,
               decision_us: int, action: str, lim: int) -> str:
    """The ``event = "route"`` line: one per routing decision, with what the client got
    (``action``: redirected, proxied, refused, refused_external, upstream_failed)."""
    e = decision.explanation
    tname, tnode, taddr = _target_json(decision.target)
    return (
        f'{_V}"event":"route","time":"{utc_timestamp(wall)}",'
        f'"connection_id":{json_str(c.id)},"worker":{json_int(worker)},'
        f'"router":{json_str(router)},"acceptor":{json_str(acceptor)},"mode":{json_str(mode)},'
        f'"key_type":{json_str(e.key_type)},"key_raw":{json_str_bounded(e.raw_key, lim)},'
        f'"key_filtered":{json_str_bounded(e.filtered_key, lim)},'
        f'"key_transformed":{json_str_bounded(e.key, lim)},'
        f'"client_address":{json_str(c.host)},"client_port":{json_int(c.port)},'
        f'"sni":{json_str_bounded(c.sni, lim)},'
        f'"user":{json_str_bounded(c.user, lim)},"roles":{json_str_list(c.roles)},'
        f'"sasl_mechanism":{json_str(c.mechanism)},"container_id":{json_str_bounded(c.container_id, lim)},'
        f'"open_hostname":{json_str_bounded(c.open_hostname, lim)},"target_name":{tname},"target_node_id":{tnode},'
        f'"target_address":{taddr},"local":{json_bool(decision.local)},"policy":{json_str(e.policy)},'
        f'"cache":{json_str(e.cache)},"cache_hit":{json_bool(e.cache == "hit")},'
        f'"cache_tier":{json_str(e.cache_tier)},"pin":{json_str(e.pin)},'
        f'"quorum_met":{json_bool(e.quorum_met)},"ready_targets":{json_int(e.ready_targets)},'
        f'"outcome":{json_str(decision.outcome.value)},"action":{json_str(action)},'
        f'"reason":{json_str(e.reason)},"decision_us":{json_int(int(decision_us))}}}')


def close_line(wall: float, worker: int, router: str, acceptor: str, mode: str, c, decision,
               result, duration_ms: float, lim: int) -> str:
    """The ``event = "close"`` line of a proxied connection (``result``: its
    ``router.net.proxy.PumpStats``)."""
    tname, tnode, taddr = _target_json(decision.target)
    return (
        f'{_V}"event":"close","time":"{utc_timestamp(wall)}",'
        f'"connection_id":{json_str(c.id)},"worker":{json_int(worker)},'
        f'"router":{json_str(router)},"acceptor":{json_str(acceptor)},"mode":{json_str(mode)},'
        f'"client_address":{json_str(c.host)},"client_port":{json_int(c.port)},'
        f'"user":{json_str_bounded(c.user, lim)},'
        f'"container_id":{json_str_bounded(c.container_id, lim)},"target_name":{tname},"target_node_id":{tnode},'
        f'"target_address":{taddr},"bytes_client_to_broker":{json_int(result.bytes_up)},'
        f'"bytes_broker_to_client":{json_int(result.bytes_down)},'
        f'"duration_ms":{json_float(duration_ms)},'
        f'"close_reason":{json_str(result.reason.value)},"closed_first_by":{json_str(result.first_eof)},'
        f'"spliced":{json_bool(result.spliced)},"error":{json_str_bounded(result.error, lim)}}}')


class RouteLog:
    """A buffered, size-rotated JSON-lines file. ``path`` None makes a log that drops lines
    (routing log disabled) but still counts them."""

    RETRY_MIN_S = 0.5
    RETRY_MAX_S = 5.0

    def __init__(self, path: Path | None, *, max_bytes: int = 50 * 1024 * 1024, backup_count: int = 5,
                 flush_interval_s: float = 0.5, max_buffered_lines: int = 100_000,
                 max_buffered_bytes: int = 16 * 1024 * 1024, max_field_chars: int = 1024):
        self.path = Path(path) if path is not None else None
        self.max_bytes = max_bytes
        self.backup_count = backup_count
        self.flush_interval_s = flush_interval_s
        self.max_buffered_lines = max_buffered_lines
        self.max_buffered_bytes = max_buffered_bytes
        self.max_field_chars = max_field_chars
        self._buffer: list[str] = []
        self._buffered = 0  # characters in _buffer
        self._lock = trio.Lock()  # one flush at a time
        self._fd: int | None = None
        self._size = 0
        self.lines_written = 0
        self.lines_dropped = 0
        self.write_errors = 0
        #: the last write/rotation error while the log cannot be written, else None
        self.error: str | None = None
        self._retry_at = 0.0
        self._backoff = 0.0
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:  # reported and retried like any write error
                self.error = f"{self.path.parent}: {exc.strerror or exc}"

    # -- hot path ----------------------------------------------------------------------------
    def write(self, record: dict[str, Any]) -> None:
        """Queue one record (a JSON object). Never blocks; if the writer has fallen hopelessly
        behind (``max_buffered_lines``), the line is dropped and counted instead of growing memory."""
        if self.path is None:
            return
        self.write_line(_dumps(record))

    def write_line(self, line: str) -> None:
        """Queue one already-encoded JSON object (one line, no newline); same rules as
        :meth:`write`. The edge formats its lines itself with the ``json_*`` helpers."""
        if self.path is None:
            return
        if len(self._buffer) >= self.max_buffered_lines or self._buffered >= self.max_buffered_bytes:
            self.lines_dropped += 1
            return
        self._buffered += len(line)
        self._buffer.append(line)

    # -- background --------------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Flush periodically until cancelled; the final flush happens in :meth:`aclose`."""
        task_status.started()
        while True:
            await trio.sleep(self.flush_interval_s)
            await self.flush()

    async def flush(self, *, force: bool = False) -> None:
        """Write the buffered lines now (in a worker thread). After a failure the next attempt
        waits for the back-off unless ``force``. Never raises for I/O errors (see the module
        docstring)."""
        if not self._buffer or self.path is None:
            return
        if not force and self.error is not None and trio.current_time() < self._retry_at:
            return
        async with self._lock:
            batch, self._buffer, self._buffered = self._buffer, [], 0
            written, exc = await trio.to_thread.run_sync(self._write_batch, batch)
            self.lines_written += written
            if exc is None:
                if self.error is not None:
                    log.warning("routing log %s is writable again", self.path)
                self.error = None
                self._backoff = 0.0
                return
            # keep what was not written, in front of what came meanwhile, within the bounds
            rest = batch[written:] + self._buffer
            keep = rest[-self.max_buffered_lines:]
            size = 0
            start = len(keep)
            while start > 0 and size + len(keep[start - 1]) <= self.max_buffered_bytes:
                start -= 1
                size += len(keep[start])
            keep = keep[start:]
            self.lines_dropped += len(rest) - len(keep)
            self._buffer, self._buffered = keep, size
            self.write_errors += 1
            text = f"{self.path}: {exc.strerror or exc}"
            if self.error is None:
                log.error("cannot write the routing log %s; keeping up to %d lines and retrying",
                          text, self.max_buffered_lines)
            self.error = text
            self._backoff = min(self.RETRY_MAX_S, max(self.RETRY_MIN_S, self._backoff * 2))
            self._retry_at = trio.current_time() + self._backoff

    async def reconfigure(self, path: Path | None, *, max_bytes: int, backup_count: int,
                          max_field_chars: int) -> None:
        """A reload: what is buffered goes to the old file, then lines go to ``path`` (None:
        no routing log), rotated by the new sizes."""
        await self.flush(force=True)
        async with self._lock:
            if path != self.path:
                self._close_fd()            # opened again, at the new path, by the next write
                self.path = Path(path) if path is not None else None
                self.error = None
                self._backoff = 0.0
            self.max_bytes, self.backup_count, self.max_field_chars = max_bytes, backup_count, max_field_chars

    async def aclose(self) -> None:
        """Flush what is left and close the file. Shielded: it runs during shutdown."""
        with trio.CancelScope(shield=True):
            await self.flush(force=True)
            if self._fd is not None:
                fd, self._fd = self._fd, None
                try:
                    os.close(fd)
                except OSError:
                    pass

    # -- file handling (worker thread) --------------------------------------------------------
    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        self._size = os.fstat(self._fd).st_size

    def _close_fd(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                os.close(fd)
            except OSError:
                pass

    def _write_batch(self, lines: list[str]) -> tuple[int, OSError | None]:
        """Append ``lines`` (rotating by size). Returns (lines written, the error that stopped
        it or None); a write cut short is truncated back to the last whole line."""
        written = 0
        try:
            if self._fd is None:
                self._open()
            chunk: list[bytes] = []
            chunk_lines = 0
            size = self._size
            for line in lines:
                data = (line + "\n").encode("utf-8")
                n = len(data)
                if size and size + n > self.max_bytes:
                    if chunk:
                        self._append(b"".join(chunk))
                        written += chunk_lines
                        chunk, chunk_lines = [], 0
                    self._rotate()
                    size = self._size
                chunk.append(data)
                chunk_lines += 1
                size += n
            if chunk:
                self._append(b"".join(chunk))
                written += chunk_lines
        except OSError as exc:
            self._close_fd()  # reopened (and the size re-read) by the retry
            return written, exc
        return written, None

    def _append(self, data: bytes) -> None:
        fd = self._fd
        start = self._size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            try:
                os.ftruncate(fd, start)  # no torn line: the retry writes it whole
            except OSError:
                pass
            raise
        self._size = start + len(data)

    def _rotate(self) -> None:
        self._close_fd()
        if self.backup_count > 0:
            for i in range(self.backup_count - 1, 0, -1):
                src = self.path.with_name(f"{self.path.name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{self.path.name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._open()
