"""The data-gravity loop, end to end on the local deployment (docs/gravity.md, "The loop").

    bash etc/run-local.sh &                                  # or let --start run it
    .venv/bin/python loadtest/gravity_loop.py [--etc etc] [--start] [--scale 1.0] [--max-skew 0.10]
        [--out var/gravity-loop]

1. runs the fixed workload (loadtest/gravity_workload.py) through the router's front door, with
   no pins (the pins file is emptied first): the router's own placement;
2. waits until the brokers have written that phase's activity (one ``flush-interval-s``) and runs
   ``lodestone-gravity`` on the routing log and the brokers' activity logs of that phase only
   (``--since``/``--until``);
3. copies its ``pins.jsonl`` to the router's pins file and waits until the router re-read it
   (``pins_reloads`` in its counters; it checks every check-period);
4. runs the same workload again, then the job on the second phase's logs;
5. prints cross-broker bytes and skew (connections, bytes) before and after, as measured from
   the logs, beside what the model predicted; writes everything to ``OUT/loop.json``.

Paths, ports and credentials come from ``--etc`` (router.toml, broker-*.toml, the files the local
deployment runs on). ``--start`` starts ``lodestone-local --etc ETC`` itself and stops it at the end.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.gravity_workload import WORKLOAD, run_workload, scaled  # noqa: E402
from router.config import load_router_config


@dataclass
class Deployment:
    front_door: str
    management: str
    auth: tuple[str, str] | None
    router: str
    routing_dir: Path
    pins: Path
    check_period_s: float
    brokers: list[tuple[str, Path, Path, float]]   # name, data dir, activity log, flush interval
    serving: int = 0       # node ids the router should see ready: the brokers that are not HA backups
    backups: frozenset = frozenset()   # names of HA backups: they serve their primary's node id, if ever


def read_deployment(etc: Path) -> Deployment:

    cfg = load_router_config(etc / "router.toml")
    acc = next((a for a in cfg.acceptors if a.name == "auto"), cfg.acceptors[0])
    name = next(iter(cfg.routers))
    rc = cfg.routers[name]
    if rc.pins is None or cfg.routing_log.path is None:
        raise SystemExit(f"{etc / 'router.toml'}: the loop needs [routing-log] path and [routers.{name}.pins] file")
    m = cfg.management
    brokers = []
    serving = 0
    backups = set()
    for f in sorted(etc.glob("broker-*.toml")):
        t = tomllib.loads(f.read_text())
        if t.get("ha", {}).get("role") != "backup":   # a backup serves its primary's node id, if ever
            serving += 1
        else:
            backups.add(t["node"]["name"])
        data = (f.parent / t["node"]["data-dir"]).resolve()
        act = t.get("activity-log", {})
        path = (f.parent / act["path"]).resolve() if "path" in act else data / "activity.jsonl"
        brokers.append((t["node"]["name"], data, path, float(act.get("flush-interval-s", 10.0))))
    return Deployment(f"amqp://{acc.host}:{acc.port}", f"http://{m.host}:{m.port}",
                      (m.user, m.password) if m.user else ("admin", "admin"), name,
                      Path(cfg.routing_log.path).resolve().parent, Path(rc.pins.file).resolve(),
                      rc.pool.check_period_ms / 1000 if rc.pool else 5.0, brokers, serving, frozenset(backups))


def _get(dep: Deployment, path: str):
    req = urllib.request.Request(dep.management + path)
    if dep.auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(dep.auth).encode()).decode())
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def wait_ready(dep: Deployment, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            pool = _get(dep, f"/api/v1/routers/{dep.router}/pool")
            if pool["ready"] >= dep.serving:
                return
            last = f"{pool['ready']} of {dep.serving} brokers ready"
        except OSError as exc:
            last = exc
        time.sleep(0.5)
    raise SystemExit(f"the local deployment is not ready at {dep.management} ({last}); start it with "
                     f"`bash etc/run-local.sh` or pass --start")


def pins_reloads(dep: Deployment) -> int:
    return _get(dep, "/api/v1/counters")["routers"][dep.router]["pins_reloads"]


def set_pins(dep: Deployment, text: str, timeout_s: float = 30) -> float:
    """Replace the router's pins file; seconds until the router re-read it."""
    before = pins_reloads(dep)
    t = time.monotonic()
    dep.pins.parent.mkdir(parents=True, exist_ok=True)
    tmp = dep.pins.with_name(dep.pins.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, dep.pins)
    while pins_reloads(dep) <= before:
        if time.monotonic() - t > timeout_s:
            raise SystemExit(f"the router did not re-read {dep.pins} within {timeout_s:.0f} s")
        time.sleep(0.1)
    return time.monotonic() - t


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def run_job(dep: Deployment, since: float, until: float, out: Path, max_skew: float, node_ids: list[str]) -> dict:
    argv = [sys.executable, "-m", "spark.jobs.gravity", str(dep.routing_dir),
            *[str(b[2]) for b in dep.brokers if b[2].exists()], "--out", str(out), "--max-skew", str(max_skew),
            "--since", _iso(since), "--until", _iso(until), *[f"--broker={n}" for n in node_ids]]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"lodestone-gravity failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def phase(dep: Deployment, label: str, scale: float) -> tuple[float, float, dict]:
    """Run the workload once; (start, end after the brokers flushed, workload figures)."""
    t0 = time.time()
    w = run_workload(dep.front_door, scale=scale)
    print(f"{label}: {w['keys']} keys, {w['messages']:,} messages, {w['body_bytes']:,} body bytes "
          f"in {w['seconds']:.1f} s", flush=True)
    flush = max(b[3] for b in dep.brokers) + 1.5   # the last activity windows and the routing log are written
    time.sleep(flush)
    return t0, time.time(), w


def _pct(before: float, after: float) -> str:
    return f"{(after - before) / before * 100:+.1f} %" if before else "n/a"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="workload → job → pins → workload, before and after")
    ap.add_argument("--etc", default=str(REPO / "etc"), help="the local deployment's config folder")
    ap.add_argument("--start", action="store_true", help="start lodestone-local --etc ETC (and stop it after)")
    ap.add_argument("--scale", type=float, default=1.0, help="scale the workload's message counts")
    ap.add_argument("--max-skew", type=float, default=0.10)
    ap.add_argument("--out", default=str(REPO / "var" / "gravity-loop"))
    a = ap.parse_args(argv)
    etc, out = Path(a.etc).resolve(), Path(a.out).resolve()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop what we started
    dep = read_deployment(etc)
    local = None
    if a.start:
        logs = out / "local-logs"
        logs.mkdir(parents=True, exist_ok=True)
        local = subprocess.Popen([sys.executable, "-m", "router.local", "--etc", str(etc), "--logs", str(logs)],
                                 stdout=(out / "local.out").open("w"), stderr=subprocess.STDOUT,
                                 start_new_session=True, cwd=str(REPO))
    try:
        wait_ready(dep)
        # the brokers to place keys on: not an HA backup (its own node id, before its first sync, is
        # no target the router knows; once it serves, it serves its primary's id)
        node_ids = [(b[1] / "node.id").read_text().strip() for b in dep.brokers
                    if (b[1] / "node.id").exists() and b[0] not in dep.backups]
        if out.exists():
            for d in ("before", "after"):
                shutil.rmtree(out / d, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        groups = scaled(WORKLOAD, a.scale)
        print(f"gravity loop: {sum(len(g.keys()) for g in groups)} keys in {len(groups)} groups through "
              f"{dep.front_door}; brokers {', '.join(b[0] for b in dep.brokers)}; bound {a.max_skew:g}", flush=True)
        set_pins(dep, "")                                     # phase 1: the router's own placement
        t0, t1, w1 = phase(dep, "phase 1 (no pins)", a.scale)
        t = time.monotonic()
        before = run_job(dep, t0, t1, out / "before", a.max_skew, node_ids)
        print(f"job on phase 1: {before['lines_read']:,} lines in {time.monotonic() - t:.1f} s; "
              f"{before['keys_moved']} of {before['keys']} keys to move", flush=True)
        took = set_pins(dep, (out / "before" / "pins.jsonl").read_text())
        print(f"pins loaded: the router re-read {dep.pins} after {took:.1f} s", flush=True)
        t2, t3, w2 = phase(dep, "phase 2 (pinned)", a.scale)
        after = run_job(dep, t2, t3, out / "after", a.max_skew, node_ids)
        result = {
            "workload": {"phase1": w1, "phase2": w2, "scale": a.scale},
            "max_skew": a.max_skew,
            "before": {"cross_broker_bytes": before["cross_broker_bytes"], "skew": before["skew"],
                       "modelled_cross_broker_bytes": before["modelled_cross_broker_bytes"]},
            "predicted": {"cross_broker_bytes": before["recommended_cross_broker_bytes"],
                          "skew": before["recommended_skew"], "within_bound": before["recommended_within_bound"]},
            "after": {"cross_broker_bytes": after["cross_broker_bytes"], "skew": after["skew"],
                      "modelled_cross_broker_bytes": after["modelled_cross_broker_bytes"]},
            "keys_moved": before["keys_moved"], "keys": before["keys"],
        }
        b, f = before["cross_broker_bytes"], after["cross_broker_bytes"]
        result["reduction"] = round(1 - f / b, 4) if b else None
        worst = max(after["skew"].values())
        result["goal_met"] = bool(b and f <= 0.5 * b and worst <= a.max_skew + 1e-9)
        (out / "loop.json").write_text(json.dumps(result, indent=2) + "\n")
        p = result["predicted"]
        print()
        print(f"{'':24}{'before':>14}{'after':>14}{'change':>10}   predicted after")
        print(f"{'cross-broker bytes':24}{b:>14,}{f:>14,}{_pct(b, f):>10}   {p['cross_broker_bytes']:,.0f}")
        for what in ("connections", "bytes"):
            print(f"{'skew ' + what:24}{before['skew'][what]:>14.3f}{after['skew'][what]:>14.3f}{'':>10}   "
                  f"{p['skew'][what]:.3f}")
        print(f"\ngoal (>= 50 % fewer cross-broker bytes at <= {a.max_skew:.0%} skew): "
              f"{'met' if result['goal_met'] else 'NOT met'}; details in {out / 'loop.json'}")
        return 0
    finally:
        if local is not None and local.poll() is None:
            os.killpg(local.pid, signal.SIGTERM)
            try:
                local.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(local.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
