#!/usr/bin/env python3
"""Mirror benchmark: what a mirror costs the broker that runs it, beside the same node without
one, in the same run (docs/broker-connections.md "Mirror").

Lodestone nodes from this checkout: ``plain`` (no mirror) and, per ``--modes``: ``async`` (A
mirrors to a target B), ``sync`` (the same with ``sync = true``: each send answered once B has
it) and ``dual`` (A and B mirror each other). The same client (``loadtest/amqp_client.py``: 1
producer → 1 consumer, python-qpid-proton) runs against ``plain`` and against each A in turn;
for each workload (non-durable and durable, 100 B and 4 KiB) it reports msgs/s and CPU per
message of A (utime+stime from /proc), and B's CPU per message spent applying the mirror (read
``--tail-s`` after the last receipt, so B's lag counts). Each run waits until A's
store-and-forward queue is empty before the next. Medians of ``--rounds`` rounds. Goal: A ÷
plain CPU per message ≤ 1.5 for the asynchronous mirror.

    .venv/bin/python loadtest/bench_mirror.py [--n 20000] [--rounds 3] [--sizes 100,4096]
        [--modes async,sync,dual]
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
from tests.serverproc import free_ports  # noqa: E402  (the repository's test helpers)


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


def _mirror_to(url: str, *, sync: bool = False) -> str:
    return (f'[broker-connections.dr]\nuri = "{url}"\nuser = "bench"\npassword = "bench"\n'
            'retry-interval-ms = 200\n[broker-connections.dr.mirror]\n' + ("sync = true\n" if sync else ""))


MODES = {"async": "A mirrors to B", "sync": "A mirrors to B, sync = true",
         "dual": "A and B mirror each other (clients on A)"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000, help="messages per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="100,4096")
    ap.add_argument("--modes", default=",".join(MODES), help="which mirrors: " + ", ".join(MODES))
    ap.add_argument("--tail-s", type=float, default=3.0, help="how long after the last receipt the target's "
                                                                "CPU is read again")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r} (known: {', '.join(MODES)})")
    work = Path(tempfile.mkdtemp(prefix="lodestone-bench-mirror-"))
    nodes: list[Lodestone] = []
    pairs: dict[str, tuple[Lodestone, Lodestone]] = {}     # mode -> (the node under test, its mirror's target)
    results: dict[tuple, list[dict]] = {}
    mirror_ok = 'mirror = ["app"]\n'
    try:
        plain = Lodestone(work, name="plain")
        nodes.append(plain)
        if "async" in modes or "sync" in modes:
            target = Lodestone(work, name="target", permissions=mirror_ok)
            nodes.append(target)
            if "async" in modes:
                pairs["async"] = (Lodestone(work, name="source", extra=_mirror_to(target.plain_url)), target)
            if "sync" in modes:
                pairs["sync"] = (Lodestone(work, name="sync-source", extra=_mirror_to(target.plain_url, sync=True)),
                                 target)
        if "dual" in modes:
            p1, p2 = free_ports(2)
            d1 = Lodestone(work, name="dual-a", permissions=mirror_ok, port=p1,
                           extra=_mirror_to(f"amqp://127.0.0.1:{p2}"))
            d2 = Lodestone(work, name="dual-b", permissions=mirror_ok, port=p2,
                           extra=_mirror_to(f"amqp://127.0.0.1:{p1}"))
            pairs["dual"] = (d1, d2)
        nodes.extend(p[0] for p in pairs.values())
        if "dual" in pairs:
            nodes.append(pairs["dual"][1])
        for mode in modes:
            for node in pairs[mode]:
                if node.name != "target":
                    wait_drained(node, 30)
        for _rnd in range(a.rounds):
            for durable in (False, True):
                for size in sizes:
                    results.setdefault(("plain", durable, size), []).append(
                        run_client(plain, durable, size, a.n))
                    for mode in modes:
                        src, tgt = pairs[mode]
                        r = run_client(src, durable, size, a.n,
                                       ("--broker-pid", f"{src.pid},{tgt.pid}", "--tail-s", str(a.tail_s)))
                        results.setdefault((mode, durable, size), []).append(r)
                        if r.get("error"):
                            print(f"{mode} durable={durable} size={size}: {r['error']}", file=sys.stderr)
                        wait_drained(src)
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
    for mode in modes:
        print(f"  {mode}: {MODES[mode]}")
    print(f"{'mirror':<7}{'workload':<22}{'plain msgs/s':>14}{'mirrored msgs/s':>17}{'plain CPU':>11}{'A CPU':>9}"
          f"{'A ÷ plain':>11}{'B CPU':>9}")
    for mode in modes:
        for durable in (False, True):
            for size in sizes:
                p = results[("plain", durable, size)]
                s = results[(mode, durable, size)]
                plain_cpu = med(p, lambda r: r["broker_cpu_us_per_msg"])
                # A's share during the run; B's from the run's start to tail-s after it
                src_cpu = med(s, lambda r: r["broker_cpu_us_per_msg_each"][0])
                tgt_cpu = med(s, lambda r: r["broker_cpu_us_per_msg_each"][1] + r["broker_cpu_tail_us_per_msg_each"][1])
                print(f"{mode:<7}{('durable' if durable else 'non-durable') + f' {size} B':<22}"
                      f"{med(p, lambda r: r['msgs_per_s']):>14,.0f}{med(s, lambda r: r['msgs_per_s']):>17,.0f}"
                      f"{plain_cpu:>11.1f}{src_cpu:>9.1f}{src_cpu / plain_cpu:>11.2f}{tgt_cpu:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
