"""Micro-benchmark of the journal's sync modes: appends/s with sync=always, batch and never.

Each mode appends 512-byte ADD_MESSAGE records for about ``--seconds`` (acking each message a
little later, as a broker would). ``batch`` flushes every ``--batch`` records, which is what
group commit achieves when that many sends are in flight; ``always`` fsyncs every record;
``never`` writes without fsync. Ratios are against ``always`` measured in the same run.

    .venv/bin/python loadtest/bench_journal.py [--seconds 2] [--batch 64] [--dir PATH]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

from broker.store.journal import Journal, JournalConfig


def run(mode: str, directory: Path, seconds: float, batch: int) -> tuple[int, float]:
    shutil.rmtree(directory, ignore_errors=True)
    body = b"m" * 512
    j = Journal.open(directory, JournalConfig(sync=mode, compact_min_bytes=64 << 20))
    n = 0
    start = time.perf_counter()
    deadline = start + seconds
    try:
        while time.perf_counter() < deadline:
            for _ in range(batch):
                j.add_message("bench", n, body, {"address": "bench"})
                if n >= 100:
                    j.ack("bench", n - 100)
                n += 1
            j.flush()
        elapsed = time.perf_counter() - start
    finally:
        j.close()
        shutil.rmtree(directory, ignore_errors=True)
    return n, elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    base = args.dir or Path(tempfile.mkdtemp(prefix="bench-journal-"))
    results = {}
    for mode in ("always", "batch", "never"):
        n, elapsed = run(mode, base / mode, args.seconds, args.batch)
        results[mode] = n / elapsed
    baseline = results["always"]
    print(f"journal durable messages/s (each = ADD_MESSAGE 512 B + a later ACK record; "
          f"batch={args.batch}, dir={base})")
    for mode, rate in results.items():
        print(f"  sync={mode:<6} {rate:>12,.0f} messages/s ({2 * rate:,.0f} appends/s)"
              f"   x{rate / baseline:,.1f} vs always")
    if args.dir is None:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
