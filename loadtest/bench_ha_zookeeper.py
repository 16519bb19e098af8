#!/usr/bin/env python3
"""Failover time of a replicated pair coordinated by ZooKeeper ([ha.manager]) beside the classic
vote, in the same run (docs/ha.md, "A pair coordinated by ZooKeeper").

Each round starts a fresh lone pair (two broker processes of this checkout, tests/haproc.py),
waits until the backup is in sync, sends 100 durable messages to the primary, SIGKILLs it, then
sends one durable message to the backup every 20 ms until one is acknowledged: the failover time
is from the SIGKILL to that acknowledgement. Every one of the 100 must then be on the backup.

Modes, in the same run:

* **classic**: the classic vote (a lone pair needs no vote: the backup activates at once; the
  baseline, and the reason a lone pair splits on a cut link);
* **zookeeper**: a standalone Debian ZooKeeper (tests/zkproc.py) with ``tickTime`` = 250 ms and
  ``session-ms`` = 1500: a dead primary's lock lives until its session expires;
* **zookeeper-defaults** (``--defaults``): ``tickTime`` = 2000 ms (Debian's zoo.cfg) and the
  Curator default ``session-ms`` = 18000, one round.

    .venv/bin/python loadtest/bench_ha_zookeeper.py [--rounds 3] [--defaults] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests import zkproc  # noqa: E402
from tests.haproc import acknowledges, receive_all, send, start_replica, wait_active, wait_phase  # noqa: E402


def one_round(work: Path, mode: str) -> float:
    zk = None
    members = []
    try:
        ha_p: dict = {}
        ha_b: dict = {"vote-retries": 2, "vote-retry-wait-ms": 200, "quorum-vote-wait-s": 5}
        if mode.startswith("zookeeper"):
            tick, session = (2000, 18000) if mode == "zookeeper-defaults" else (250, 1500)
            zk = zkproc.start_ensemble(work / "zk", 1, tick_ms=tick)
            manager = {"type": "zookeeper", "connect-string": zk.connect_string, "session-ms": session}
            ha_p = {"manager": manager}
            # seed 001: vote-retry-wait × (vote-retries + 1) > session-ms
            ha_b = {"manager": manager, "vote-retries": max(3, session // 500), "vote-retry-wait-ms": 1000}
        primary = start_replica(work, "primary", "primary", ha=ha_p)
        members.append(primary)
        wait_active(primary)
        backup = start_replica(work, "backup", "backup", static=[primary.amqp_url], ha=ha_b)
        members.append(backup)
        wait_phase(backup, "in-sync", 60)
        bodies = [f"m{i}" for i in range(100)]
        send(primary, "orders", bodies)
        t0 = time.monotonic()
        primary.kill()
        while not acknowledges(backup):
            if time.monotonic() - t0 > 120:
                raise RuntimeError(f"{mode}: the backup did not serve within 120 s")
            time.sleep(0.02)
        took = time.monotonic() - t0
        got = receive_all(backup, "orders")
        if got != bodies:
            raise RuntimeError(f"{mode}: {len(got)} of 100 acknowledged messages on the backup")
        return took
    finally:
        for m in members:
            if m.proc is not None and m.proc.poll() is None:
                m.kill()
        if zk is not None:
            zk.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--defaults", action="store_true", help="also one round at ZooKeeper's and Curator's defaults")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    why = zkproc.available()
    if why:
        print(f"bench_ha_zookeeper: {why}", file=sys.stderr)
        return 2
    modes = ["classic", "zookeeper"]
    results: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="bench-ha-zk-") as tmp:
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                results[mode].append(one_round(Path(tmp) / f"{mode}-{r}", mode))
        if args.defaults:
            results["zookeeper-defaults"] = [one_round(Path(tmp) / "defaults", "zookeeper-defaults")]
    med = {m: statistics.median(v) for m, v in results.items()}
    if args.json:
        print(json.dumps({"rounds": results, "median_s": med}))
        return 0
    print(f"failover: SIGKILL of the primary to the first acknowledged send on the backup ({args.rounds} rounds)")
    print(f"{'mode':<22}{'median s':>10}   rounds")
    for m, v in results.items():
        print(f"{m:<22}{med[m]:>10.2f}   {', '.join(f'{x:.2f}' for x in v)}")
    print(f"zookeeper / classic: {med['zookeeper'] / med['classic']:.1f}x "
          f"(goal: zookeeper < 2 s with tickTime 250 ms, session-ms 1500)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
