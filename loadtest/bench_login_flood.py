"""A wrong-password login flood against a broker node and the router, with a good client's
latency measured before and during the flood in the same run.

For each target (``broker``: a node's own acceptor; ``router``: the router's proxy acceptor in
front of a node) the benchmark:

1. measures the good client (python-qpid-proton ``BlockingConnection`` from 127.0.0.1, its own
   CA-store load taken out of the picture) — connect + send one message with a login the
   process has verified before (``seen``) and with a first login (``first``); for the broker
   also the durable-send acknowledgement time (``durable``);
2. starts ``login_flood.py`` (its own process) from ``--sources`` loopback addresses,
   ``--concurrency`` connections per address, fresh wrong passwords (20 % unknown users);
3. measures the good client again during the flood, then reads the flood's result and the
   target's login counters.

It prints, per target: attempts per second the target absorbed (answered), hashes it actually
ran, its CPU during the flood, and the good client's medians with the ratio during/baseline.
The users file keeps the production scrypt cost (n = 16384).

    .venv/bin/python loadtest/bench_login_flood.py [--seconds 20] [--sources 10] [--concurrency 30]
        [--targets broker,router] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from proton import Message  # noqa: E402
from proton.utils import BlockingConnection  # noqa: E402

from broker.wire.io.users import hash_password  # noqa: E402
from tests.brokerproc import start_broker, wait_for  # noqa: E402
from tests.routerproc import start_router, toml_str  # noqa: E402
from tests.serverproc import http_json  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
FRESH = 40


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def write_users(path: Path) -> Path:
    lines = []
    entries = {"app": ("app-pw", ["app"]), "admin": ("admin-pw", ["admin"]),
               **{f"fresh{i}": (f"fresh-pw-{i}", ["app"]) for i in range(FRESH)}}
    for name, (password, roles) in entries.items():
        lines += [f"[users.{name}]", f"password = {json.dumps(hash_password(password))}",
                  f"roles = {json.dumps(roles)}", ""]
    lines += ["[[permissions]]", 'match = "#"', 'send = ["admin", "app"]', 'consume = ["admin", "app"]',
              'create-address = ["admin", "app"]', 'manage = ["admin"]', ""]
    path.write_text("\n".join(lines))
    return path


class Good:
    """The good client."""

    def __init__(self):
        self.fresh = 0

    def connect_send(self, url: str, user: str = "app", password: str = "app-pw") -> float:
        t0 = time.perf_counter()
        c = BlockingConnection(url, timeout=60, user=user, password=password, allowed_mechs="PLAIN")
        try:
            c.create_sender("bench.good").send(Message(body="x"))
        finally:
            c.close()
        return time.perf_counter() - t0

    def first(self, url: str) -> float:
        i = self.fresh
        self.fresh += 1
        return self.connect_send(url, f"fresh{i}", f"fresh-pw-{i}")

    def durable(self, url: str, n: int = 50) -> float:
        c = BlockingConnection(url, timeout=60, user="app", password="app-pw", allowed_mechs="PLAIN")
        try:
            s = c.create_sender("bench.durable")
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                s.send(Message(body=f"m{i}", durable=True))
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        finally:
            c.close()

    def measure(self, url: str, durable: bool) -> dict:
        self.connect_send(url)
        out = {"seen": statistics.median(self.connect_send(url) for _ in range(15)),
               "first": statistics.median(self.first(url) for _ in range(6))}
        if durable:
            out["durable"] = self.durable(url)
        return out


def logins(url: str, metric: str, auth) -> dict[str, float]:
    status, text = http_json(url + "/metrics", auth=auth, timeout_s=30)
    out = {}
    for line in (text if isinstance(text, str) else "").splitlines():
        if line.startswith(metric + "{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def bench(target: str, work: Path, users: Path, args) -> dict:
    broker = start_broker(work / target, users_file=users)
    router = None
    try:
        url, port, pid = broker.amqp_url, broker.port, broker.pid
        metrics_url, metric, auth = broker.management_url, "lodestone_broker_logins_total", ("admin", "admin-pw")
        if target == "router":
            text = "\n".join([
                f"users-file = {toml_str(users)}", "[management]", "port = 0", 'user = "admin"',
                'password = "admin"', "[routing-log]", "enabled = false",
                "[[acceptors]]", 'name = "proxy"', "port = 0", 'router = "main"', 'mode = "proxy"',
                "idle-timeout-s = 60", "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]",
                'name = "FIRST_ELEMENT"', "[routers.main.pool]", "check-period = 500", 'username = "admin"',
                'password = "admin-pw"', "[[routers.main.pool.targets]]", 'name = "b1"', 'host = "127.0.0.1"',
                f"port = {broker.port}", f"management-url = {toml_str(broker.management_url)}", ""])
            router = start_router(work / target / "router", text, expect=2, auth=("admin", "admin"))
            wait_for(lambda: router.get("/api/v1/routers/main/pool")[1]["ready"] == 1, timeout_s=30)
            url, port, pid = router.url("proxy"), router.port("proxy"), router.pid
            metrics_url, metric, auth = router.management_url, "lodestone_router_logins_total", ("admin", "admin")
        good = Good()
        baseline = good.measure(url, durable=target == "broker")
        sources = ",".join(f"127.0.0.{2 + i}" for i in range(args.sources))
        before = logins(metrics_url, metric, auth)
        c0, t0 = cpu_s(pid), time.perf_counter()
        flood = subprocess.Popen([sys.executable, str(REPO / "loadtest" / "login_flood.py"), "--port", str(port),
                                  "--sources", sources, "--concurrency", str(args.concurrency),
                                  "--duration-s", str(args.seconds), "--user", "app", "--unknown-share", "0.2"],
                                 stdout=subprocess.PIPE, text=True)
        time.sleep(min(3.0, args.seconds / 4))
        during = good.measure(url, durable=target == "broker")
        out, _ = flood.communicate(timeout=args.seconds + 120)
        cpu = (cpu_s(pid) - c0) / (time.perf_counter() - t0)
        result = json.loads(out.strip().splitlines()[-1])
        after = logins(metrics_url, metric, auth)
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        return {"target": target, "flood": result, "logins": delta, "cpu_share": round(cpu, 3),
                "baseline_ms": {k: round(v * 1000, 2) for k, v in baseline.items()},
                "during_ms": {k: round(v * 1000, 2) for k, v in during.items()},
                "ratio": {k: round(during[k] / baseline[k], 2) for k in baseline}}
    finally:
        if router is not None:
            router.terminate()
        broker.terminate()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--sources", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=30, help="connections per source address")
    ap.add_argument("--targets", default="broker,router")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    # the good client's own CA-store load (~100 ms CPU per proton Container) is not what we measure
    empty = tempfile.mkdtemp(prefix="lodestone-noca-")
    os.environ["SSL_CERT_FILE"] = os.path.join(empty, "none.pem")
    os.environ["SSL_CERT_DIR"] = empty
    results = []
    with tempfile.TemporaryDirectory(prefix="lodestone-bench-login-") as tmp:
        work = Path(tmp)
        users = write_users(work / "users.toml")
        for target in [t.strip() for t in args.targets.split(",") if t.strip()]:
            r = bench(target, work, users, args)
            results.append(r)
            f = r["flood"]
            lg = r["logins"]
            print(f"\n== {target}: {args.sources} sources x {args.concurrency} connections, {f['elapsed_s']} s")
            print(f"  flood attempts answered: {f['attempts']} ({f['attempts_per_s']}/s), outcomes {f['outcomes']}, "
                  f"answer p50 {f['answer_ms_p50']} ms")
            print(f"  target: {int(lg.get('login_failed', 0))} refusals, {int(lg.get('login_verifications', 0))} "
                  f"password hashes run, {int(lg.get('login_refused_throttled', 0))} refused without a hash "
                  f"(throttled), {int(lg.get('login_refused_overloaded', 0))} overloaded; "
                  f"CPU {r['cpu_share'] * 100:.0f}% of a core")
            for k in r["baseline_ms"]:
                print(f"  good client {k:8s} baseline {r['baseline_ms'][k]:8.2f} ms   during {r['during_ms'][k]:8.2f} ms"
                      f"   ratio {r['ratio'][k]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
