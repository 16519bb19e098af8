#!/usr/bin/env python3
"""Broker benchmark: Lodestone's broker beside RabbitMQ (AMQP 1.0 plugin), same client, same run.

Workloads: 1 producer → 1 consumer on one queue, non-durable and durable, 100 B and 4 KiB bodies
(``loadtest/amqp_client.py``, python-qpid-proton). For each: msgs/s (end to end) and the broker's
CPU per message (utime+stime of the broker process from /proc over the measured interval), as the
median of ``--rounds`` rounds; brokers alternate within a round. Ratios are Lodestone / RabbitMQ:
for CPU per message lower is better, for msgs/s higher is better. The Python client limits the
message rate on a 2-core machine, so the CPU per message is the figure to compare.

RabbitMQ: Debian's ``rabbitmq-server`` (installed with apt-get if missing), run from a scratch
folder on loopback with its ``rabbitmq_amqp1_0`` plugin enabled offline, on OS-chosen free ports;
nothing in /etc is touched. Queues ``bench-t`` (transient) and ``bench-d`` (durable) are declared
with ``rabbitmqctl eval`` and addressed as ``/amq/queue/<name>``. ``--no-rabbitmq`` skips it.

    .venv/bin/python loadtest/bench_broker.py [--n 50000] [--rounds 3] [--sizes 100,4096]
        [--baseline-ref REV] [--features [--tx-batch 100]] [--client native [--conns 1,4]]

``--client native`` drives the brokers with ``loadtest/amqpperf.c`` instead (Qpid Proton-C's
proactor; compiled here with gcc against Debian's ``libqpid-proton11-dev``, installed with
apt-get if missing): a real AMQP 1.0 client (SASL PLAIN, credit, unsettled sends, accepted and
settled receipts) whose own CPU per message is a fraction of the broker's, so the figures are the
brokers' limits. ``--conns 1,4`` runs 1 producer → 1 consumer and 4 → 4 (one connection each,
one queue), for every size and durability.

``--baseline-ref REV`` also runs the broker of that git revision (a temporary worktree), so a new
feature's cost when unused is measured against the same node without it, in the same run.
``--features`` adds, on this checkout, a consumer with a selector (every message matches) and
transactional sends (``--tx-batch`` messages per transaction, committed), so their cost when
used is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from broker.wire.io.users import hash_password

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from tests.rabbitproc import RabbitMQ as RabbitNode  # noqa: E402  (the repository's test helpers)

REPO = HERE.parent
CLIENT = HERE / "amqp_client.py"
NATIVE = HERE / "amqpperf.c"


def build_native(work: Path) -> Path:
    """Compile amqpperf.c (installing Debian's libqpid-proton11-dev when its header is missing)."""
    if not Path("/usr/include/proton/proactor.h").exists():
        subprocess.run(["apt-get", "install", "-y", "-q", "libqpid-proton11-dev"], check=True,
                       stdout=subprocess.DEVNULL)
    out = work / "amqpperf"
    subprocess.run(["gcc", "-O2", "-o", str(out), str(NATIVE), "-lqpid-proton"], check=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- Lodestone ---------------------------------------------------------------------------------

class Lodestone:
    """A Lodestone broker node run from ``repo`` (this checkout, or a baseline's worktree)."""

    def __init__(self, work: Path, repo: Path = REPO, name: str = "lodestone", extra: str = "",
                 permissions: str = "", port: int = 0):
        """``extra``: TOML appended to the broker's config (``bench_mirror.py``'s mirror);
        ``permissions``: more keys of the users file's permission entry (``mirror = ["app"]``);
        ``port``: the AMQP port (0: the OS picks)."""
        self.name = name
        self.repo = repo
        self.work = work / name.replace("@", "-")
        self.work.mkdir(parents=True)
        sys.path.insert(0, str(REPO))
        (self.work / "users.toml").write_text(
            f'[users.bench]\npassword = "{hash_password("bench", n=1024)}"\nroles = ["app"]\n\n'
            '[[permissions]]\nmatch = "#"\nsend = ["app"]\nconsume = ["app"]\ncreate-address = ["app"]\n'
            'manage = ["app"]\n' + permissions)
        (self.work / "broker.toml").write_text(
            '[node]\nname = "bench"\ndata-dir = "data"\n'
            f'[acceptors.amqp]\nhost = "127.0.0.1"\nport = {port}\n'
            '[management]\nport = 0\n[activity-log]\nflush-interval-s = 10\n[logging]\nlevel = "WARNING"\n' + extra)
        self.proc = subprocess.Popen([sys.executable, "-m", "broker", "run", str(self.work / "broker.toml")],
                                     cwd=self.repo, stdout=subprocess.PIPE, stderr=open(self.work / "stderr.log", "wb"),
                                     env={**os.environ, "PYTHONPATH": str(self.repo)})
        self.url = self.plain_url = self.management_url = None
        deadline = time.monotonic() + 30
        for raw in self.proc.stdout:
            parts = raw.decode().split()
            if parts[:2] == ["listening", "amqp"]:
                self.plain_url = parts[2]
                self.url = parts[2].replace("amqp://", "amqp://bench:bench@")
            if parts[:2] == ["listening", "management"] or time.monotonic() > deadline:
                self.management_url = parts[2] if len(parts) > 2 else None
                break
        if self.url is None:
            raise SystemExit(f"lodestone broker did not start: {(self.work / 'stderr.log').read_text()}")
        self.pid = self.proc.pid

    def address(self, durable: bool) -> str:
        return "bench-d" if durable else "bench-t"

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


# -- RabbitMQ ----------------------------------------------------------------------------------

class RabbitMQ:
    """RabbitMQ (``tests/rabbitproc.py``: a scratch node on loopback) with the bench's queues."""

    name = "rabbitmq"

    def __init__(self, work: Path):
        self.node = RabbitNode(work, name="lodestone-bench").start()
        self.node.declare("bench-t", durable=False)
        self.node.declare("bench-d", durable=True)
        self.pid = self.node.pid
        self.url = self.node.client_url

    def address(self, durable: bool) -> str:
        return self.node.address("bench-d" if durable else "bench-t")

    def left(self, durable: bool) -> int:
        """Messages left in the run's queue (then purged): a run that received n messages and
        left some behind received duplicates."""
        queue = "bench-d" if durable else "bench-t"
        k = self.node.depth(queue)
        if k:
            self.node.purge(queue)
        return k

    def stop(self) -> None:
        self.node.stop()


# -- running -----------------------------------------------------------------------------------

def run_client(broker, durable: bool, size: int, n: int, extra: tuple[str, ...] = ()) -> dict:
    cmd = [sys.executable, str(CLIENT), "--url", broker.url, "--address", broker.address(durable), "--n", str(n),
           "--size", str(size), "--broker-pid", str(broker.pid)] + (["--durable"] if durable else []) + list(extra)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"client failed: {p.stderr.strip()[-300:]}"}


def run_native(binary: Path, broker, durable: bool, size: int, n: int, conns: int) -> dict:
    """One run of amqpperf: ``conns`` producers → ``conns`` consumers on the broker's queue."""
    from urllib.parse import urlsplit
    u = urlsplit(broker.url)
    n -= n % conns
    cmd = [str(binary), "-u", f"{u.hostname}:{u.port}", "-a", broker.address(durable), "-n", str(n), "-s", str(size),
           "-p", str(conns), "-r", str(conns), "-b", str(broker.pid), "-t", "300"] + (["-d"] if durable else [])
    if u.username:
        cmd += ["-U", u.username, "-P", u.password or ""]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    try:
        r = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"error": f"amqpperf failed: {p.stderr.strip()[-300:]}"}
    if p.returncode != 0:     # a failed run's figures are not figures: only why
        return {"error": f"{r.get('error') or 'failed'}: sent {r.get('sent')} accepted {r.get('accepted')} "
                         f"rejected/released {r.get('rejected')} received {r.get('received')}; "
                         f"{p.stderr.strip()[-300:]}"}
    return r


def flame(out_dir: str | None, broker, durable: bool, size: int, label: str, fmt: str = "flamegraph"):
    """With ``--flame DIR``: py-spy records a Lodestone broker through one run, into
    ``DIR/<broker>-<durable|transient>-<size><variant>.svg``."""
    if not out_dir or broker.name == "rabbitmq":
        return None
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    name = f"{broker.name.replace('@', '-')}-{'durable' if durable else 'transient'}-{size}-{label.strip().replace('→', 'to').lstrip('+')}".rstrip("-")
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    ext = {"flamegraph": "svg", "raw": "txt", "speedscope": "json"}[fmt]
    return subprocess.Popen([spy, "record", "--nonblocking", "-r", "250", "-f", fmt, "-p", str(broker.pid),
                             "-o", str(Path(out_dir) / f"{name}.{ext}")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=50000, help="messages per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="100,4096")
    ap.add_argument("--no-rabbitmq", action="store_true", help="measure Lodestone only")
    ap.add_argument("--json", action="store_true", help="also print every result as JSON lines")
    ap.add_argument("--baseline-ref", metavar="REV",
                    help="also run the broker of this git revision (a temporary worktree) in the same run: "
                         "'the same node without the feature'")
    ap.add_argument("--features", action="store_true",
                    help="also measure Lodestone's optional paths: a consumer with a selector, and transactional "
                         "sends (--tx-batch messages per transaction)")
    ap.add_argument("--tx-batch", type=int, default=100)
    ap.add_argument("--client", choices=("python", "native"), default="python",
                    help="the load generator: python-qpid-proton (amqp_client.py) or native (amqpperf.c)")
    ap.add_argument("--flame", metavar="DIR",
                    help="py-spy flame graphs of each Lodestone run of the first round into DIR (pip install "
                         "py-spy; sampling costs the broker CPU: a --flame run's figures are not for the table)")
    ap.add_argument("--flame-format", choices=("flamegraph", "raw", "speedscope"), default="flamegraph",
                    help="py-spy's output format for --flame (raw: collapsed stacks, for scripts)")
    ap.add_argument("--conns", default="1", help="with --client native: producers = consumers, a comma list")
    a = ap.parse_args()
    if a.client == "native" and a.features:
        ap.error("--features needs --client python (selectors and transactions are amqp_client.py's)")
    conns_list = [int(c) for c in a.conns.split(",")] if a.client == "native" else [1]
    sizes = [int(s) for s in a.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="lodestone-bench-"))
    brokers = []
    baseline_tree = None
    # (label, client arguments, measured on): the optional paths run on this checkout only
    variants = ([(f" {c}→{c}", (c,), "all") for c in conns_list] if a.client == "native" else [("", (), "all")])
    if a.features:
        variants += [(" +selector", ("--selector", "color = 'red'"), "lodestone"),
                     (f" +tx/{a.tx_batch}", ("--tx-batch", str(a.tx_batch)), "lodestone")]
    try:
        native = build_native(work) if a.client == "native" else None
        brokers.append(Lodestone(work))
        if a.baseline_ref:
            baseline_tree = work / "baseline-tree"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(baseline_tree), a.baseline_ref],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            brokers.append(Lodestone(work, baseline_tree, f"lodestone@{a.baseline_ref[:12]}"))
        if not a.no_rabbitmq:
            brokers.append(RabbitMQ(work))
        results: dict[tuple, list[dict]] = {}
        for rnd in range(a.rounds):
            for durable in (False, True):
                for size in sizes:
                    for label, extra, on in variants:
                        for b in brokers:
                            if on != "all" and b.name != on:
                                continue
                            spy = flame(a.flame, b, durable, size, label, a.flame_format) if rnd == 0 else None
                            r = (run_native(native, b, durable, size, a.n, extra[0]) if native is not None
                                 else run_client(b, durable, size, a.n, extra))
                            if spy is not None:
                                spy.send_signal(signal.SIGINT)     # py-spy writes its graph and ends
                                spy.wait(60)
                            left = b.left(durable) if hasattr(b, "left") else 0
                            if left:
                                r = {"error": f"{left} messages left in the queue after the run "
                                              f"({r.get('error') or 'received ' + str(r.get('received', a.n))}): "
                                              "duplicates were delivered"}
                            results.setdefault((b.name, durable, size, label), []).append(r)
                            if a.json:
                                print(json.dumps({"round": rnd, "broker": b.name, "variant": label, **r}), flush=True)
                            if r.get("error"):
                                print(f"{b.name}{label} durable={durable} size={size}: {r['error']}", file=sys.stderr)
    finally:
        for b in brokers:
            b.stop()
        if baseline_tree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline_tree)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(work, ignore_errors=True)

    def med(rs, key):
        vals = [r[key] for r in rs if key in r]
        return statistics.median(vals) if vals else float("nan")

    client_name = "native amqpperf client" if a.client == "native" else "python-qpid-proton client"
    print(f"\nproducers -> consumers, n={a.n}, median of {a.rounds} rounds ({client_name})")
    others = [b for b in brokers if b.name != "lodestone"]
    print(f"{'workload':<32}" + "".join(f"{b.name[:20] + ' msgs/s':>28}{b.name[:20] + ' µs/msg':>28}" for b in brokers)
          + "".join(f"   µs/msg ÷ {b.name[:20]:<20}" for b in others))
    base = next((b for b in brokers if b.name.startswith("lodestone@")), None)
    for durable in (False, True):
        for size in sizes:
            for label, _extra, on in variants:
                line = f"{('durable' if durable else 'non-durable') + f' {size} B' + label:<32}"
                vals = {}
                for b in brokers:
                    rs = results.get((b.name, durable, size, label))
                    if rs is None:
                        line += f"{'-':>28}{'-':>28}"
                        continue
                    vals[b.name] = (med(rs, "msgs_per_s"), med(rs, "broker_cpu_us_per_msg"))
                    line += f"{vals[b.name][0]:>28,.0f}{vals[b.name][1]:>28.1f}"
                for b in others:
                    if b.name in vals:
                        line += f"   {vals['lodestone'][1] / vals[b.name][1]:>29.2f}"
                    elif label and base is not None:
                        # an optional path against the plain workload of the baseline (the feature's cost)
                        plain = results.get((base.name, durable, size, ""))
                        line += f"   {vals['lodestone'][1] / med(plain, 'broker_cpu_us_per_msg'):>28.2f}*"
                    else:
                        line += f"   {'-':>29}"
                print(line)
    if a.features and base is not None:
        print("* an optional path on this checkout against the plain workload on the baseline: what the feature costs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
