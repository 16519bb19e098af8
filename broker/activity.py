"""The broker activity log: produce/consume volume per connection and address, as JSON lines.

Theory of operation
-------------------
Links count messages and bytes as they flow (two integer increments per message, in the
engine). Every ``flush_interval_s`` — and once more when a connection closes — the node asks each
connection for its counters since the previous flush (``AmqpEngine.take_activity``) and this
module writes one JSON object per (connection, address, direction) that saw traffic in that
window. Windows of one connection are contiguous and do not overlap, so summing records never
double counts. The schema (documented in ``docs/broker.md`` and read by the data-gravity Spark
job) is::

    {"ts": "2026-11-22T12:00:10.000Z",          # when the record was written (UTC)
     "node_id": "<uuid>", "node": "broker-1",
     "connection_id": "3f2a9c1e-7", "container_id": "client-42", "user": "app",
     "source": "127.0.0.1:50412",
     "address": "orders", "direction": "produce",  # produce | consume
     "messages": 120, "bytes": 48211,
     "window_start": "2026-11-22T12:00:00.000Z", "window_end": "2026-11-22T12:00:10.000Z",
     "final": false}                              # true for the record written at connection close

A cluster node also writes, per neighbour and address, ``forward``/``redistribute`` records (what
it forwarded and the neighbour acknowledged) and ``forward-in`` records (what it received and
stored), with ``connection_id`` ``cluster:<peer>``, null client fields and a last field
``peer_node_id`` (broker.cluster.bridge).

The file is appended to (never rewritten) and flushed after each batch of records.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Callable

__all__ = ["ActivityLog", "iso_utc", "SCHEMA_FIELDS", "CLUSTER_FIELDS"]

SCHEMA_FIELDS = ("ts", "node_id", "node", "connection_id", "container_id", "user", "source", "address",
                 "direction", "messages", "bytes", "window_start", "window_end", "final")
#: a cluster record (direction forward, redistribute or forward-in) has one more field, last
CLUSTER_FIELDS = SCHEMA_FIELDS + ("peer_node_id",)


def iso_utc(ts: float) -> str:
    """Seconds since the epoch → ``2026-11-22T12:00:00.123Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


class ActivityLog:
    """Appends activity records to one file. ``clock`` returns wall-clock seconds (tests fake it)."""

    def __init__(self, path: Path, node_id: str, node_name: str, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.node_id = node_id
        self.node_name = node_name
        self.clock = clock
        self._fh: IO[str] | None = self.path.open("a", encoding="utf-8")
        self.records_written = 0

    def write(self, conn: dict, window_start: float, window_end: float,
              counters: dict[tuple[str, str], list[int]], *, final: bool = False,
              peer_node_id: str | None = None) -> int:
        """Write one record per (address, direction) in ``counters``; returns how many.

        ``conn`` has ``id``, ``container_id``, ``user``, ``source`` (``AmqpEngine.describe()``).
        """
        if self._fh is None or not counters:
            return 0
        ts = iso_utc(self.clock())
        ws, we = iso_utc(window_start), iso_utc(window_end)
        lines = []
        for (address, direction), (messages, nbytes) in sorted(counters.items()):
            if not messages and not nbytes:
                continue
            rec = {
                "ts": ts, "node_id": self.node_id, "node": self.node_name,
                "connection_id": conn["id"], "container_id": conn.get("container_id"),
                "user": conn.get("user"), "source": conn.get("source"),
                "address": address, "direction": direction,
                "messages": messages, "bytes": nbytes,
                "window_start": ws, "window_end": we, "final": final,
            }
            if peer_node_id is not None:
                rec["peer_node_id"] = peer_node_id
            lines.append(json.dumps(rec, separators=(",", ":")))
        if lines:
            self._fh.write("\n".join(lines) + "\n")
            self._fh.flush()
            self.records_written += len(lines)
        return len(lines)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
