#!/usr/bin/env python3
"""What a /metrics scrape costs the broker's event loop with many queues.

Starts a real broker with ``--queues`` anycast addresses declared in its config (one queue
each), then measures for ``--seconds`` each:

* idle: the AMQP round trip (send, receive, accept; python-qpid-proton) of a probe client;
* scraping: the same while ``--scrapers`` threads GET /metrics back to back.

Prints the scrape time (median / max), the scrapes done, and the probe's round trip (median /
p99 / max) in both phases. A render that blocks the loop shows up as probe latency.

    .venv/bin/python loadtest/bench_metrics.py [--queues 20000] [--scrapers 4] [--seconds 10]
"""

from __future__ import annotations

import argparse
import base64
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from proton import Message  # noqa: E402
from proton.utils import BlockingConnection  # noqa: E402

from tests.brokerproc import start_broker, write_users_file  # noqa: E402


def probe(url: str, seconds: float) -> list[float]:
    c = BlockingConnection(url, timeout=30, allowed_mechs="PLAIN")
    s = c.create_sender("probe")
    r = c.create_receiver("probe", credit=10)
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        s.send(Message(body="x"))
        r.receive(timeout=30)
        r.accept()
        out.append(time.perf_counter() - t0)
        time.sleep(0.005)
    c.close()
    return out


def scraper(url: str, auth: str, stop: threading.Event, times: list[float]) -> None:
    while not stop.is_set():
        req = urllib.request.Request(url, headers={"Authorization": auth})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()
        times.append(time.perf_counter() - t0)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queues", type=int, default=20000)
    ap.add_argument("--scrapers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        users = write_users_file(tmp / "users.toml", {"admin": ("admin", ["admin"]), "app": ("app", ["app"])})
        cfg = {f"addresses.q{i:05d}": {"routing-types": ["anycast"]} for i in range(args.queues)}
        b = start_broker(tmp, users_file=users, config=cfg)
        try:
            url = b.amqp_url.replace("amqp://", "amqp://app:app@")
            auth = "Basic " + base64.b64encode(b"admin:admin").decode()
            idle = probe(url, args.seconds)
            stop = threading.Event()
            times: list[float] = []
            threads = [threading.Thread(target=scraper, args=(b.management_url + "/metrics", auth, stop, times))
                       for _ in range(args.scrapers)]
            for t in threads:
                t.start()
            busy = probe(url, args.seconds)
            stop.set()
            for t in threads:
                t.join()
        finally:
            b.terminate()
    ms = 1000.0
    print(f"queues {args.queues}, scrapers {args.scrapers}, {args.seconds:g} s per phase")
    print(f"scrape: n={len(times)} median {statistics.median(times) * ms:.1f} ms max {max(times) * ms:.1f} ms")
    for name, xs in (("idle", idle), ("scraping", busy)):
        print(f"probe round trip {name}: n={len(xs)} median {statistics.median(xs) * ms:.2f} ms "
              f"p99 {pct(xs, 0.99) * ms:.1f} ms max {max(xs) * ms:.1f} ms")


if __name__ == "__main__":
    main()
