#!/usr/bin/env python3
"""Benchmark the router's edge against direct-to-backend, HAProxy and a naive trio proxy, in one run.

How to run (from the repo root; needs gcc, libssl-dev, haproxy; about 4 minutes with the defaults):

    .venv/bin/python loadtest/bench_proxy.py                       # everything, 2 rounds
    .venv/bin/python loadtest/bench_proxy.py --tests cps           # connection rate only (~1.5 min)
    .venv/bin/python loadtest/bench_proxy.py --tests cps --targets direct,haproxy,trio-naive,proxy,proxy-w2
    .venv/bin/python loadtest/bench_proxy.py --baseline-ref main --targets proxy,proxy-tls,redirect-tls
    options: [--rounds 2] [--secs 2.5] [--warmup 0.5] [--conc 50] [--streams 4] [--json out.json] [--no-pin]
             [--baseline-ref REV]

``--baseline-ref REV`` also runs the router of that git revision (a temporary worktree, same
config, same pinning) as the targets ``base``, ``base-tls`` and ``redirect-base-tls``, beside
``proxy``, ``proxy-tls`` and ``redirect-tls``; the table then gives this checkout's CPU per
connection / per MB against the baseline's, measured in the same run ("CPU vs base").

What runs (all on 127.0.0.1, ports from the OS):

* ``amqpload`` (loadtest/amqpload.c, compiled here with gcc): an epoll load generator and a
  backend that speak just enough AMQP 1.0 (SASL PLAIN + header + Open) to pass through the
  router, then move raw bytes (echo / down / up).
* targets: ``direct`` (client → backend), ``haproxy`` (mode tcp; ``-tls``: TLS-terminating,
  nbthread 1), ``trio-naive`` (loadtest/naive_trio_proxy.py: a plain trio byte proxy, the
  "Python baseline"; ``-tls``: TLS-terminating), ``proxy`` (Lodestone proxy acceptor, 1 worker;
  ``-tls``: TLS-terminating, ``-nosplice``: the stream pump instead of splice), ``proxy-w2``
  (``workers = 2``, allowed on both cores), ``redirect-tls`` (Lodestone redirect acceptor:
  TLS + SASL + Open + redirect; the client stops at the router's Close).
  The router does more per connection than the byte proxies: SASL exchange + authentication,
  routing decision, upstream connect + SASL replay, two routing-log lines.
* tests: ``cps`` = new connections/s (connect, [TLS], AMQP handshake, 64-byte echo, close; for
  redirect: connect, TLS, handshake, read the redirect, close), ``bulk-D``/``bulk-U`` = MB/s
  backend→client / client→backend over ``--streams`` connections.

TLS parity (checked with ``openssl s_client -msg``): every TLS target serves the same trustme
ECDSA P-256 certificate and negotiates TLS 1.3, X25519, TLS_AES_256_GCM_SHA384; amqpload never
resumes (``SSL_OP_NO_TICKET``, no session cache), so every connection is a full handshake
everywhere. HAProxy 2.6 and the naive proxy send OpenSSL's default two session tickets per
handshake, the router one (``broker.wire.io.tls.server_context``).

CPU pinning (2 cores): load generator + backend on CPU0, the proxy under test on CPU1 (the
``-w2`` variant may use both, so it competes with the load generator: read its conn/s as what
two workers add, its CPU per connection as the cost). The proxy's CPU time during each run comes
from /proc (process + children), giving CPU µs per connection and ms per MB — the fair
comparison, because TLS connection rates are capped by the load generator's own full
handshakes. Medians over rounds, targets interleaved per round to spread noise. The table
prints ratios against direct, HAProxy and the naive trio proxy measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trustme

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from broker.wire.codec import Symbol  # noqa: E402 - after the path: run as a script
from broker.wire.frames import (AMQP_HEADER, FRAME_AMQP, FRAME_SASL, SASL_HEADER, Open, SaslInit,  # noqa: E402
                                SaslMechanisms, SaslOutcome, encode_frame)
from tests.brokerproc import write_users_file  # noqa: E402

ALL_TARGETS = ["direct", "haproxy", "trio-naive", "proxy", "proxy-nosplice", "proxy-w2",
               "direct-tls", "haproxy-tls", "trio-naive-tls", "proxy-tls", "proxy-w2-tls", "redirect-tls"]
ALL_TESTS = ["cps", "bulk-D", "bulk-U"]
#: with --baseline-ref: the baseline router's target beside each of this checkout's
BASELINE_OF = {"proxy": "base", "proxy-tls": "base-tls", "redirect-tls": "redirect-base-tls"}


def frames_env() -> dict[str, str]:
    """The handshake bytes amqpload sends and expects, encoded with Lodestone's codec."""

    hello = (SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", b"\0bench\0bench-pw", None))
             + AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open(container_id="bench-client")))
    return {
        "AMQPLOAD_CLIENT_HELLO": hello.hex(),
        "AMQPLOAD_SRV_SASL": (SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslMechanisms((Symbol("PLAIN"),)))).hex(),
        "AMQPLOAD_SRV_OUTCOME": encode_frame(FRAME_SASL, 0, SaslOutcome(SaslOutcome.OK)).hex(),
        "AMQPLOAD_SRV_OPEN": (AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open(container_id="bench-backend"))).hex(),
    }


def family(pid: int) -> list[int]:
    """A process and its live children (a router's workers)."""
    pids = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                pids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return pids


def cpu_seconds(pid: int) -> float:
    """utime+stime of a process and its live children (workers)."""
    total = 0
    for p in family(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total / os.sysconf("SC_CLK_TCK")


def raise_nofile() -> None:
    try:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass


class Bench:
    def __init__(self, args):
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="lodestone-bench-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.env = {**os.environ, **frames_env()}
        self.pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2 and not args.no_pin

    def cpus(self, which: str) -> list[str]:
        if not self.pin:
            return []
        return ["taskset", "-c", which]

    # -- setup ---------------------------------------------------------------------------------
    def build(self) -> None:
        self.bin = self.work / "amqpload"
        subprocess.run(["gcc", "-O2", "-o", str(self.bin), str(HERE / "amqpload.c"), "-lssl", "-lcrypto"], check=True)

        ca = trustme.CA()  # ECDSA P-256 keys
        cert = ca.issue_cert("localhost", "127.0.0.1")
        self.pem = self.work / "server.pem"
        cert.private_key_and_cert_chain_pem.write_to_path(str(self.pem))

        self.users = write_users_file(self.work / "users.toml", {"bench": ("bench-pw", ["app"])})

    def start_backend(self, name: str, tls: bool) -> int:
        cmd = self.cpus("0") + [str(self.bin), "server", "-p", "0"]
        if tls:
            cmd += ["-c", str(self.pem), "-k", str(self.pem)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=self.env, preexec_fn=raise_nofile)
        self.procs[name] = p
        line = p.stdout.readline().decode().split()
        return int(line[1])

    def start_haproxy(self, backend_port: int, maxconn: int = 9000) -> None:
        cfg = self.work / "haproxy.cfg"
        self.ports["haproxy"], self.ports["haproxy-tls"] = free_port(), free_port()
        cfg.write_text(f"""global
    nbthread 1
    maxconn {maxconn}
defaults
    mode tcp
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend plain
    bind 127.0.0.1:{self.ports['haproxy']}
    default_backend be
frontend tls
    bind 127.0.0.1:{self.ports['haproxy-tls']} ssl crt {self.pem}
    default_backend be
backend be
    server s1 127.0.0.1:{backend_port}
""")
        self.procs["haproxy"] = subprocess.Popen(self.cpus("1") + ["haproxy", "-db", "-f", str(cfg)],
                                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                                 preexec_fn=raise_nofile)
        wait_port(self.ports["haproxy"])

    def start_naive(self, backend_port: int) -> None:
        p = subprocess.Popen(self.cpus("1") + [sys.executable, str(HERE / "naive_trio_proxy.py"),
                                               f"127.0.0.1:{backend_port}", str(self.pem)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, preexec_fn=raise_nofile)
        self.procs["trio-naive"] = p
        for _ in range(2):
            _, kind, port = p.stdout.readline().decode().split()
            self.ports["trio-naive" if kind == "plain" else "trio-naive-tls"] = int(port)

    def start_router(self, name: str, backend_port: int, *, workers: int, splice: bool, cpus: str,
                     repo: Path = REPO, plain_extra: tuple[str, ...] = ()) -> None:
        """``plain_extra``: more keys for the plain proxy acceptor (bench_held.py)."""
        cfg = self.work / f"{name}.toml"
        cfg.write_text("\n".join([
            f'users-file = "{self.users}"', f"workers = {workers}",
            "[management]", "port = 0",
            "[routing-log]", f'path = "{self.work / name / "routing.log"}"',
            "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "CONSISTENT_HASH"',
            "[routers.main.pool]", "check-period = 5000",
            "[[routers.main.pool.targets]]", 'name = "backend"', 'host = "127.0.0.1"', f"port = {backend_port}",
            "[[acceptors]]", 'name = "plain"', "port = 0", 'router = "main"', 'mode = "proxy"',
            "max-connections = 0", *plain_extra,
            "[[acceptors]]", 'name = "tls"', "port = 0", 'router = "main"', 'mode = "proxy"',
            f'tls-cert = "{self.pem}"', f'tls-key = "{self.pem}"', "max-connections = 0",
            "[[acceptors]]", 'name = "redirect"', "port = 0", 'router = "main"', 'mode = "redirect"',
            f'tls-cert = "{self.pem}"', f'tls-key = "{self.pem}"', "max-connections = 0",
        ]) + "\n")
        env = {**os.environ, "LODESTONE_SPLICE": "1" if splice else "0"}
        p = subprocess.Popen(self.cpus(cpus) + [sys.executable, "-m", "router", "run", str(cfg),
                                                "--log-level", "WARNING", "--drain-timeout-s", "1"],
                             cwd=repo, stdout=subprocess.PIPE, stderr=open(self.work / f"{name}.err", "wb"),
                             env=env, preexec_fn=raise_nofile)
        self.procs[name] = p
        urls = {}
        while len(urls) < 4:
            line = p.stdout.readline().decode().split()
            if not line:
                raise RuntimeError(f"router {name} did not start: {(self.work / f'{name}.err').read_text()}")
            if line[0] == "listening":
                urls[line[1]] = int(line[2].rsplit(":", 1)[1])
        self.ports[name] = urls["plain"]
        self.ports[name + "-tls"] = urls["tls"]
        if name in ("proxy", "base"):
            self.ports["redirect-tls" if name == "proxy" else "redirect-base-tls"] = urls["redirect"]
        time.sleep(0.5)  # first probe round

    def setup(self, targets: list[str]) -> None:
        self.build()
        be = self.start_backend("backend", tls=False)
        self.ports["direct"] = be
        self.ports["direct-tls"] = self.start_backend("backend-tls", tls=True)
        if any(t.startswith("haproxy") for t in targets):
            self.start_haproxy(be)
        if any(t.startswith("trio-naive") for t in targets):
            self.start_naive(be)
        if any(t in targets for t in ("proxy", "proxy-tls", "redirect-tls")):
            self.start_router("proxy", be, workers=1, splice=True, cpus="1")
        if "proxy-nosplice" in targets:
            self.start_router("proxy-nosplice", be, workers=1, splice=False, cpus="1")
        if any(t.startswith("proxy-w2") for t in targets):
            self.start_router("proxy-w2", be, workers=2, splice=True, cpus="0,1")
        if self.args.baseline_ref:
            self.baseline_tree = self.work / "baseline"
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(self.baseline_tree),
                            self.args.baseline_ref], check=True, capture_output=True)
            self.start_router("base", be, workers=1, splice=True, cpus="1", repo=self.baseline_tree)

    def owner(self, target: str) -> str | None:
        """Which process is 'the proxy' for a target (None for direct)."""
        if target.startswith("direct"):
            return None
        if target.startswith("haproxy"):
            return "haproxy"
        if target.startswith("trio-naive"):
            return "trio-naive"
        if target == "redirect-tls":
            return "proxy"
        if target == "redirect-base-tls":
            return "base"
        return target.removesuffix("-tls")

    # -- running -------------------------------------------------------------------------------
    def run_one(self, target: str, test: str) -> dict:
        a = self.args
        tls = target.endswith("-tls")
        cmd = self.cpus("0") + [str(self.bin)]
        if test == "cps":
            cmd += ["cps", "-n", str(a.conc)]
        else:
            cmd += ["bulk", "-n", str(a.streams), "-m", test.split("-")[1]]
        cmd += ["-t", f"127.0.0.1:{self.ports[target]}", "-d", str(a.secs), "-w", str(a.warmup)]
        if tls:
            cmd.append("-s")
        if target.startswith("redirect"):
            cmd.append("-r")
        owner = self.owner(target)
        pid = self.procs[owner].pid if owner else None
        spy = self.flame(target, test, owner, pid)
        c0, t0 = (cpu_seconds(pid) if pid else 0.0), time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=a.secs + a.warmup + 60)
        c1, t1 = (cpu_seconds(pid) if pid else 0.0), time.monotonic()
        if spy is not None:
            spy.wait(60)
        res = json.loads(out.stdout.strip().splitlines()[-1])
        res["proxy_cpu_util"] = (c1 - c0) / (t1 - t0) if pid else None
        return res

    def flame(self, target: str, test: str, owner: str | None, pid: int | None):
        """With ``--flame DIR``: py-spy records a Lodestone router (workers included) for the
        run's measured seconds into ``DIR/<target>-<test>.svg`` (once per target and test)."""
        a = self.args
        if not a.flame or pid is None or owner in ("haproxy", "trio-naive"):
            return None
        out = Path(a.flame) / f"{target}-{test}.svg"
        if out.exists():
            return None
        out.parent.mkdir(parents=True, exist_ok=True)
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        return subprocess.Popen([spy, "record", "--nonblocking", "--subprocesses", "-r", "250", "-d",
                                 str(max(1, round(a.secs + a.warmup))), "-p", str(pid), "-o", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if getattr(self, "baseline_tree", None) is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(self.baseline_tree)],
                           capture_output=True)
        shutil.rmtree(self.work, ignore_errors=True)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 10.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} did not open")


def applicable(target: str, test: str) -> bool:
    return not (target.startswith("redirect") and test != "cps")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--secs", type=float, default=2.5)
    ap.add_argument("--warmup", type=float, default=0.5)
    ap.add_argument("--conc", type=int, default=50)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--targets", default=",".join(ALL_TARGETS))
    ap.add_argument("--tests", default=",".join(ALL_TESTS))
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--baseline-ref", metavar="REV",
                    help="also run the router of this git revision (a temporary worktree) in the same run")
    ap.add_argument("--flame", metavar="DIR",
                    help="py-spy flame graphs of each Lodestone target's first run into DIR (pip install py-spy;"
                         " sampling costs the router CPU: a --flame run's figures are not for the table)")
    a = ap.parse_args()
    if a.flame and not (shutil.which("py-spy") or (Path(sys.executable).parent / "py-spy").exists()):
        ap.error("--flame needs py-spy (.venv/bin/pip install py-spy)")
    targets = a.targets.split(",")
    if a.baseline_ref:
        targets += [BASELINE_OF[t] for t in targets if t in BASELINE_OF and BASELINE_OF[t] not in targets]
    tests = a.tests.split(",")
    if shutil.which("haproxy") is None:
        targets = [t for t in targets if not t.startswith("haproxy")]
        print("haproxy not found: HAProxy baselines skipped (Debian package 'haproxy')", file=sys.stderr)
    bench = Bench(a)
    started = time.monotonic()
    results: dict[tuple[str, str], list[dict]] = {}
    try:
        bench.setup(targets)
        for r in range(a.rounds):
            for t in targets:
                for test in tests:
                    if not applicable(t, test):
                        continue
                    res = bench.run_one(t, test)
                    results.setdefault((t, test), []).append(res)
                    val = res.get("MBps", res.get("cps"))
                    util = res["proxy_cpu_util"]
                    print(f"round {r + 1} {t:15s} {test:7s} {val:>9} err={res['errors']}"
                          f" proxy-cpu={'-' if util is None else f'{util:.2f}'}", flush=True)
    finally:
        bench.stop()

    summary: dict[tuple[str, str], dict] = {}
    for (t, test), runs in results.items():
        key = "cps" if test == "cps" else "MBps"
        med = statistics.median(x[key] for x in runs)
        utils = [x["proxy_cpu_util"] for x in runs if x["proxy_cpu_util"] is not None]
        util = statistics.median(utils) if utils else None
        s = {"median": med, "unit": "conn/s" if key == "cps" else "MB/s", "errors": sum(x["errors"] for x in runs),
             "cpu_util": util}
        if util and med:
            s["cpu_per"] = util / med * (1e6 if key == "cps" else 1e3)  # µs per conn / ms per MB
        summary[(t, test)] = s

    print(f"\n{'target':15s} {'test':7s} {'median':>10s} {'unit':7s} {'proxy CPU':>14s} {'vs direct':>9s} "
          f"{'vs HAProxy':>10s} {'CPU vs HAProxy':>14s} {'CPU vs naive':>12s}"
          + (f" {'CPU vs base':>11s}" if a.baseline_ref else ""))
    for t in targets:
        for test in tests:
            s = summary.get((t, test))
            if s is None:
                continue
            tls = t.endswith("-tls")
            direct = summary.get(("direct-tls" if tls else "direct", test))
            hap = summary.get(("haproxy-tls" if tls else "haproxy", test))
            naive = summary.get(("trio-naive-tls" if tls else "trio-naive", test))
            cpu = ""
            if "cpu_per" in s:
                cpu = f"{s['cpu_per']:.0f} µs/conn" if test == "cps" else f"{s['cpu_per']:.2f} ms/MB"
            vs_direct = f"{s['median'] / direct['median']:.2f}" if direct and direct["median"] else ""
            vs_hap = f"{s['median'] / hap['median']:.2f}" if hap and hap["median"] and hap is not s else ""
            cpu_ratio = cpu_naive = ""
            if hap and "cpu_per" in s and "cpu_per" in hap and hap is not s:
                cpu_ratio = f"{s['cpu_per'] / hap['cpu_per']:.2f}x"
            if naive and "cpu_per" in s and "cpu_per" in naive and naive is not s:
                cpu_naive = f"{s['cpu_per'] / naive['cpu_per']:.2f}x"
            base = summary.get((BASELINE_OF.get(t, ""), test))
            cpu_base = (f"{s['cpu_per'] / base['cpu_per']:.2f}x"
                        if base and "cpu_per" in s and "cpu_per" in base else "")
            print(f"{t:15s} {test:7s} {s['median']:>10.1f} {s['unit']:7s} {cpu:>14s} {vs_direct:>9s} {vs_hap:>10s} "
                  f"{cpu_ratio:>14s} {cpu_naive:>12s}" + (f" {cpu_base:>11s}" if a.baseline_ref else "")
                  + (f"  errors={s['errors']}" if s["errors"] else ""))
    print("\nproxy CPU = the proxy process's CPU time per connection (cps) or per MB (bulk); the fair\n"
          "comparison for TLS, where the load generator's handshakes cap the rate. redirect-tls is compared\n"
          "with haproxy-tls / trio-naive-tls (all: TLS handshake per connection; the redirect never touches\n"
          "a backend). proxy-w2 runs on both cores, sharing CPU0 with the load generator and backend.\n"
          f"elapsed {time.monotonic() - started:.0f} s")
    if a.json:
        Path(a.json).write_text(json.dumps({f"{t}|{test}": s for (t, test), s in summary.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
