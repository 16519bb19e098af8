"""``lodestone-broker`` / ``python -m broker``: run a broker node, or hash a password.

    lodestone-broker run etc/broker.toml [--amqp-port N] [--management-port N] [--data-dir DIR] [--name NAME]
    lodestone-broker check etc/broker.toml   (validate the config and its users file; exit 0/2)
    lodestone-broker hash-password [...]     (see hash_password_main below)

A bad config prints one line naming file, key and value and exits with status 2; a data
directory held by another process exits with status 1 and says which process holds it.
SIGTERM and SIGINT shut the node down cleanly (exit status 0).
"""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path
from typing import Sequence

import trio

from broker.config import ConfigError, apply_overrides, check_anonymous, load_config
from broker.process import run_node
from broker.store.errors import DataDirError, JournalCorrupt, JournalFailed
from broker.wire.io.logsetup import setup_logging
from broker.wire.io.trioutil import single_leaf
from broker.wire.io.users import hash_password, load_users

__all__ = ["main", "hash_password_main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lodestone-broker", description="Lodestone AMQP 1.0 broker node")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a broker node from a TOML config file")
    run.add_argument("config", type=Path, help="broker config file, e.g. etc/broker.toml")
    run.add_argument("--amqp-port", type=int, default=None,
                     help="override the port of the first plain acceptor (0 = OS-chosen)")
    run.add_argument("--management-port", type=int, default=None,
                     help="override the management port (0 = OS-chosen)")
    run.add_argument("--data-dir", type=Path, default=None, help="override [node] data-dir")
    run.add_argument("--name", default=None, help="override [node] name")
    run.add_argument("--static-connectors", default=None, metavar="URL[,URL...]",
                     help="override how [cluster] finds its members: these static connectors instead "
                          "of its discovery-group (lodestone-local's fallback where multicast fails)")
    chk = sub.add_parser("check", help="validate a broker config (and its users file) and exit")
    chk.add_argument("config", type=Path, help="broker config file, e.g. etc/broker.toml")
    hp = sub.add_parser("hash-password", help="print an scrypt hash for the users file", add_help=False)
    hp.add_argument("args", nargs=argparse.REMAINDER)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["hash-password"]:
        return hash_password_main(argv[1:]) or 0
    args = _parser().parse_args(argv)

    if args.command == "check":
        return _check(args.config)
    try:
        cfg = load_config(args.config)
        for opt, value in (("--amqp-port", args.amqp_port), ("--management-port", args.management_port)):
            if value is not None and not 0 <= value <= 65535:
                raise ConfigError("<command line>", opt, f"{value} must be between 0 and 65535")
        cfg = apply_overrides(cfg, amqp_port=args.amqp_port, management_port=args.management_port,
                              data_dir=args.data_dir, name=args.name, static_connectors=args.static_connectors)
    except ConfigError as exc:
        print(f"lodestone-broker: {exc}", file=sys.stderr)
        return 2

    setup_logging(cfg.log_level, cfg.log_json)
    try:
        code = trio.run(run_node, cfg)
    except BaseException as exc:  # noqa: BLE001 - unwrapped and re-raised below if unknown
        leaf = single_leaf(exc)
        if isinstance(leaf, ConfigError):  # e.g. the users file
            print(f"lodestone-broker: {leaf}", file=sys.stderr)
            return 2
        if isinstance(leaf, (DataDirError, JournalCorrupt, JournalFailed, OSError)):  # lock held, port in use, disk full
            # the listener's message names what and where; "[Errno 98] " adds nothing to it
            text = leaf.strerror if isinstance(leaf, OSError) and leaf.errno and leaf.filename is None \
                and leaf.strerror and "cannot listen on" in leaf.strerror else str(leaf)
            print(f"lodestone-broker: {text}", file=sys.stderr)
            return 1
        if isinstance(leaf, KeyboardInterrupt):
            return 0
        raise
    return code or 0


def _check(path: Path) -> int:
    """``check``: what ``run`` validates before it touches the data directory or a port."""

    try:
        cfg = load_config(path)
        security = load_users(cfg.users_file)
        check_anonymous(cfg, security.anonymous_enabled)
    except ConfigError as exc:
        print(f"lodestone-broker: {exc}", file=sys.stderr)
        return 2
    m = cfg.management
    mgmt = f"management {m.host}:{m.port}" if m.enabled else "management off"
    print(f"{path}: ok (node {cfg.name}, {len(cfg.acceptors)} acceptor(s), {mgmt}, "
          f"{len(security.users)} user(s) in {cfg.users_file})")
    for w in security.warnings():
        print(f"lodestone-broker: warning: {w}", file=sys.stderr)
    if cfg.cluster is not None and cfg.cluster.weak_password:
        print(f"lodestone-broker: warning: [cluster] password is {'a published sample' if cfg.cluster.password_set else 'not set'}; "
              "cluster logins with it are accepted from loopback only", file=sys.stderr)
    return 0


# -- hash-password ------------------------------------------------------------------------------------------

def hash_password_main(argv: Sequence[str] | None = None) -> int:
    """``lodestone-broker hash-password``: print a scrypt hash for the users file.

    The password comes from ``--stdin`` (first line, for scripts) or is prompted for twice on
    the terminal. Returns the exit status (0 ok, 2 usage error).
    """
    ap = argparse.ArgumentParser(prog="lodestone-broker hash-password",
                                 description="Print a scrypt password hash for etc/users.toml.")
    ap.add_argument("--stdin", action="store_true", help="read the password from standard input")
    ap.add_argument("--n", type=int, default=16384, help="scrypt cost N (power of two; default 16384)")
    ap.add_argument("--r", type=int, default=8, help="scrypt block size r (default 8)")
    ap.add_argument("--p", type=int, default=1, help="scrypt parallelism p (default 1)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        try:
            password = getpass.getpass("password: ")
            again = getpass.getpass("again: ")
        except (EOFError, KeyboardInterrupt):
            print("hash-password: no password given", file=sys.stderr)
            return 2
        if password != again:
            print("hash-password: the passwords differ", file=sys.stderr)
            return 2
    if not password:
        print("hash-password: empty password", file=sys.stderr)
        return 2
    try:
        print(hash_password(password, n=args.n, r=args.r, p=args.p))
    except ValueError as exc:
        print(f"hash-password: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
