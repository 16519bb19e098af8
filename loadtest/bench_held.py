#!/usr/bin/env python3
"""Held connections: how many idle proxied clients one router process keeps, at what cost, and
how new clients fare meanwhile — beside HAProxy (and a baseline revision), in one run.

How to run (from the repo root; needs gcc, libssl-dev, haproxy; about 2 minutes with the defaults):

    .venv/bin/python loadtest/bench_held.py                          # 9,500 per process
    .venv/bin/python loadtest/bench_held.py --held 2000 --targets haproxy,proxy
    .venv/bin/python loadtest/bench_held.py --baseline-ref main      # + the router of that revision
    options: [--held 9500] [--targets haproxy,proxy,proxy-w2] [--probe-secs 3] [--idle-secs 5]
             [--json out.json] [--baseline-ref REV]

What runs (127.0.0.1, ports from the OS; the processes of loadtest/bench_proxy.py): the
``amqpload`` backend, HAProxy 2.6 (mode tcp, one thread), the router (proxy acceptor, one worker:
``proxy``; ``workers = 2``: ``proxy-w2``; ``--baseline-ref``: ``base``). For each target in turn:

1. ``amqpload hold`` opens ``--held`` connections per process (``proxy-w2``: twice as many), at
   most 50 connecting at once, each through the AMQP handshake (SASL PLAIN + header + Open, both
   replayed to the backend by the router; a TCP pass-through for HAProxy), then idle;
2. descriptors and resident memory of the target's processes, against the same figures before
   (per held connection);
3. new connections meanwhile: ``amqpload cps`` (4 at a time, each connect + handshake + 64-byte
   echo + close) for ``--probe-secs``: rate, p50, p99, errors;
4. CPU at idle: the target's CPU time over ``--idle-secs`` with every connection held and none
   arriving;
5. the held connections closed by the client: how many the target had closed meanwhile
   (``dropped``, must be 0).

The router keeps its hostile-client limits on: ``max-connections-per-source`` is raised to 20,000
(every client here is 127.0.0.1) and ``max-unauthenticated-per-source`` stays at its default
64 (hence at most 50 connecting at once). Bounded (a timeout per step) and loopback only; it
stops by itself. The descriptor limit is the machine's hard ``RLIMIT_NOFILE`` (20,000 here), so
``--held`` × 2 (client and backend socket of each connection) must stay under it per process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_proxy as bp  # noqa: E402 - after the path: run as a script

ALL_TARGETS = ["haproxy", "proxy", "proxy-w2"]
ROUTER_EXTRA = ("max-connections-per-source = 20000",)


def fds(pid: int) -> int:
    return sum(len(os.listdir(f"/proc/{p}/fd")) for p in bp.family(pid))


def rss_kib(pid: int) -> int:
    total = 0
    for p in bp.family(pid):
        with open(f"/proc/{p}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total


class HeldBench(bp.Bench):
    def setup_held(self, targets: list[str], held: int) -> None:
        self.build()
        be = self.ports["direct"] = self.start_backend("backend", tls=False)
        if "haproxy" in targets:
            self.start_haproxy(be, maxconn=held + 100)   # 2 descriptors each: under the hard limit
        if "proxy" in targets:
            self.start_router("proxy", be, workers=1, splice=True, cpus="0,1", plain_extra=ROUTER_EXTRA)
        if "proxy-w2" in targets:
            self.start_router("proxy-w2", be, workers=2, splice=True, cpus="0,1", plain_extra=ROUTER_EXTRA)
        if "base" in targets:
            self.baseline_tree = self.work / "baseline"
            subprocess.run(["git", "-C", str(bp.REPO), "worktree", "add", "--detach", str(self.baseline_tree),
                            self.args.baseline_ref], check=True, capture_output=True)
            self.start_router("base", be, workers=1, splice=True, cpus="0,1", repo=self.baseline_tree,
                              plain_extra=ROUTER_EXTRA)

    def measure(self, target: str, n: int) -> dict:
        a = self.args
        pid = self.procs["haproxy" if target == "haproxy" else target].pid
        port = self.ports[target]
        time.sleep(0.5)
        fds0, rss0 = fds(pid), rss_kib(pid)
        # from 127.0.0.2: 19,000 held clients and the router's 19,000 broker connections would
        # not fit in one address's ephemeral ports (28,232), and the kernel's search for a free
        # one would be what the new connections measure
        hold = subprocess.Popen([str(self.bin), "hold", "-c", "50", "-n", str(n), "-B", "127.0.0.2",
                                 "-t", f"127.0.0.1:{port}"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, text=True)
        try:
            first = json.loads(_line(hold, 300, "amqpload hold did not report"))
            time.sleep(1.0)       # the last connections' handshakes settle
            fds1, rss1 = fds(pid), rss_kib(pid)
            probe = subprocess.run([str(self.bin), "cps", "-n", "4", "-d", str(a.probe_secs), "-w", "0.5",
                                    "-t", f"127.0.0.1:{port}"], capture_output=True, text=True, env=self.env,
                                   timeout=a.probe_secs + 60)
            cps = json.loads(probe.stdout.strip().splitlines()[-1])
            time.sleep(0.5)
            c0, t0 = bp.cpu_seconds(pid), time.monotonic()
            time.sleep(a.idle_secs)
            idle = (bp.cpu_seconds(pid) - c0) / (time.monotonic() - t0)
            hold.stdin.close()
            end = json.loads(_line(hold, 60, "amqpload hold did not end"))
        finally:
            if hold.poll() is None:
                hold.kill()
            hold.wait()
        held = first["held"]
        return {"target": target, "asked": n, "held": held, "errors": first["errors"], "open_secs": first["secs"],
                "dropped": end["dropped"], "fds_per_conn": (fds1 - fds0) / held if held else None,
                "kib_per_conn": (rss1 - rss0) / held if held else None, "rss_mib": rss1 / 1024,
                "new_cps": cps["cps"], "new_p50_ms": cps["p50_ms"], "new_p99_ms": cps["p99_ms"],
                "new_errors": cps["errors"], "idle_cpu": idle}


def _line(p: subprocess.Popen, timeout: float, what: str) -> str:
    deadline = time.monotonic() + timeout
    import select
    while time.monotonic() < deadline:
        r, _, _ = select.select([p.stdout], [], [], 1.0)
        if r:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"{what}: it exited")
            return line
    raise RuntimeError(f"{what} within {timeout:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--held", type=int, default=9500, help="idle connections per process")
    ap.add_argument("--targets", default=",".join(ALL_TARGETS))
    ap.add_argument("--probe-secs", type=float, default=3.0)
    ap.add_argument("--idle-secs", type=float, default=5.0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--baseline-ref", metavar="REV",
                    help="also run the router of this git revision (a temporary worktree) in the same run")
    ap.add_argument("--no-pin", action="store_true", default=True, help=argparse.SUPPRESS)
    a = ap.parse_args()
    targets = a.targets.split(",")
    if a.baseline_ref and "base" not in targets:
        targets.append("base")
    if "haproxy" in targets and bp.shutil.which("haproxy") is None:
        targets.remove("haproxy")
        print("haproxy not found: the HAProxy baseline is skipped (Debian package 'haproxy')", file=sys.stderr)
    bp.raise_nofile()
    bench = HeldBench(a)
    started = time.monotonic()
    rows = []
    try:
        bench.setup_held(targets, a.held)
        for t in targets:
            n = a.held * (2 if t == "proxy-w2" else 1)
            row = bench.measure(t, n)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        bench.stop()
    hap = next((r for r in rows if r["target"] == "haproxy"), None)
    base = next((r for r in rows if r["target"] == "base"), None)
    print(f"\n{'target':9s} {'held':>7s} {'err':>4s} {'drop':>4s} {'fds/conn':>8s} {'KiB/conn':>8s} "
          f"{'vs HAProxy':>10s} {'vs base':>7s} {'new conn/s':>10s} {'p50 ms':>7s} {'p99 ms':>7s} {'idle CPU':>8s}")
    for r in rows:
        kib = r["kib_per_conn"]
        vs_hap = f"{kib / hap['kib_per_conn']:.2f}x" if hap and hap is not r and kib and hap["kib_per_conn"] else ""
        vs_base = f"{kib / base['kib_per_conn']:.2f}x" if base and base is not r and kib and base["kib_per_conn"] else ""
        print(f"{r['target']:9s} {r['held']:>7d} {r['errors']:>4d} {r['dropped']:>4d} "
              f"{r['fds_per_conn'] or 0:>8.2f} {kib or 0:>8.2f} {vs_hap:>10s} {vs_base:>7s} {r['new_cps']:>10.0f} "
              f"{r['new_p50_ms']:>7.2f} {r['new_p99_ms']:>7.2f} {r['idle_cpu'] * 100:>7.1f}%"
              + (f"  new-connection errors={r['new_errors']}" if r["new_errors"] else ""))
    print("\nKiB/conn = growth of the target's resident memory per held connection (all its processes);\n"
          "fds/conn the same for open descriptors; new conn/s, p50, p99: connections made while the others\n"
          f"are held; idle CPU: share of one core with every connection idle. elapsed {time.monotonic() - started:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["held"] == r["asked"] and r["dropped"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
