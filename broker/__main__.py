"""``lodestone-broker`` / ``python -m broker``: run a broker node, or hash a password.

    lodestone-broker run etc/broker.toml [--amqp-port N] [--management-port N] [--data-dir DIR] [--name NAME]
    lodestone-broker check etc/broker.toml   (validate the config and its users file; exit 0/2)
    lodestone-broker hash-password [...]     (see broker.core.security.hash_password_main)

A bad config prints one line naming file, key and value and exits with status 2; a data
directory held by another process exits with status 1 and says which process holds it.
SIGTERM and SIGINT shut the node down cleanly (exit status 0).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from broker.trioutil import single_leaf

__all__ = ["main"]


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
        from broker.core.security import hash_password_main
        return hash_password_main(argv[1:]) or 0
    args = _parser().parse_args(argv)
    from broker.config import ConfigError, apply_overrides, load_config
    from broker.store.errors import DataDirError, JournalCorrupt

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

    import trio

    from broker.logsetup import setup_logging
    from broker.server import run_node

    setup_logging(cfg.log_level, cfg.log_json)
    try:
        code = trio.run(run_node, cfg)
    except BaseException as exc:  # noqa: BLE001 - unwrapped and re-raised below if unknown
        leaf = single_leaf(exc)
        if isinstance(leaf, ConfigError):  # e.g. the users file
            print(f"lodestone-broker: {leaf}", file=sys.stderr)
            return 2
        if isinstance(leaf, (DataDirError, JournalCorrupt, OSError)):  # lock held, port in use
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
    from broker.config import ConfigError, check_anonymous, load_config
    from broker.core.security import load_users

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


if __name__ == "__main__":
    sys.exit(main())
