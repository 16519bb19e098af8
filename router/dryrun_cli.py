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

Decision replay (``--candidate NEW_CONFIG``, with ``--routing-log``): every ``event = "route"``
decision of the logs (router ``--router`` of CONFIG, the config that wrote them) is decided again
by a core router built from NEW_CONFIG (``router.core.replay``: its key type and filter, transform,
local-target filter, pins file, quorum, policy and pool, every target ready; a logged cache hit
keeps its target while that target is in the candidate pool). It prints the distribution per
target (logged vs candidate: count and share), skew (max share / mean share) of both, and the keys
whose target changes (``key: logged -> candidate``). A decision refused in the log is counted
apart; one the candidate's policy would make without the key deciding it (ROUND_ROBIN,
LEAST_CONNECTIONS, CONSISTENT_HASH with LOAD_FACTOR) or that the router made while some targets
were down is counted as *not replayable*, with the reason, and given no target. Node ids come from
``--node-id``, ``--router-url``, else the log's ``target_node_id``; ``--add`` / ``--remove`` change
the candidate's pool further.
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
from dataclasses import replace
from pathlib import Path

from broker.wire.io.tomlconfig import ConfigError

from .config import RouterProcessConfig, load_router_config
from .core.dryrun import change_pool, dry_run, keys_from_key_list, keys_from_routing_log
from .core.pins import PinTable, parse_pins
from .core.replay import RoutingLogRead, candidate_router, decisions_from_routing_log, replay
from .errors import FilterError, PolicyError
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
    ap = argparse.ArgumentParser(
        prog="lodestone-router dry-run", description=__doc__.splitlines()[0],
        epilog="Decision replay: lodestone-router dry-run CONFIG --routing-log LOG [--routing-log LOG2 ...] "
               "--candidate NEW_CONFIG [--router NAME] [--json] decides every logged decision again with "
               "NEW_CONFIG and prints, logged vs candidate, the distribution per target, skew and the keys "
               "that would move. See docs/router.md, \"Dry run\".")
    ap.add_argument("config", help="router TOML file")
    ap.add_argument("--router", help="router name (default: the only one configured)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--keys", type=Path, help="file with one key per line")
    src.add_argument("--routing-log", type=Path, nargs="+", action="extend",
                     help="routing log file(s), JSON lines (the flag may be repeated)")
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
    ap.add_argument("--candidate", type=Path, metavar="NEW_CONFIG",
                    help="replay every decision of the --routing-log against this router config "
                         "(policy, key filter, pins, pool...): distribution, moved keys and skew, "
                         "logged vs candidate; ROUND_ROBIN / LEAST_CONNECTIONS choices are counted "
                         "as not replayable")
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


def _pick_router(cfg, path, name: str | None) -> str:
    """The router of ``cfg`` the command is about (``--router``, else the only one)."""
    if name is None:
        if len(cfg.routers) != 1:
            raise _Fail(f"{path}: several routers ({', '.join(cfg.routers)}): choose one with --router")
        name = next(iter(cfg.routers))
    rc = cfg.routers.get(name)
    if rc is None or rc.policy is None or rc.pool is None:
        raise _Fail(f"{path}: routers.{name}: no such router with a policy and a pool")
    return name


def _load(path) -> RouterProcessConfig:
    try:
        return load_router_config(path)
    except ConfigError as exc:
        raise _Fail(str(exc)) from None


def _members(args, rc, path, node_ids: dict[str, str], live_targets: list[dict], *,
             backups: bool = False) -> list[Target]:
    """The pool of router config ``rc`` (of file ``path``): its static targets with their node
    ids, else the members given with --target, else the running router's (--router-url).
    ``backups``: keep HA backups (a core ``Pool`` serves each pair once); a dry run hashes a
    pair once, by its primary."""
    members = []
    if rc.pool.source == "static":
        for t in rc.pool.targets:
            if t.backup_of is not None and not backups:  # a backup serves its primary's node id
                continue
            target = t.to_target()
            nid = node_ids.get(t.name, target.node_id)
            members.append(replace(target, node_id=nid) if backups else
                           Target(nid, target.host, target.port, target.tls, target.management_url, target.name))
    elif args.target:   # the members given by hand
        for name, hostport in args.target:
            host, port = _hostport(f"--target {name}={hostport}", hostport)
            members.append(Target(node_ids.get(name), host, port, name=name))
    elif live_targets:  # the members the running router follows, in its pool order
        pairs: dict[str, dict] = {}  # an HA pair is one target: its primary, else first backup
        for t in live_targets:
            p = str(t.get("pair") or t["name"])
            if p not in pairs or (pairs[p].get("backup") and not t.get("backup")):
                pairs[p] = t
        for t in pairs.values():
            members.append(Target(node_ids.get(t["name"], t.get("node_id")), str(t.get("host")),
                                  int(t.get("port") or 0), bool(t.get("tls")), t.get("management_url"),
                                  t["name"]))
    else:
        raise _Fail(f"{path}: routers.{args.router}.pool: source {rc.pool.source!r} takes its members "
                    "from the cluster: give --router-url (the running router's pool) or --target NAME=HOST:PORT")
    return members


def _added(args, node_ids: dict[str, str]) -> list[Target]:
    added = []
    for name, hostport in args.add:
        host, port = _hostport(f"--add {name}={hostport}", hostport)
        added.append(Target(node_ids.get(name), host, port, name=name))
    return added


def _label(name: str | None, ident: str | None) -> str:
    if ident is None:
        return "(refused)"
    return name if name == ident or name is None else f"{name} ({ident})"


def _print_unnamed(policy: str, targets: list[Target]) -> None:
    unnamed = [t.name for t in targets if t.node_id is None]
    if unnamed and policy.startswith("CONSISTENT_HASH"):
        print(f"note: no node id for {', '.join(unnamed)}: hashing their names as stand-ins, which live "
              f"routing does not do: the fraction is representative, the exact keys are not "
              f"(pass --router-url for running targets, --node-id NAME=UUID for new ones)")


def _print_moves(moved, moved_count: int, total_keys: int, fraction: float) -> None:
    """``N of M keys move (x%)`` and at most 50 ``key: before -> after`` lines."""
    print(f"{moved_count} of {total_keys} keys move ({fraction:.1%})")
    for m in moved[:50]:
        print(f"  {m.key}: {m.before_name or '(refused)'} -> {m.after_name or '(refused)'}")
    if len(moved) > 50:
        print(f"  ... {len(moved) - 50} more (use --json for all)")


def _run(args) -> int:
    if args.candidate is not None and args.routing_log is None:
        raise _Fail("--candidate replays the decisions of a routing log: give --routing-log")
    cfg = _load(args.config)
    args.router = _pick_router(cfg, args.config, args.router)
    rc = cfg.routers[args.router]

    live: dict[str, str] = {}
    live_targets: list[dict] = []
    if args.router_url:
        live_targets = [t for t in _live_pool(args.router_url, args.router, args.user, args.password)
                        if isinstance(t, dict) and t.get("name") and not t.get("local")]
        for t in live_targets:
            if t.get("node_id"):
                live[t["name"]] = t["node_id"]
    if args.candidate is not None:
        return _replay(args, rc, live, live_targets)
    node_ids = {**live, **dict(args.node_id)}
    before = _members(args, rc, args.config, node_ids, live_targets)
    added = _added(args, node_ids)
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
    _print_unnamed(rc.policy.name, before + added)
    print(f"policy {report.policy}{'' if report.deterministic else ' (not key-deterministic: indicative only)'}")
    print(f"targets before: {', '.join(map(_label, report.before_names, report.before_targets))}")
    print(f"targets after:  {', '.join(map(_label, report.after_names, report.after_targets))}")
    _print_moves(report.moved, report.moved_count, report.total_keys, report.moved_fraction)
    return 0


def _read_pins(path: Path) -> tuple[PinTable, list[str]]:
    """A candidate's pins file as the router loads it: absent = no pins, bad lines skipped."""
    bad: list[str] = []
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return PinTable(source=str(path)), bad
    except (OSError, UnicodeDecodeError) as exc:
        raise _Fail(f"{path}: cannot read: {exc}") from None
    return parse_pins(text, str(path), bad_lines=bad), bad


def _replay(args, rc, live: dict[str, str], live_targets: list[dict]) -> int:
    """``--candidate``: replay the routing log's decisions against another config."""
    read = RoutingLogRead()
    try:
        for p in args.routing_log:
            with p.open(encoding="utf-8", errors="replace") as fh:
                decisions_from_routing_log(fh, read)
    except OSError as exc:
        raise _Fail(f"cannot read the routing log: {exc}") from None
    mine = [d for d in read.decisions if d.router == args.router]
    ccfg = _load(args.candidate)
    cname = args.router if args.router in ccfg.routers or len(ccfg.routers) != 1 else next(iter(ccfg.routers))
    crc = ccfg.routers[_pick_router(ccfg, args.candidate, cname)]
    # node ids: --node-id, else the running router's, else the ones the log shows it routed to
    logged_ids = {d.target_name: d.target_node_id for d in mine if d.target_name and d.target_node_id}
    node_ids = {**logged_ids, **live, **dict(args.node_id)}
    added = _added(args, node_ids)
    members = change_pool(_members(args, crc, args.candidate, node_ids, live_targets, backups=True),
                          add=added, remove=args.remove)
    aliases = {t.name: t.backup_of for c in (rc, crc) for t in c.pool.targets if t.backup_of}
    pins, bad_pins = (_read_pins(crc.pins.file) if crc.pins is not None else (None, []))
    local = crc.local_target.to_target() if crc.local_target is not None else None
    if local is not None:
        local = replace(local, node_id=node_ids.get(local.name, local.node_id))
    try:
        candidate = candidate_router(
            crc.name, key_type=crc.key_type, policy=crc.policy.name, properties=crc.policy.properties,
            targets=members, quorum_size=crc.pool.quorum_size, key_filter=crc.key_filter,
            local_filter=crc.local_target_filter, local_target=local,
            local_target_enabled=crc.pool.local_target_enabled, pins=pins, cache=crc.cache is not None,
            artemis_keys=crc.artemis_keys, max_key_length=crc.max_key_length)
    except (FilterError, PolicyError) as exc:
        raise _Fail(f"{args.candidate}: routers.{crc.name}: {exc}") from None
    full_pool = None
    logged_targets: list[str] = []
    if rc.pool.source == "static":
        logged_targets = [t.name for t in rc.pool.targets if t.backup_of is None]
        full_pool = len(logged_targets) + bool(rc.pool.local_target_enabled and rc.local_target)
    report = replay(mine, candidate, full_pool=full_pool, aliases=aliases, logged_targets=logged_targets)
    served = [t for t in members if not t.backup]
    if args.json:
        out = report.to_dict()
        out.update({"router": args.router, "candidate": str(args.candidate),
                    "after_targets": [t.identity for t in served], "bad_lines": read.bad_lines,
                    "other_router_decisions": len(read.decisions) - len(mine), "bad_pin_lines": bad_pins})
        print(json.dumps(out, indent=2))
        return 0
    _print_unnamed(crc.policy.name, served)
    for msg in bad_pins:
        print(f"note: pins: skipped {msg}")
    logged = ", ".join(report.logged_policies) or "none"
    print(f"replay of {report.decisions} decisions of router {args.router} against {args.candidate}"
          f" (policy {report.policy}; logged: {logged})")
    if read.bad_lines:
        print(f"note: {read.bad_lines} bad line(s) in the routing log skipped")
    print(f"targets after:  {', '.join(_label(t.name, t.identity) for t in served)}")
    print(f"{report.replayed} replayed: {report.reproduced} reproduced, "
          f"{report.replayed - report.reproduced} differ; {report.refused_in_log_count} refused in the log; "
          f"{report.not_replayable_count} not replayable")
    for outcome, n in report.refused_in_log.items():
        print(f"  refused in the log: {n} {outcome}")
    for why, n in report.not_replayable.items():
        print(f"  not replayable: {n} (cannot reproduce: {why})")
    rows = report.distribution()
    width = max([len(str(r["target"] or "(refused)")) for r in rows] + [6])
    print(f"{'target':<{width}}  {'logged':>14}  {'candidate':>14}")
    for r in rows:
        print(f"{r['target'] or '(refused)':<{width}}  {r['logged']:>6} {r['logged_share']:>7.1%}"
              f"  {r['candidate']:>6} {r['candidate_share']:>7.1%}")

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    print(f"skew (max share / mean share; 1.00 = even): logged {fmt(report.logged_skew)}, "
          f"candidate {fmt(report.candidate_skew)}")
    _print_moves(report.moved, report.moved_count, report.total_keys, report.moved_fraction)
    return 0
