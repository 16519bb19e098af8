#!/usr/bin/env python3
"""What a backup's initial sync costs the primary's clients (docs/ha.md, "Replication").

A primary (``[ha] policy = "replication"``) is filled with ``--messages`` durable messages of
``--size`` bytes that nobody consumes (its journal's live set). A probe client then sends one
small durable message at a time and times each send until it is accepted, every ``--every-ms``.
After ``--baseline-s`` of that (the baseline: the same node, no sync), a backup is started; the
probe goes on until the primary reports the backup in sync. Printed: the probe's p50, p99 and
worst send latency during the baseline and during the sync, their ratios (sync ÷ baseline), the
sync's duration and the primary's snapshot encoding time (counter
``GET /api/v1/ha`` ``replication.last_snapshot.encode_ms``). A snapshot encoded on the event loop shows as a worst
latency about as long as the encoding; encoded a few batches at a time, as the link takes them,
it does not.

    .venv/bin/python loadtest/bench_ha_sync.py [--messages 200000] [--size 1024] [--baseline-s 5] [--every-ms 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ha import Node, cluster_table, wait_until  # noqa: E402
from proton import Message
from proton.handlers import MessagingHandler
from proton.reactor import Container
from proton.utils import BlockingConnection


def fill(url: str, n: int, size: int) -> float:
    """Send ``n`` durable messages (a window of 500 unsettled); returns the seconds it took."""

    body = b"x" * size

    class Sender(MessagingHandler):
        def __init__(self):
            super().__init__()
            self.sent = self.confirmed = 0

        def on_start(self, event):
            conn = event.container.connect(url, allowed_mechs="PLAIN")
            event.container.create_sender(conn, "sync.fill")

        def on_sendable(self, event):
            s = event.sender
            while s.credit and self.sent < n and self.sent - self.confirmed < 500:
                s.send(Message(body=body, durable=True))
                self.sent += 1

        def on_accepted(self, event):
            self.confirmed += 1
            if self.confirmed == n:
                event.connection.close()
            else:
                self.on_sendable(event)

    t0 = time.monotonic()
    Container(Sender()).run()
    return time.monotonic() - t0


class Probe(threading.Thread):
    def __init__(self, url: str, every_s: float):
        super().__init__(daemon=True)
        self.url, self.every_s = url, every_s
        self.samples: list[tuple[float, float]] = []    # (start, latency)
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = BlockingConnection(self.url, timeout=120, allowed_mechs="PLAIN")
            snd = conn.create_sender("sync.probe")
            while not self.stop.is_set():
                t = time.monotonic()
                snd.send(Message(body=b"probe", durable=True))
                self.samples.append((t, time.monotonic() - t))
                time.sleep(self.every_s)
            conn.close()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            self.error = exc

    def between(self, a: float, b: float) -> list[float]:
        return [lat for t, lat in self.samples if a <= t <= b]


def stats(lat: list[float]) -> dict:
    s = sorted(lat)
    return {"n": len(s), "p50_ms": statistics.median(s) * 1000, "p99_ms": s[int(len(s) * 0.99) - 1] * 1000,
            "max_ms": s[-1] * 1000}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--baseline-s", type=float, default=5.0)
    ap.add_argument("--every-ms", type=float, default=5.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ha-sync-") as tmp:
        work = Path(tmp)
        primary = Node(work, "primary", cluster_table([]) + '[ha]\npolicy = "replication"\nrole = "primary"\n')
        backup = None
        try:
            took = fill(primary.url, a.messages, a.size)
            print(f"filled the primary with {a.messages:,} durable messages of {a.size} B in {took:.1f} s", flush=True)
            probe = Probe(primary.url, a.every_ms / 1000)
            probe.start()
            time.sleep(a.baseline_s)
            t_base_end = t_start = time.monotonic()     # the sync window starts with the backup's process
            backup = Node(work, "backup", cluster_table([primary.amqp]) +
                          '[ha]\npolicy = "replication"\nrole = "backup"\n', wait=("management",))
            wait_until(lambda: primary.get("/api/v1/ha")["replication"]["state"] == "in-sync", "the backup in sync",
                       600)
            t_sync = time.monotonic()
            probe.stop.set()
            probe.join(30)
            if probe.error is not None:
                raise SystemExit(f"probe failed: {probe.error!r}")
            base = stats(probe.between(0, t_base_end))
            during = stats(probe.between(t_start, t_sync))
            snap = primary.get("/api/v1/ha")["replication"].get("last_snapshot")
            print(f"initial sync of {a.messages:,} messages: {t_sync - t_start:.2f} s"
                  + (f" (snapshot: {snap['records']:,} records, {snap['bytes'] / 1e6:,.0f} MB, "
                     f"{snap['encode_ms']:,.0f} ms of encoding on the event loop, a few batches at a time)"
                     if snap else ""))
            for name, s in (("baseline (no sync)", base), ("during the sync", during)):
                print(f"  probe sends {name}: n={s['n']}, p50 {s['p50_ms']:.2f} ms, p99 {s['p99_ms']:.2f} ms, "
                      f"worst {s['max_ms']:.1f} ms")
            print(f"ratio during ÷ baseline: p50 {during['p50_ms'] / base['p50_ms']:.2f}, "
                  f"p99 {during['p99_ms'] / base['p99_ms']:.2f}, worst {during['max_ms'] / base['max_ms']:.2f}")
        finally:
            if backup is not None:
                backup.stop()
            primary.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
