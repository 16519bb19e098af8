"""Distribution of 100,000 keys over 3, 5 and 10 targets for the CONSISTENT_HASH variants.

Prints, per target count, the max/min load ratio (1.00 = perfectly even) for:
  * default ring   — HASH=MURMUR3, VIRTUAL_NODES=128
  * artemis        — HASH=FNV1A, VIRTUAL_NODES=1 (Artemis's exact algorithm)
  * bounded load   — default ring + LOAD_FACTOR=1.25 and 1.10 (caps the max at factor x mean;
                     the min is not raised, so max/min stays above 1)
  * a 1024-vnode ring, to show what more points buy
and the fraction of keys that move when one target is added (ideal: 1/(n+1)).
Node ids are UUIDs (uuid5, deterministic), keys are "client-<i>" container ids.

    .venv/bin/python loadtest/bench_distribution.py [--keys 100000]
"""

from __future__ import annotations

import argparse
import uuid
from collections import Counter

from router.policies import Target, create_policy

MODES = {
    "default ring (MURMUR3, 128 vnodes)": {},
    "artemis (FNV1A, 1 point/node)": {"HASH": "FNV1A", "VIRTUAL_NODES": "1"},
    "bounded load (ring + LOAD_FACTOR 1.25)": {"LOAD_FACTOR": "1.25"},
    "bounded load (ring + LOAD_FACTOR 1.10)": {"LOAD_FACTOR": "1.10"},
    "ring, 1024 vnodes (for comparison)": {"VIRTUAL_NODES": "1024"},
}


def targets(n: int) -> list[Target]:
    return [Target(str(uuid.uuid5(uuid.NAMESPACE_DNS, f"broker-{i}.lodestone")), "10.0.0.1",
                   5672 + i, name=f"broker-{i}") for i in range(n)]


def loads(props: dict, ts: list[Target], keys: list[str]) -> tuple[Counter, dict]:
    p = create_policy("CONSISTENT_HASH", props)
    c: Counter = Counter({t.name: 0 for t in ts})
    where = {}
    for k in keys:
        t = p.select_target(ts, k)
        c[t.name] += 1
        where[k] = t.name
    return c, where


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=100_000)
    args = ap.parse_args()
    keys = [f"client-{i}" for i in range(args.keys)]
    print(f"{args.keys:,} keys; max/min load ratio (moved on +1 target; ideal 1/(n+1))")
    print(f"{'mode':42} {'n':>3} {'max/min':>9} {'min':>7} {'max':>7} {'moved +1':>9}")
    for n in (3, 5, 10):
        ts = targets(n)
        grown = targets(n + 1)
        for mode, props in MODES.items():
            c, where = loads(props, ts, keys)
            _, where2 = loads(props, grown, keys)
            lo, hi = min(c.values()), max(c.values())
            ratio = f"{hi / lo:9.2f}" if lo else "      inf"
            moved = sum(1 for k in keys if where[k] != where2[k]) / len(keys)
            print(f"{mode:42} {n:>3} {ratio} {lo:>7} {hi:>7} {moved:>9.3f}")
        print()


if __name__ == "__main__":
    main()
