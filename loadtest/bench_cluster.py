#!/usr/bin/env python3
"""Cluster forwarding benchmark: producer on node A → consumer on node B, beside A → A, same run.

Two broker processes (``python -m broker run`` of this checkout) form a cluster under
``message-load-balancing = "ON_DEMAND"``: A starts first, B names A as its static connector;
ports come from the OS, each node has its own scratch folder, the cluster password is set. The
client is ``loadtest/amqp_client.py`` (python-qpid-proton, one process: producer and consumer),
the one ``bench_broker.py`` runs, so its CPU stays out of the brokers' figures.

Per round, durability and body size, two workloads, alternating which goes first:

* **local**: producer and consumer both on A (address ``local.q``); B is idle (its CPU over the
  interval is printed as a check, not counted);
* **forwarded**: producer on A, consumer on B (address ``fwd.q``). The consumer attaches on B
  first; the client holds its first send until A lists B's consumer among its remote bindings
  (``GET /api/v1/cluster``), so every message goes A → B over the cluster bridge (A's
  store-and-forward queue, then B's queue), none stays on A.

Figures: msgs/s end to end (first send → last receipt) and broker CPU per message (utime+stime
from /proc over that interval, divided by the messages): A's for local, A's + B's for forwarded,
and the forwarded split per node. ``tail`` is what A and B still spent for the run in
``--tail-s`` after the last receipt (acknowledgements between the nodes; not in the figures).
Medians over ``--rounds``; the ratios are forwarded ÷ local: CPU per message (goal ≤ 2.0) and
msgs/s (goal ≥ 0.8). On a 2-core machine the forwarded case runs three busy processes (A, B,
the client) on two cores, local runs two; that is part of what the msgs/s ratio shows (the
client's own CPU per message is printed beside the rates).

The local baseline is A as a cluster member: once A knows a remote binding (B's ``fwd.q``, from
the warm-up on), every publish on A, ``local.q`` included, takes the cluster's routing path
(``Broker._publish_clustered``). ``--only local`` never attaches a consumer on B, so A knows no
remote binding and publishes with the single-node loop: the difference is what being in a
cluster costs local traffic.

    .venv/bin/python loadtest/bench_cluster.py [--n 20000] [--rounds 3] [--sizes 100,4096]
        [--durable | --non-durable] [--warmup 2000] [--json] [--only local|forwarded] [--profile DIR]

A short warm-up run of each workload (``--warmup`` messages, not counted) precedes round 1.
``--profile DIR`` runs both brokers under cProfile (their main thread; the figures are then not
comparable with an unprofiled run) and writes ``DIR/A.prof`` and ``DIR/B.prof`` (read them with
``python -m pstats``) and prints each node's top functions; with ``--only`` one workload is run,
so a profile shows that workload alone (plus the warm-up and the cluster's own chatter).
cProfile inflates small Python calls (the codec) several-fold; a sampling profiler from outside
distorts less: the nodes' pids are printed on stderr at start (``py-spy record -p PID``, with a
large ``--n`` so the run outlasts the recording).
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
LOCAL_ADDRESS = "local.q"
FORWARD_ADDRESS = "fwd.q"


class Node:
    """A broker process of the benchmark cluster (its own folder, OS-chosen ports)."""

    def __init__(self, work: Path, name: str, static: list[str] = (), profile: Path | None = None, *,
                 port: int = 0, cluster_extra: str = ""):
        """``port``: the AMQP port (0: the OS picks), also the cluster connector's; ``cluster_extra``:
        TOML lines after the ``[cluster]`` keys (more keys, then other tables)."""
        self.name = name
        self.work = work / name
        self.work.mkdir(parents=True)
        sys.path.insert(0, str(REPO))
        (self.work / "users.toml").write_text(
            f'[users.bench]\npassword = "{hash_password("bench", n=1024)}"\nroles = ["app", "admin"]\n\n'
            '[[permissions]]\nmatch = "#"\nsend = ["app"]\nconsume = ["app"]\ncreate-address = ["app"]\n'
            'manage = ["admin"]\n')
        statics = ", ".join(json.dumps(s) for s in static)
        (self.work / "broker.toml").write_text(
            f'[node]\nname = "{name}"\ndata-dir = "data"\n'
            f'[acceptors.amqp]\nhost = "127.0.0.1"\nport = {port}\n'
            '[management]\nhost = "127.0.0.1"\nport = 0\n'
            '[activity-log]\nflush-interval-s = 10\n[logging]\nlevel = "WARNING"\n'
            f'[cluster]\nname = "bench"\nconnector = "amqp://127.0.0.1:{port}"\n'
            f'static-connectors = [{statics}]\nuser = "bench-cluster"\npassword = "{CLUSTER_PASSWORD}"\n'
            'message-load-balancing = "ON_DEMAND"\nretry-interval-ms = 100\nmax-retry-interval-ms = 500\n'
            + cluster_extra)
        out = self.work / "stdout.log"
        prof = ["-m", "cProfile", "-o", str(profile / f"{name}.prof")] if profile is not None else []
        self.proc = subprocess.Popen([sys.executable, *prof, "-m", "broker", "run", str(self.work / "broker.toml")],
                                     cwd=REPO, stdout=open(out, "wb"), stderr=open(self.work / "stderr.log", "wb"),
                                     stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"})
        self.pid = self.proc.pid
        urls: dict[str, str] = {}
        deadline = time.monotonic() + 30
        while not {"amqp", "management"} <= set(urls):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"{name} did not start: {(self.work / 'stderr.log').read_text()[-2000:]}")
            time.sleep(0.05)
            for line in out.read_text().splitlines():
                parts = line.split()
                if len(parts) == 3 and parts[0] == "listening":
                    urls[parts[1]] = parts[2]
        self.amqp = urls["amqp"]  # amqp://127.0.0.1:port, what the other node dials
        self.url = self.amqp.replace("amqp://", "amqp://bench:bench@")
        self.management = urls["management"]

    @property
    def node_id(self) -> str:
        return (self.work / "data" / "node.id").read_text().strip()

    def get(self, path: str):
        req = urllib.request.Request(self.management + path)
        req.add_header("Authorization", "Basic " + base64.b64encode(b"bench:bench").decode())
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def known_consumers(self, address: str) -> int:
        """Consumers on other nodes' queues of ``address`` that this node knows of."""
        return sum(b["consumers"] for b in self.get("/api/v1/cluster")["remote_bindings"] if b["address"] == address)

    def queue(self, name: str) -> dict | None:
        return next((q for q in self.get("/api/v1/queues") if q["name"] == name), None)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_until(pred, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.02)


def start_cluster(work: Path, profile: Path | None = None) -> tuple[Node, Node]:
    a = Node(work, "A", profile=profile)
    try:
        b = Node(work, "B", static=[a.amqp], profile=profile)
    except BaseException:
        a.stop()
        raise
    ids = {a.node_id, b.node_id}

    def meshed() -> bool:
        return all({br["to"] for br in n.get("/api/v1/cluster")["bridges"] if br["connected"]} >= ids - {n.node_id}
                   for n in (a, b))
    try:
        wait_until(meshed, "a bridge each way between A and B")
    except BaseException:
        a.stop()
        b.stop()
        raise
    return a, b


def run_client(a: Node, b: Node, forwarded: bool, durable: bool, size: int, n: int, tail_s: float,
               work: Path) -> dict:
    """One client run; for forwarded, the first send waits until A knows B's consumer."""
    if forwarded:
        return client_run(a, b, a, FORWARD_ADDRESS, (a, b), durable, size, n, tail_s, work)
    return client_run(a, a, None, LOCAL_ADDRESS, (a, b), durable, size, n, tail_s, work)


def client_run(producer: Node, consumer: Node, watcher: Node | None, address: str, nodes: tuple[Node, ...],
               durable: bool, size: int, n: int, tail_s: float, work: Path) -> dict:
    """One client run: producer on ``producer``, consumer on ``consumer``; with a ``watcher``, the
    first send waits until that node knows the consumer as a remote one. CPU figures are read
    for ``nodes``, in that order."""
    go = work / "go"
    go.unlink(missing_ok=True)
    cmd = [sys.executable, str(CLIENT), "--url", producer.url, "--rx-url", consumer.url, "--address", address,
           "--n", str(n), "--size", str(size), "--broker-pid", ",".join(str(x.pid) for x in nodes),
           "--tail-s", str(tail_s)]
    if durable:
        cmd.append("--durable")
    if watcher is not None:
        # the last run's consumer must be gone from the watcher's view first, or it could still count it
        wait_until(lambda: watcher.known_consumers(address) == 0, f"{watcher.name} to forget the last run's consumer")
        cmd += ["--go-file", str(go)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if watcher is not None:
            line = p.stdout.readline()
            if line.strip() != "links-up":
                p.kill()
                _, err = p.communicate()
                return {"error": f"client failed before sending: {line.strip()} {err.strip()[-300:]}"}
            wait_until(lambda: watcher.known_consumers(address) == 1, f"{watcher.name} to know the consumer")
            go.touch()
        out, err = p.communicate(timeout=600)
    except BaseException:
        p.kill()
        p.wait()
        raise
    try:
        r = json.loads(out.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"client failed: {err.strip()[-300:]}"}
    if r.get("error") is None and "broker_cpu_us_per_msg_each" not in r:
        r["error"] = "no CPU figures"
    return r


def common_args(doc: str, *, n: int, sizes: str, warmup: int) -> argparse.ArgumentParser:
    """The options this benchmark shares with ``bench_shared_queue.py``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=n, help="messages per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default=sizes, help="comma list of body sizes in bytes")
    dur = ap.add_mutually_exclusive_group()
    dur.add_argument("--durable", dest="durability", action="store_const", const=(True,),
                     help="durable messages only")
    dur.add_argument("--non-durable", dest="durability", action="store_const", const=(False,),
                     help="non-durable messages only")
    ap.set_defaults(durability=(False, True))
    ap.add_argument("--warmup", type=int, default=warmup, help="messages per warm-up run (0: none)")
    ap.add_argument("--tail-s", type=float, default=0.5,
                    help="after each run, how long to keep reading the brokers' CPU (the 'tail' column)")
    ap.add_argument("--json", action="store_true", help="also print every result as JSON lines")
    return ap


def run_rounds(run, a, workloads, sizes) -> tuple[dict, bool]:
    """The warm-up, then ``a.rounds`` rounds of every durability, size and workload (alternating
    which workload goes first); ``run(forwarded, durable, size, n, tail_s)`` is one client run.
    Returns the results by (durable, size, forwarded) and whether any run failed."""
    results: dict[tuple, list[dict]] = {}
    failed = False
    if a.warmup:
        for durable in a.durability:
            for forwarded in workloads:
                r = run(forwarded, durable, sizes[0], a.warmup, 0)
                if r.get("error"):
                    raise SystemExit(f"warm-up failed: {r['error']}")
    for rnd in range(a.rounds):
        for durable in a.durability:
            for size in sizes:
                order = workloads if rnd % 2 == 0 else workloads[::-1]
                for forwarded in order:
                    r = run(forwarded, durable, size, a.n, a.tail_s)
                    results.setdefault((durable, size, forwarded), []).append(r)
                    if a.json:
                        print(json.dumps({"round": rnd, "forwarded": forwarded, **r}), flush=True)
                    if r.get("error"):
                        failed = True
                        print(f"{'forwarded' if forwarded else 'local'} durable={durable} size={size}: "
                              f"{r['error']}", file=sys.stderr)
    return results, failed


def med(rs, key, i=None):
    vals = [(r[key] if i is None else r[key][i]) for r in rs if key in r]
    return statistics.median(vals) if vals else float("nan")


def fmt(v: float, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v != v else f"{v:>{width}{spec}}"


def ratio(loc, fwd, f) -> float:
    """Median over rounds of the per-round ratio (a round's two runs are neighbours in time)."""
    rs = [f(lr, fr) for lr, fr in zip(loc, fwd) if not (lr.get("error") or fr.get("error"))]
    return statistics.median(rs) if rs else float("nan")


def summary_rows(results: dict, durability, sizes) -> list[dict]:
    """Per durability and size: the medians and ratios both benchmarks print (``f_``: the second
    workload, ``l_``: the local one; ``_each`` figures by the order of the client's broker pids)."""
    rows = []
    for durable in durability:
        for size in sizes:
            loc = results.get((durable, size, False), [])
            fwd = results.get((durable, size, True), [])
            rows.append({
                "name": f"{'durable' if durable else 'non-durable'} {size} B",
                "l_rate": med(loc, "msgs_per_s"), "f_rate": med(fwd, "msgs_per_s"),
                "rate_r": ratio(loc, fwd, lambda lr, fr: fr["msgs_per_s"] / lr["msgs_per_s"]),
                "l_client": med(loc, "client_cpu_us_per_msg"), "f_client": med(fwd, "client_cpu_us_per_msg"),
                "l_a": med(loc, "broker_cpu_us_per_msg_each", 0), "l_b": med(loc, "broker_cpu_us_per_msg_each", 1),
                "f_ab": med(fwd, "broker_cpu_us_per_msg"),
                "f_a": med(fwd, "broker_cpu_us_per_msg_each", 0), "f_b": med(fwd, "broker_cpu_us_per_msg_each", 1),
                "f_tail": statistics.median([sum(r["broker_cpu_tail_us_per_msg_each"]) for r in fwd
                                             if "broker_cpu_tail_us_per_msg_each" in r] or [float("nan")]),
                "cpu_r": ratio(loc, fwd, lambda lr, fr: fr["broker_cpu_us_per_msg"]
                               / lr["broker_cpu_us_per_msg_each"][0]),
            })
    return rows


def main() -> int:
    ap = common_args(__doc__, n=20000, sizes="100,4096", warmup=2000)
    ap.add_argument("--only", choices=("local", "forwarded"), help="run one workload only (for --profile)")
    ap.add_argument("--profile", metavar="DIR", type=Path, help="run the brokers under cProfile, profiles in DIR")
    a = ap.parse_args()
    workloads = {"local": (False,), "forwarded": (True,), None: (False, True)}[a.only]
    if a.profile is not None:
        a.profile = a.profile.resolve()
        a.profile.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in a.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="lodestone-bench-cluster-"))
    results: dict[tuple, list[dict]] = {}
    failed = False
    left: dict = {}
    bridge: list = []
    nodes: tuple[Node, ...] = ()
    try:
        nodes = start_cluster(work, a.profile)
        na, nb = nodes
        # for an outside profiler (py-spy record -p PID): which process is which node
        print(f"cluster up: A pid {na.pid} {na.amqp}, B pid {nb.pid} {nb.amqp}", file=sys.stderr, flush=True)
        results, failed = run_rounds(lambda fwd, durable, size, n, tail_s: run_client(
            na, nb, fwd, durable, size, n, tail_s, work), a, workloads, sizes)
        # nothing may be left behind: every forwarded message reached B's consumer
        left = {f"{n.name}:{q}": (n.queue(q) or {}).get("depth", 0)
                for n in nodes for q in (LOCAL_ADDRESS, FORWARD_ADDRESS)}
        bridge = na.get("/api/v1/cluster")["bridges"]
    finally:
        for n in nodes:
            n.stop()
        shutil.rmtree(work, ignore_errors=True)

    rows = summary_rows(results, a.durability, sizes)

    print(f"\nproducer on A -> consumer on A (local) or on B (forwarded); n={a.n}, median of {a.rounds} rounds; "
          "2-node cluster, ON_DEMAND; python-qpid-proton client (amqp_client.py)")
    print("\nmsgs/s, end to end (first send -> last receipt); client CPU µs/msg for comparison (not in any ratio)")
    print(f"{'workload':<22}{'local':>10}{'forwarded':>11}{'fwd ÷ local':>13}{'   goal ≥ 0.8':<14}"
          f"{'client µs/msg local':>21}{'fwd':>7}")
    for r in rows:
        ok = "-" if r["rate_r"] != r["rate_r"] else ("met" if r["rate_r"] >= 0.8 else "MISSED")
        print(f"{r['name']:<22}{fmt(r['l_rate'], ',.0f', 10)}{fmt(r['f_rate'], ',.0f', 11)}"
              f"{fmt(r['rate_r'], '.2f', 13)}   {ok:<11}{fmt(r['l_client'], '.1f', 21)}{fmt(r['f_client'], '.1f', 7)}")
    print("\nbroker CPU µs/msg (utime+stime from /proc): local = A alone (B is idle; its figure is shown, not "
          "counted); forwarded = A + B, split per node")
    print(f"{'workload':<22}{'local A':>9}{'(B idle)':>10}{'fwd A+B':>9}{'= A':>7}{'+ B':>7}"
          f"{'fwd ÷ local':>13}{'   goal ≤ 2.0':<14}{'tail A+B':>9}")
    for r in rows:
        ok = "-" if r["cpu_r"] != r["cpu_r"] else ("met" if r["cpu_r"] <= 2.0 else "MISSED")
        print(f"{r['name']:<22}{fmt(r['l_a'], '.1f', 9)}{fmt(r['l_b'], '.1f', 10)}{fmt(r['f_ab'], '.1f', 9)}"
              f"{fmt(r['f_a'], '.1f', 7)}{fmt(r['f_b'], '.1f', 7)}{fmt(r['cpu_r'], '.2f', 13)}   {ok:<11}"
              f"{fmt(r['f_tail'], '.1f', 9)}")
    print("ratios: median over rounds of forwarded ÷ local within the round. tail: CPU A and B still spent in "
          f"{a.tail_s} s after the last receipt of a forwarded run (not in the figures)")
    print(f"queue depths after the run (expect 0): {left}")
    print("A's bridge: " + "; ".join(f"forwarded {br['forwarded']}, acked {br['acked']}, pending {br['pending']}"
                                      for br in bridge))
    if a.profile is not None:
        import pstats
        for n in nodes:
            path = a.profile / f"{n.name}.prof"
            if not path.exists():
                print(f"no profile from {n.name} ({path})")
                continue
            for key in ("tottime", "cumulative"):
                print(f"\n== node {n.name}: top 30 by {key} ({path}) ==")
                pstats.Stats(str(path)).sort_stats(key).print_stats(30)
    return 1 if failed or any(left.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
