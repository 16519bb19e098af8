"""`lodestone-router dry-run`: which keys would move if a router's pool changed.

    lodestone-router dry-run etc/router.toml --routing-log var/router/routing.log \
        --router-url http://admin:admin@127.0.0.1:8160 --add broker-4=127.0.0.1:15675 --remove <node id>

Keys come from a key list (one per line) or from routing logs (their ``key_filtered``). The
pool before the change is the router's configured targets; for a pool whose members come from
the cluster (``source = "cluster"`` or ``"discovery"``, as in etc/router.toml) it is the running
router's pool (``--router-url``) or the members given with ``--target NAME=HOST:PORT``. Hash policies hash each target's
node id, which a broker makes at its first start (``<data-dir>/node.id``) and the router learns
from its health probes. ``--router-url`` reads them from the running router's management API
(``GET /api/v1/routers/<r>/pool``; credentials in the URL or ``--user``/``--password``);
``--node-id NAME=ID`` gives one by hand (it wins over the router's). A target still without a
node id — typically one named by ``--add`` that has never run — is hashed by its *name* as a
stand-in: deterministic, so the same command gives the same answer, and the moved *fraction*
is representative, but the exact keys depend on the broker's real node id (pass it with
``--node-id`` once the broker has started, or create its ``node.id`` file with the id you pass).
Output names targets by their config names. Piped into ``head``, the command stops quietly
with status 0 when the reader goes away.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from broker.wire.io.tomlconfig import ConfigError

from .config import load_router_config
from .core.dryrun import change_pool, dry_run, keys_from_key_list, keys_from_routing_log
from .policies import Target


def _pair(text: str, what: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"{what} must look like NAME=VALUE, got {text!r}")
    return name, value


class _Fail(Exception):
    """A one-line error for stderr; exit status 2."""


def _hostport(what: str, text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise _Fail(f"{what}: expected HOST:PORT")
    return host, int(port)


def _live_pool(url: str, router: str, user: str | None, password: str | None) -> list[dict]:
    """The running router's pool view (``GET /api/v1/routers/<r>/pool``): its ``targets``."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _Fail(f"--router-url {url!r}: expected http(s)://[user:password@]host:port")
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        password = urllib.parse.unquote(parts.password or "")
    netloc = parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
    if ":" in parts.hostname:
        netloc = f"[{parts.hostname}]" + (f":{parts.port}" if parts.port else "")
    base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
    api = f"{base}/api/v1/routers/{urllib.parse.quote(router, safe='')}/pool"
    req = urllib.request.Request(api)
    if user is not None:
        token = base64.b64encode(f"{user}:{password or ''}".encode()).decode()
        req.add_header("Authorization", "Basic " + token)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        hint = " (give credentials: --user/--password or http://user:password@host:port)" \
            if exc.code == 401 else ""
        raise _Fail(f"--router-url: GET {api}: HTTP {exc.code}{hint}") from None
    except (OSError, ValueError) as exc:
        raise _Fail(f"--router-url: GET {api}: {exc}") from None
    targets = body.get("targets") if isinstance(body, dict) else None
    if not isinstance(targets, list):
        raise _Fail(f"--router-url: GET {api}: no 'targets' in the answer")
    return targets


def dry_run_main(argv: list[str]) -> int:
    """Run the dry-run subcommand; returns the process exit status."""
    ap = argparse.ArgumentParser(prog="lodestone-router dry-run", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="router TOML file")
    ap.add_argument("--router", help="router name (default: the only one configured)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--keys", type=Path, help="file with one key per line")
    src.add_argument("--routing-log", type=Path, nargs="+", help="routing log file(s), JSON lines")
    ap.add_argument("--add", action="append", default=[], metavar="NAME=HOST:PORT",
                    type=lambda s: _pair(s, "--add"), help="a target that joins the pool")
    ap.add_argument("--remove", action="append", default=[], metavar="NAME",
                    help="a target (name or node id) that leaves the pool")
    ap.add_argument("--target", action="append", default=[], metavar="NAME=HOST:PORT",
                    type=lambda s: _pair(s, "--target"),
                    help="a member of the pool before the change, for a pool whose members are not in "
                         "the config (source = cluster or discovery) when --router-url is not given")
    ap.add_argument("--node-id", action="append", default=[], metavar="NAME=NODE_ID",
                    type=lambda s: _pair(s, "--node-id"), help="the node id of a target")
    ap.add_argument("--router-url", metavar="URL",
                    help="management API of the running router (http://[user:password@]host:port): "
                         "node ids come from its pool view")
    ap.add_argument("--user", help="management user for --router-url")
    ap.add_argument("--password", help="management password for --router-url")
    ap.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = ap.parse_args(argv)
    try:
        return _run(args)
    except _Fail as exc:
        print(exc, file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader (``| head``) went away: what it wanted was written. Exit quietly with 0,
        # and point stdout at /dev/null so the interpreter's final flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


def _run(args) -> int:

    try:
        cfg = load_router_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.router is None:
        if len(cfg.routers) != 1:
            print(f"{args.config}: several routers ({', '.join(cfg.routers)}): choose one with --router",
                  file=sys.stderr)
            return 2
        args.router = next(iter(cfg.routers))
    rc = cfg.routers.get(args.router)
    if rc is None or rc.policy is None or rc.pool is None:
        print(f"{args.config}: routers.{args.router}: no such router with a policy and a pool", file=sys.stderr)
        return 2

    live: dict[str, str] = {}
    live_targets: list[dict] = []
    if args.router_url:
        live_targets = [t for t in _live_pool(args.router_url, args.router, args.user, args.password)
                        if isinstance(t, dict) and t.get("name") and not t.get("local")]
        for t in live_targets:
            if t.get("node_id"):
                live[t["name"]] = t["node_id"]
    node_ids = {**live, **dict(args.node_id)}
    before = []
    if rc.pool.source == "static":
        for t in rc.pool.targets:
            if t.backup_of is not None:  # an HA backup serves its primary's node id: hashed once
                continue
            target = t.to_target()
            nid = node_ids.get(t.name, target.node_id)
            before.append(Target(nid, target.host, target.port, target.tls, target.management_url, target.name))
    elif args.target:   # the members given by hand
        for name, hostport in args.target:
            host, port = _hostport(f"--target {name}={hostport}", hostport)
            before.append(Target(node_ids.get(name), host, port, name=name))
    elif live_targets:  # the members the running router follows, in its pool order
        pairs: dict[str, dict] = {}  # an HA pair is one target: its primary, else first backup
        for t in live_targets:
            p = str(t.get("pair") or t["name"])
            if p not in pairs or (pairs[p].get("backup") and not t.get("backup")):
                pairs[p] = t
        for t in pairs.values():
            before.append(Target(node_ids.get(t["name"], t.get("node_id")), str(t.get("host")), int(t.get("port") or 0),
                                 bool(t.get("tls")), t.get("management_url"), t["name"]))
    else:
        raise _Fail(f"{args.config}: routers.{args.router}.pool: source {rc.pool.source!r} takes its members "
                    "from the cluster: give --router-url (the running router's pool) or --target NAME=HOST:PORT")
    added = []
    for name, hostport in args.add:
        host, port = _hostport(f"--add {name}={hostport}", hostport)
        added.append(Target(node_ids.get(name), host, port, name=name))
    after = change_pool(before, add=added, remove=args.remove)

    try:
        if args.keys is not None:
            keys = keys_from_key_list(args.keys.read_text(encoding="utf-8"))
        else:
            keys = []
            for p in args.routing_log:
                with p.open(encoding="utf-8", errors="replace") as fh:
                    keys.extend(keys_from_routing_log(fh))
    except OSError as exc:
        print(f"cannot read keys: {exc}", file=sys.stderr)
        return 2

    report = dry_run(rc.policy.name, rc.policy.properties, keys, before, after)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    unnamed = [t.name for t in before + added if t.node_id is None]
    if unnamed and rc.policy.name.startswith("CONSISTENT_HASH"):
        print(f"note: no node id for {', '.join(unnamed)}: hashing their names as stand-ins, which live "
              f"routing does not do: the fraction is representative, the exact keys are not "
              f"(pass --router-url for running targets, --node-id NAME=UUID for new ones)")

    def label(name: str | None, ident: str | None) -> str:
        if ident is None:
            return "(refused)"
        return name if name == ident or name is None else f"{name} ({ident})"

    print(f"policy {report.policy}{'' if report.deterministic else ' (not key-deterministic: indicative only)'}")
    print(f"targets before: {', '.join(map(label, report.before_names, report.before_targets))}")
    print(f"targets after:  {', '.join(map(label, report.after_names, report.after_targets))}")
    print(f"{report.moved_count} of {report.total_keys} keys move ({report.moved_fraction:.1%})")
    for m in report.moved[:50]:
        print(f"  {m.key}: {m.before_name or '(refused)'} -> {m.after_name or '(refused)'}")
    if report.moved_count > 50:
        print(f"  ... {report.moved_count - 50} more (use --json for all)")
    return 0
