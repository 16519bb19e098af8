"""`lodestone-router dry-run`: which keys would move if a router's pool changed.

    lodestone-router dry-run etc/router.toml --router main --routing-log var/router/routing.log \
        --add broker-4=127.0.0.1:15675 --remove broker-2

Keys come from a key list (one per line) or from routing logs (their ``filtered_key``). The
pool before the change is the router's configured targets. Hash policies hash each target's
node id; a static target's node id is learned from its broker at run time, so pass
``--node-id NAME=UUID`` for each target (the router's management API lists them under
``/api/v1/pools``), or the dry run hashes the target names and says so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from broker.tomlconfig import ConfigError

from .config import load_router_config
from .core.dryrun import change_pool, dry_run, keys_from_key_list, keys_from_routing_log
from .policies import Target


def _pair(text: str, what: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"{what} must look like NAME=VALUE, got {text!r}")
    return name, value


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
    ap.add_argument("--node-id", action="append", default=[], metavar="NAME=NODE_ID",
                    type=lambda s: _pair(s, "--node-id"), help="the node id of a target")
    ap.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = ap.parse_args(argv)

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

    node_ids = dict(args.node_id)
    before = []
    for t in rc.pool.targets:
        target = t.to_target()
        nid = node_ids.get(t.name, target.node_id)
        before.append(Target(nid, target.host, target.port, target.tls, target.management_url, target.name))
    added = []
    for name, hostport in args.add:
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit():
            print(f"--add {name}={hostport}: expected HOST:PORT", file=sys.stderr)
            return 2
        added.append(Target(node_ids.get(name), host, int(port), name=name))
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
        print(f"note: no node id for {', '.join(unnamed)}: hashing target names, which live routing "
              f"does not do (pass --node-id NAME=UUID)")
    print(f"policy {report.policy}{'' if report.deterministic else ' (not key-deterministic: indicative only)'}")
    print(f"targets before: {', '.join(report.before_targets)}")
    print(f"targets after:  {', '.join(report.after_targets)}")
    print(f"{report.moved_count} of {report.total_keys} keys move ({report.moved_fraction:.1%})")
    for m in report.moved[:50]:
        print(f"  {m.key}: {m.before} -> {m.after}")
    if report.moved_count > 50:
        print(f"  ... {report.moved_count - 50} more (use --json for all)")
    return 0
