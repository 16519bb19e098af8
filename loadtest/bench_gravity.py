"""Scale benchmark of the data-gravity job (docs/gravity.md): seconds and lines/s on local[2].

    .venv/bin/python loadtest/bench_gravity.py [--lines 1000000,3000000,10000000] [--dir var/bench-gravity]
        [--master local[2]] [--driver-memory 4g] [--keep]

For each size it writes a synthetic log set in the real formats (routing logs rotated every
~100 MB, routing.log.1 …; one activity.jsonl per broker) — 10,000 CLIENT_ID keys in groups of 2–8
sharing an address, 3 brokers, each connection a route line, a close line and ~8 activity records
(produce/consume windows), cluster forward records for connections placed away from their
address's other keys, 2 % of the keys moving broker mid-log, 0.01 % malformed lines — then runs
``python -m spark.jobs.gravity DIR --out … --master local[2]`` and prints its wall time (with the
JVM start) and the job's own time (``elapsed_s``: read → recommendation → outputs), each with lines/s,
the ratio of the per-line cost between the smallest and largest size, the marginal cost between
consecutive sizes, and with three sizes or more a least-squares fit ``fixed + per-line · lines``
with its largest residual (small = linear). Generated logs are reused when
present (``DIR/<lines>/``), and removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NODES = ("6c1b0f0e-0000-4000-8000-000000000001", "6c1b0f0e-0000-4000-8000-000000000002",
         "6c1b0f0e-0000-4000-8000-000000000003")
KEYS = 10_000
WINDOWS = 8
ROTATE_BYTES = 100 * 1024 * 1024


def _t(sec: float) -> str:
    s = int(sec)
    return f"2026-01-02T{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}.{int(sec % 1 * 1e6):06d}Z"


def _t3(sec: float) -> str:
    s = int(sec)
    return f"2026-01-02T{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}.{int(sec % 1 * 1e3):03d}Z"


def generate(root: Path, lines: int, seed: int = 1) -> int:
    """Write about ``lines`` log lines under ``root``; returns the exact count."""
    rng = random.Random(seed)
    keys, groups = [], []
    while len(keys) < KEYS:
        size = rng.randint(2, 8)
        g = len(groups)
        members = [f"app{g}-{'p' if j % 2 == 0 else 'c'}{j}" for j in range(size)]
        groups.append(members)
        keys += [(k, g, j % 2 == 0) for k, j in zip(members, range(size))]
    keys = keys[:KEYS]
    place = {k: rng.randrange(3) for k, _, _ in keys}
    movers = set(rng.sample([k for k, _, _ in keys], KEYS // 50))
    root.mkdir(parents=True, exist_ok=True)
    act_files = []
    for i in range(3):
        (root / f"broker-{i + 1}").mkdir(exist_ok=True)
        act_files.append(open(root / f"broker-{i + 1}" / "activity.jsonl", "w", buffering=1 << 20))
    rdir = root / "router"
    rdir.mkdir(exist_ok=True)
    rot: list[Path] = []
    rfile = open(rdir / "routing.part0", "w", buffering=1 << 20)
    rsize = 0
    n = 0
    conn = 0
    per_conn = 2 + WINDOWS + 1
    total_conns = max(1, lines // per_conn)
    while n < lines:
        key, g, producer = keys[conn % KEYS]
        t = conn * 0.004
        node = place[key]
        if key in movers and conn > total_conns // 2:
            node = (node + 1) % 3
        nid = NODES[node]
        cid = f"tok-{conn}"
        route = ('{"v":1,"event":"route","time":"%s","connection_id":"%s","worker":0,"router":"main",'
                 '"acceptor":"auto","mode":"auto","key_type":"CLIENT_ID","key_raw":"%s","key_filtered":"%s",'
                 '"key_transformed":"%s","client_address":"10.0.0.%d","client_port":%d,"sni":null,"user":"app",'
                 '"roles":["app"],"sasl_mechanism":"PLAIN","container_id":"%s","open_hostname":null,'
                 '"target_name":"%s","target_node_id":"%s","target_address":"127.0.0.1:%d","local":false,'
                 '"policy":"CONSISTENT_HASH","cache":"hit","cache_hit":true,"cache_tier":"local","pin":null,'
                 '"quorum_met":true,"ready_targets":3,"outcome":"OK","action":"proxied",'
                 '"reason":"sticky cache hit","decision_us":31}\n'
                 % (_t(t), cid, key, key, key, conn % 250, 30000 + conn % 30000, key, nid, nid, 15672 + node))
        close = ('{"v":1,"event":"close","time":"%s","connection_id":"%s","worker":0,"router":"main",'
                 '"acceptor":"auto","mode":"auto","client_address":"10.0.0.%d","client_port":%d,"user":"app",'
                 '"container_id":"%s","target_name":"%s","target_node_id":"%s","target_address":"127.0.0.1:%d",'
                 '"bytes_client_to_broker":%d,"bytes_broker_to_client":%d,"duration_ms":%.1f,'
                 '"close_reason":"closed","closed_first_by":"client","spliced":false,"error":null}\n'
                 % (_t(t + 80), cid, conn % 250, 30000 + conn % 30000, key, nid, nid, 15672 + node,
                    50000, 20000, 80000.0))
        rfile.write(route)
        rfile.write(close)
        rsize += len(route) + len(close)
        n += 2
        addr = f"app.{g}"
        f = act_files[node]
        for w in range(WINDOWS):
            nbytes = 1000 + (conn * 7 + w * 13) % 9000
            rec = ('{"ts":"%s","node_id":"%s","node":"broker-%d","connection_id":"%s-%d","container_id":"%s",'
                   '"user":"app","source":"10.0.0.%d:%d","address":"%s","direction":"%s","messages":%d,"bytes":%d,'
                   '"window_start":"%s","window_end":"%s","final":%s}\n'
                   % (_t3(t + 10 * w + 10), nid, node + 1, nid[:8], conn, key, conn % 250, 30000 + conn % 30000,
                      addr, "produce" if producer else "consume", nbytes // 100, nbytes,
                      _t3(t + 10 * w), _t3(t + 10 * w + 10), "true" if w == WINDOWS - 1 else "false"))
            f.write(rec)
            n += 1
        if producer:  # what this producer's broker forwarded to the group's other brokers
            peer = place[groups[g][1]] if len(groups[g]) > 1 else node
            if peer != node:
                f.write('{"ts":"%s","node_id":"%s","node":"broker-%d","connection_id":"cluster:%s",'
                        '"container_id":null,"user":null,"source":null,"address":"%s","direction":"forward",'
                        '"messages":40,"bytes":%d,"window_start":"%s","window_end":"%s","final":false,'
                        '"peer_node_id":"%s"}\n'
                        % (_t3(t + 90), nid, node + 1, NODES[peer][:8], addr, 40000, _t3(t + 80), _t3(t + 90),
                           NODES[peer]))
                n += 1
        if conn % 10000 == 9999:
            f.write('{"ts": "garbage\n')   # a malformed line now and then
            n += 1
        conn += 1
        if rsize >= ROTATE_BYTES:
            rfile.close()
            rot.append(rdir / f"routing.part{len(rot)}")
            rfile = open(rdir / f"routing.part{len(rot)}", "w", buffering=1 << 20)
            rsize = 0
    rfile.close()
    rot.append(rdir / f"routing.part{len(rot)}")
    for f in act_files:
        f.close()
    # oldest first → routing.log.N … routing.log.1, the newest is routing.log
    for i, p in enumerate(rot):
        age = len(rot) - 1 - i
        p.rename(rdir / ("routing.log" if age == 0 else f"routing.log.{age}"))
    (root / "lines").write_text(str(n))
    return n


def run_job(root: Path, out: Path, master: str, driver_memory: str) -> tuple[float, dict, str]:
    argv = [sys.executable, "-m", "spark.jobs.gravity", str(root / "router"), *[str(root / f"broker-{i}")
            for i in (1, 2, 3)], "--out", str(out), "--master", master, "--driver-memory", driver_memory]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t = time.monotonic()
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t
    if r.returncode != 0:
        raise SystemExit(f"job failed ({r.returncode}):\n{r.stderr[-4000:]}")
    progress = [line for line in r.stderr.replace("\r", "\n").splitlines() if line.startswith("gravity: [")]
    return wall, json.loads((out / "summary.json").read_text()), "\n".join(progress)


def linear_fit(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """``t = fixed + per_line · n`` by least squares over (lines, seconds) points, and the largest
    residual relative to its measured time."""
    k = len(points)
    mn = sum(n for n, _ in points) / k
    mt = sum(t for _, t in points) / k
    per_line = sum((n - mn) * (t - mt) for n, t in points) / sum((n - mn) ** 2 for n, _ in points)
    fixed = mt - per_line * mn
    worst = max(abs(t - (fixed + per_line * n)) / t for n, t in points)
    return fixed, per_line, worst


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lines", default="1000000,3000000,10000000")
    ap.add_argument("--dir", default=str(REPO / "var" / "bench-gravity"))
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--driver-memory", default="4g")
    ap.add_argument("--keep", action="store_true", help="keep the generated logs")
    a = ap.parse_args(argv)
    base = Path(a.dir)
    rows = []
    for size in [int(x) for x in a.lines.split(",")]:
        root = base / str(size)
        if (root / "lines").exists():
            n = int((root / "lines").read_text())
            print(f"{size:,} lines: reusing {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
            t = time.monotonic()
            n = generate(root, size)
            mb = sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) / 1e6
            print(f"{size:,} lines: generated {n:,} lines ({mb:,.0f} MB) in {time.monotonic() - t:.0f} s", flush=True)
        wall, s, progress = run_job(root, base / f"out-{size}", a.master, a.driver_memory)
        print(progress, flush=True)
        assert s["lines_read"] == n, (s["lines_read"], n)
        rows.append((size, n, wall, s["elapsed_s"], s))
        print(f"{n:,} lines on {a.master}: {wall:.1f} s wall ({n / wall:,.0f} lines/s), job {s['elapsed_s']:.1f} s "
              f"({n / s['elapsed_s']:,.0f} lines/s); {s['keys']:,} keys, {s['lines_malformed']} set aside, "
              f"cross-broker bytes {s['cross_broker_bytes']:,} → {s['recommended_cross_broker_bytes']:,.0f}, "
              f"skew {max(s['skew'].values()):.3f} → {max(s['recommended_skew'].values()):.3f}", flush=True)
        if not a.keep:
            shutil.rmtree(root, ignore_errors=True)
    if len(rows) > 1:
        (s0, n0, w0, j0, _), (s1, n1, w1, j1, _) = rows[0], rows[-1]
        print(f"per-line cost {n1:,} vs {n0:,} lines: wall {(w1 / n1) / (w0 / n0):.2f}x, "
              f"job {(j1 / n1) / (j0 / n0):.2f}x (1.00 = linear)")
        for i in range(1, len(rows)):  # the marginal cost: what the lines added between two sizes cost
            (_, na, _, ja, _), (_, nb, _, jb, _) = rows[i - 1], rows[i]
            print(f"marginal {na:,} → {nb:,} lines: job +{jb - ja:.1f} s for +{nb - na:,} lines "
                  f"({(nb - na) / max(jb - ja, 1e-9):,.0f} lines/s)")
    if len(rows) > 2:
        fixed, per_line, worst = linear_fit([(r[1], r[3]) for r in rows])
        print(f"least-squares fit of the job time: {fixed:.1f} s + {per_line * 1e6:.2f} s per million lines "
              f"({1 / per_line:,.0f} lines/s); largest residual {worst:.1%} of a measured time "
              f"(small = linear in lines)")
    goal = [r for r in rows if r[0] >= 10_000_000]
    for r in goal:
        print(f"goal (10 M lines in under 5 minutes): {r[2]:.0f} s wall — {'met' if r[2] < 300 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
