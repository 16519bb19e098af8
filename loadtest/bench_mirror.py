#!/usr/bin/env python3
"""Mirror benchmark: what an asynchronous mirror costs the broker that runs it, beside the same
node without one, in the same run (docs/broker-connections.md "Mirror").

Three Lodestone nodes from this checkout: ``plain`` (no mirror), ``source`` (a mirror to
``target``) and ``target``. The same client (``loadtest/amqp_client.py``: 1 producer → 1
consumer, python-qpid-proton) runs against ``plain`` and against ``source`` in turn; for each
workload (non-durable and durable, 100 B and 4 KiB) it reports msgs/s and CPU per message of the
broker under test (utime+stime from /proc), and for ``source`` also the target's CPU per message
spent applying the mirror (read ``--tail-s`` after the last receipt, so the target's lag counts).
Each run waits until the mirror's store-and-forward queue is empty before the next. Medians of
``--rounds`` rounds. Goal: source ÷ plain CPU per message ≤ 1.5.

    .venv/bin/python loadtest/bench_mirror.py [--n 20000] [--rounds 3] [--sizes 100,4096]
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from loadtest.bench_broker import Lodestone, run_client  # noqa: E402


def _get(url: str) -> object:
    req = urllib.request.Request(url, headers={"Authorization": "Basic " + base64.b64encode(b"bench:bench").decode()})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def mirror_view(node: Lodestone) -> dict:
    (v,) = _get(node.management_url + "/api/v1/broker-connections")
    return v["mirror"]


def wait_drained(node: Lodestone, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = mirror_view(node)
        if m["attached"] and m["pending"] == 0:
            return
        time.sleep(0.2)
    raise SystemExit(f"the mirror did not drain: {mirror_view(node)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000, help="messages per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="100,4096")
    ap.add_argument("--tail-s", type=float, default=3.0, help="how long after the last receipt the target's "
                                                                "CPU is read again")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="lodestone-bench-mirror-"))
    nodes: list[Lodestone] = []
    results: dict[tuple, list[dict]] = {}
    try:
        target = Lodestone(work, name="target", permissions='mirror = ["app"]\n')
        nodes.append(target)
        source = Lodestone(work, name="source", extra=(
            f'[broker-connections.dr]\nuri = "{target.plain_url}"\nuser = "bench"\npassword = "bench"\n'
            'retry-interval-ms = 200\n[broker-connections.dr.mirror]\n'))
        nodes.append(source)
        plain = Lodestone(work, name="plain")
        nodes.append(plain)
        wait_drained(source, 30)
        for _rnd in range(a.rounds):
            for durable in (False, True):
                for size in sizes:
                    results.setdefault(("plain", durable, size), []).append(
                        run_client(plain, durable, size, a.n))
                    r = run_client(source, durable, size, a.n,
                                   ("--broker-pid", f"{source.pid},{target.pid}", "--tail-s", str(a.tail_s)))
                    results.setdefault(("source", durable, size), []).append(r)
                    if r.get("error"):
                        print(f"source durable={durable} size={size}: {r['error']}", file=sys.stderr)
                    wait_drained(source)
    finally:
        for node in nodes:
            node.stop()
        shutil.rmtree(work, ignore_errors=True)

    def med(rs, fn):
        vals = []
        for r in rs:
            try:
                vals.append(fn(r))
            except (KeyError, IndexError, TypeError):
                pass
        return statistics.median(vals) if vals else float("nan")

    print(f"\n1 producer -> 1 consumer, n={a.n}, median of {a.rounds} rounds; CPU in µs per message")
    print(f"{'workload':<24}{'plain msgs/s':>14}{'mirrored msgs/s':>17}{'plain CPU':>11}{'source CPU':>12}"
          f"{'source ÷ plain':>16}{'target CPU':>12}")
    for durable in (False, True):
        for size in sizes:
            p = results[("plain", durable, size)]
            s = results[("source", durable, size)]
            plain_cpu = med(p, lambda r: r["broker_cpu_us_per_msg"])
            # the source's share during the run; the target's from the run's start to tail-s after it
            src_cpu = med(s, lambda r: r["broker_cpu_us_per_msg_each"][0])
            tgt_cpu = med(s, lambda r: r["broker_cpu_us_per_msg_each"][1] + r["broker_cpu_tail_us_per_msg_each"][1])
            print(f"{('durable' if durable else 'non-durable') + f' {size} B':<24}"
                  f"{med(p, lambda r: r['msgs_per_s']):>14,.0f}{med(s, lambda r: r['msgs_per_s']):>17,.0f}"
                  f"{plain_cpu:>11.1f}{src_cpu:>12.1f}{src_cpu / plain_cpu:>16.2f}{tgt_cpu:>12.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
