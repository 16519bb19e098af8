"""``lodestone-router drain CONFIG TARGET``: drain (or ``--undrain``) a target of a running router.

The command reads the router's configuration for its management address and credentials, calls
``POST /api/v1/routers/<r>/targets/<t>/drain`` (or ``/undrain``) on it and prints the answer's
summary; ``--wait`` then follows the pool until nothing is left on the target (or
``--timeout-s`` passes: exit 1). Exit 2 for a bad configuration or a refused call, 1 when the
router cannot be reached. See docs/router.md, "Drain".
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

from broker.wire.io.tomlconfig import ConfigError
from router.config import load_router_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lodestone-router drain",
                                description="drain a target of a running router: new connections go elsewhere "
                                            "at once, its clients leave at the pool's drain-rate-per-s")
    p.add_argument("config", type=Path, help="the running router's config file (its management address)")
    p.add_argument("target", help="the pool target (or HA pair) to drain")
    p.add_argument("--router", help="the router whose pool holds it (needed when the config has several)")
    p.add_argument("--undrain", action="store_true", help="let the target take new connections again")
    p.add_argument("--rate-per-s", type=float, default=None, help="override the pool's drain-rate-per-s")
    p.add_argument("--grace-ms", type=int, default=None, help="override the pool's drain-grace-ms")
    p.add_argument("--user", default=None, help="management user (default: [management] user)")
    p.add_argument("--password", default=None, help="management password (default: [management] password)")
    p.add_argument("--port", type=int, default=None,
                   help="management port, when the config says 0 (the port the router printed)")
    p.add_argument("--wait", action="store_true", help="wait until no client is left on the target")
    p.add_argument("--timeout-s", type=float, default=600.0, help="with --wait: give up after this long (exit 1)")
    return p


def _call(url: str, method: str, auth: tuple[str, str] | None, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data if method == "POST" else None, method=method)
    req.add_header("Accept", "application/json")
    if data:
        req.add_header("Content-Type", "application/json")
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        req.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"{}")
        except ValueError:
            return exc.code, {"error": exc.reason}


def drain_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_router_config(args.config)
    except ConfigError as exc:
        print(f"lodestone-router: {exc}", file=sys.stderr)
        return 2
    router = args.router
    if router is None:
        if len(cfg.routers) != 1:
            print(f"lodestone-router: {args.config}: {len(cfg.routers)} routers ({', '.join(cfg.routers)}): "
                  "name one with --router", file=sys.stderr)
            return 2
        router = next(iter(cfg.routers))
    elif router not in cfg.routers:
        print(f"lodestone-router: {args.config}: no router named {router!r}", file=sys.stderr)
        return 2
    m = cfg.management
    port = args.port if args.port is not None else m.port
    if port == 0:
        print(f"lodestone-router: {args.config}: management.port is 0 (chosen at start): pass the port the "
              "router printed with --port", file=sys.stderr)
        return 2
    host = "127.0.0.1" if m.host in ("0.0.0.0", "") else "::1" if m.host == "::" else m.host
    base = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    user = args.user if args.user is not None else m.user
    password = args.password if args.password is not None else m.password
    auth = (user, password or "") if user is not None else None
    op = "undrain" if args.undrain else "drain"
    path = f"/api/v1/routers/{quote(router, safe='')}/targets/{quote(args.target, safe='')}/{op}"
    body = {}
    if args.rate_per_s is not None:
        body["rate-per-s"] = args.rate_per_s
    if args.grace_ms is not None:
        body["grace-ms"] = args.grace_ms
    try:
        status, answer = _call(base + path, "POST", auth, body or None)
    except OSError as exc:
        print(f"lodestone-router: cannot reach the router's management API at {base}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"lodestone-router: {op} refused (HTTP {status}): {answer.get('error', answer)}", file=sys.stderr)
        return 2
    if args.undrain:
        print(f"{answer['target']}: takes new connections again"
              + ("" if answer.get("was_draining") else " (it was not draining)"))
        return 0
    d = answer["drain"]
    print(f"{answer['target']}: draining: no new connections; its clients leave at {d['rate_per_s']:g}/s "
          f"after {d['grace_ms']} ms")
    if not args.wait:
        return 0
    deadline = time.monotonic() + args.timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            status, pool = _call(f"{base}/api/v1/routers/{quote(router, safe='')}/pool", "GET", auth)
        except OSError as exc:
            print(f"lodestone-router: cannot reach the router's management API at {base}: {exc}", file=sys.stderr)
            return 1
        drains = {x["target"]: x for x in pool.get("drains", [])}
        now = drains.get(answer["target"])
        if now is None:
            print(f"{answer['target']}: no longer draining (undrained meanwhile)")
            return 0
        if now["phase"] in ("drained", "proxied-only"):
            print(f"{answer['target']}: drained: {now['proxied_ended']} proxied connection(s) ended, "
                  f"{now['broker_closed']} closed on the broker"
                  + (" (the target has no management-url: clients connected to the broker itself were not "
                     "moved)" if now["phase"] == "proxied-only" else ""))
            return 0
        if now["left"] != last:
            print(f"{answer['target']}: {now['left']} left")
            last = now["left"]
        time.sleep(0.5)
    print(f"lodestone-router: {answer['target']}: still {last} left after {args.timeout_s:g}s", file=sys.stderr)
    return 1
