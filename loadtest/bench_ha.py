#!/usr/bin/env python3
"""HA replication benchmark: durable 1 → 1 on a primary with a replicated backup, beside the same
broker without one, in the same run (issue 12: goal ≥ 0.6× the msgs/s).

Three broker processes of this checkout, each in its own scratch folder, ports from the OS:

* **single**: a plain node (``[ha] policy = "live-only"``), the baseline;
* **primary** + **backup**: ``[ha] policy = "replication"``; the backup follows the primary and
  is in sync (``GET /api/v1/ha``) before any measured run, so every durable send is answered
  only once both journals hold it (``docs/ha.md``, "What an acknowledgement means").

The client is ``loadtest/amqp_client.py`` (python-qpid-proton, one process, producer and
consumer on the node under test: the figures of ``bench_broker.py``). Per round and body size
the two workloads run back to back, alternating which goes first. Figures: msgs/s end to end
(first send → last receipt) and broker CPU per message (utime+stime from /proc over that
interval): the single node's; the primary's and the backup's, and their sum. Medians over
``--rounds``; the ratios are replicated ÷ single, per round: msgs/s (goal ≥ 0.6) and CPU per
message (the primary alone, and primary + backup). ``--backup-fsync false`` measures a backup
that confirms before its fsync. On a 2-core machine the replicated case runs three busy
processes (client, primary, backup) on two cores, the single case two.

    .venv/bin/python loadtest/bench_ha.py [--n 20000] [--rounds 3] [--sizes 100,4096] [--warmup 2000]
        [--backup-fsync true|false] [--json]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from broker.wire.io.users import hash_password

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CLIENT = HERE / "amqp_client.py"
CLUSTER_PASSWORD = "bench-cluster-secret"
ADDRESS = "ha.q"


class Node:
    """One broker process (its own folder, OS-chosen ports); ``wait`` names the listeners to wait for."""

    def __init__(self, work: Path, name: str, extra: str, wait: tuple[str, ...] = ("amqp", "management")):
        self.name = name
        self.work = work / name
        self.work.mkdir(parents=True)
        sys.path.insert(0, str(REPO))
        (self.work / "users.toml").write_text(
            f'[users.bench]\npassword = "{hash_password("bench", n=1024)}"\nroles = ["app", "admin"]\n\n'
            '[[permissions]]\nmatch = "#"\nsend = ["app"]\nconsume = ["app"]\ncreate-address = ["app"]\n'
            'manage = ["admin"]\n')
        (self.work / "broker.toml").write_text(
            f'[node]\nname = "{name}"\ndata-dir = "data"\n'
            '[acceptors.amqp]\nhost = "127.0.0.1"\nport = 0\n'
            '[management]\nhost = "127.0.0.1"\nport = 0\n'
            '[journal]\nsync = "batch"\n'
            '[activity-log]\nflush-interval-s = 10\n[logging]\nlevel = "WARNING"\n' + extra)
        out = self.work / "stdout.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "broker", "run", str(self.work / "broker.toml")],
                                     cwd=REPO, stdout=open(out, "wb"), stderr=open(self.work / "stderr.log", "wb"),
                                     stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
        self.pid = self.proc.pid
        urls: dict[str, str] = {}
        deadline = time.monotonic() + 30
        while not set(wait) <= set(urls):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{name} did not start: {(self.work / 'stderr.log').read_text()[-2000:]}")
            time.sleep(0.05)
            for line in out.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[0] == "listening":
                    urls[parts[1]] = parts[2]
        self.amqp = urls.get("amqp", "")
        self.url = self.amqp.replace("amqp://", "amqp://bench:bench@")
        self.management = urls["management"]

    def get(self, path: str):
        req = urllib.request.Request(self.management + path)
        req.add_header("Authorization", "Basic " + base64.b64encode(b"bench:bench").decode())
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def cluster_table(static: list[str]) -> str:
    statics = ", ".join(json.dumps(s) for s in static)
    return ('[cluster]\nname = "bench"\nconnector = "amqp://127.0.0.1:0"\n'
            f'static-connectors = [{statics}]\nuser = "bench-cluster"\npassword = "{CLUSTER_PASSWORD}"\n'
            'retry-interval-ms = 100\nmax-retry-interval-ms = 500\n')


def wait_until(pred, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def run_client(node: Node, pids: list[int], size: int, n: int) -> dict:
    cmd = [sys.executable, str(CLIENT), "--url", node.url, "--address", ADDRESS, "--n", str(n), "--size", str(size),
           "--durable", "--broker-pid", ",".join(map(str, pids))]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"client failed: {p.stderr.strip()[-300:]}"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20000, help="messages per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="100,4096")
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--backup-fsync", choices=("true", "false"), default="true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="lodestone-bench-ha-"))
    nodes: list[Node] = []
    results: dict[tuple, list[dict]] = {}
    try:
        single = Node(work, "single", "")
        nodes.append(single)
        primary = Node(work, "primary", cluster_table([]) + '[ha]\npolicy = "replication"\nrole = "primary"\n')
        nodes.append(primary)
        backup = Node(work, "backup", cluster_table([primary.amqp]) +
                      f'[ha]\npolicy = "replication"\nrole = "backup"\nbackup-fsync = {a.backup_fsync}\n',
                      wait=("management",))
        nodes.append(backup)
        wait_until(lambda: primary.get("/api/v1/ha")["replication"]["state"] == "in-sync", "the backup in sync")
        print(f"nodes up: single pid {single.pid}, primary pid {primary.pid}, backup pid {backup.pid} "
              f"(backup-fsync {a.backup_fsync})", file=sys.stderr, flush=True)
        cases = {"single": (single, [single.pid]), "replicated": (primary, [primary.pid, backup.pid])}
        if a.warmup:
            for name, (node, pids) in cases.items():
                r = run_client(node, pids, sizes[0], a.warmup)
                if r.get("error"):
                    raise SystemExit(f"warm-up of {name} failed: {r['error']}")
        for rnd in range(a.rounds):
            for size in sizes:
                order = ["single", "replicated"] if rnd % 2 == 0 else ["replicated", "single"]
                for name in order:
                    node, pids = cases[name]
                    r = run_client(node, pids, size, a.n)
                    if a.json:
                        print(json.dumps({"round": rnd, "case": name, "size": size, **r}), flush=True)
                    if r.get("error"):
                        raise SystemExit(f"{name} size={size}: {r['error']}")
                    results.setdefault((name, size), []).append(r)
                    if name == "replicated":
                        ha = primary.get("/api/v1/ha")["replication"]
                        if ha["state"] != "in-sync":
                            raise SystemExit(f"the backup dropped out during the run: {ha}")
        depth = {n.name: next((q["depth"] for q in n.get("/api/v1/queues") if q["name"] == ADDRESS), 0)
                 for n in (single, primary)}
        lost = primary.get("/api/v1/ha")["replication"]["lost"]
    finally:
        for n in nodes:
            n.stop()
        shutil.rmtree(work, ignore_errors=True)

    def med(vals):
        vals = [v for v in vals if v == v]
        return statistics.median(vals) if vals else float("nan")

    print(f"\ndurable 1 -> 1 on one node; n={a.n}, median of {a.rounds} rounds; python-qpid-proton client "
          f"(amqp_client.py); backup-fsync = {a.backup_fsync}")
    print(f"{'size':>6}{'single msgs/s':>15}{'replicated':>12}{'ratio':>8}{'  goal ≥ 0.6':<13}"
          f"{'CPU µs/msg single':>19}{'primary':>9}{'backup':>8}{'P÷single':>10}{'(P+B)÷single':>14}")
    for size in sizes:
        s_runs, r_runs = results[("single", size)], results[("replicated", size)]
        rate_r = med([r["msgs_per_s"] / s["msgs_per_s"] for s, r in zip(s_runs, r_runs)])
        cpu_p = med([r["broker_cpu_us_per_msg_each"][0] / s["broker_cpu_us_per_msg"] for s, r in zip(s_runs, r_runs)])
        cpu_pb = med([r["broker_cpu_us_per_msg"] / s["broker_cpu_us_per_msg"] for s, r in zip(s_runs, r_runs)])
        ok = "met" if rate_r >= 0.6 else "MISSED"
        print(f"{size:>6}{med([s['msgs_per_s'] for s in s_runs]):>15,.0f}{med([r['msgs_per_s'] for r in r_runs]):>12,.0f}"
              f"{rate_r:>8.2f}  {ok:<11}{med([s['broker_cpu_us_per_msg'] for s in s_runs]):>19.1f}"
              f"{med([r['broker_cpu_us_per_msg_each'][0] for r in r_runs]):>9.1f}"
              f"{med([r['broker_cpu_us_per_msg_each'][1] for r in r_runs]):>8.1f}{cpu_p:>10.2f}{cpu_pb:>14.2f}")
    print("ratios: median over rounds of replicated ÷ single within the round")
    print(f"queue depths after the runs (expect 0): {depth}; times the backup was lost: {lost}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
