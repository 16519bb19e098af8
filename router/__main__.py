"""``lodestone-router`` / ``python -m router``: run the connection router.

    lodestone-router run etc/router.toml [--workers N] [--drain-timeout-s S] [--log-level L] [--log-json]
    lodestone-router check etc/router.toml          (validate the config and the users file; exit 0/2)
    lodestone-router dry-run etc/router.toml --keys FILE --add NAME=HOST:PORT --remove NAME
    lodestone-router drain etc/router.toml broker-2 [--undrain] [--wait]
                                                    (which keys would move; see router.dryrun_cli)

A bad config prints one line naming file, key and value and exits with status 2. Once every
socket is bound the router prints ``listening <acceptor name> amqp[s]://host:port`` per acceptor
and ``listening management http://host:port``. SIGTERM/SIGINT stop accepting, drain open
connections for up to ``--drain-timeout-s`` and exit 0.

``workers`` (config, or ``--workers``; 0 = one per core) > 1 runs a supervisor (management API,
health probes, runtime filters, the shared sticky cache) and that many worker processes sharing
the ports with SO_REUSEPORT (see ``router.workers``). The internal ``worker`` sub-command is what
the supervisor starts; ``--control-fd`` is its end of the control channel.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from broker.wire.io.trioutil import single_leaf
from broker.wire.io.tomlconfig import ConfigError
from router.config import load_router_config
from router.fdlimit import budget_warning, raise_nofile_limit
from broker.wire.io.logsetup import setup_logging
from router.control import read_config_message
from router.workers import default_workers, run_supervisor
from router.server import DEFAULT_DRAIN_TIMEOUT_S, serve_router
from broker.wire.io.users import load_users
from router.dryrun_cli import dry_run_main
from router.drain_cli import drain_main
from broker.wire.io.tls import server_context
import trio

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lodestone-router", description="Lodestone AMQP 1.0 connection router")
    sub = p.add_subparsers(dest="command", required=True, metavar="{run,check,dry-run,drain}")
    for name, help_ in (("run", "run the router from a TOML config file"),
                        ("check", "validate a router config (and its users file) and exit")):
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("config", type=Path, help="router config file, e.g. etc/router.toml")
        if name == "run":
            sp.add_argument("--workers", type=int, default=None,
                            help="worker processes (overrides the config; 0 = one per core)")
            sp.add_argument("--drain-timeout-s", type=float, default=None,
                            help="on SIGTERM, how long open connections may keep running (default 10)")
            sp.add_argument("--log-level", default="INFO")
            sp.add_argument("--log-json", action="store_true", help="log JSON lines on stderr")
    sub.add_parser("dry-run", add_help=False,
                   help="report which keys would move if a pool changed (dry-run --help for options)")
    sub.add_parser("drain", add_help=False,
                   help="drain a target of a running router (drain --help for options)")
    w = sub.add_parser("worker")  # internal: what the supervisor starts; not listed in --help
    w.add_argument("config", type=Path)
    w.add_argument("--index", type=int, required=True)
    w.add_argument("--count", type=int, required=True)
    w.add_argument("--ports", required=True, help="JSON {acceptor: port}")
    w.add_argument("--control-fd", type=int, required=True, help="control channel to the supervisor")
    w.add_argument("--drain-timeout-s", type=float, default=None)
    w.add_argument("--log-level", default="INFO")
    w.add_argument("--log-json", action="store_true")
    return p


def _load(path: Path, data: bytes | None = None):

    cfg = load_router_config(path, data)
    if cfg.users_file is not None:

        load_users(cfg.users_file)  # fail now, with the file's own error, not after binding
    for acc in cfg.acceptors:
        for key, p in (("tls-cert", acc.tls_cert), ("tls-key", acc.tls_key), ("tls-client-ca", acc.tls_client_ca),
                       ("upstream-ca", acc.upstream_ca)):
            if p is not None and not Path(p).is_file():
                raise ConfigError(cfg.file or path, f"acceptors.{acc.name}.{key}", f"{str(p)!r}: no such file")
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["drain"]:
        return drain_main(argv[1:])
    if argv[:1] == ["dry-run"]:

        return dry_run_main(argv[1:])
    args = _parser().parse_args(argv)

    try:
        if args.command == "worker":   # the supervisor's configuration in force, not the file's now
            try:
                text = read_config_message(args.control_fd)
            except (OSError, ValueError) as exc:
                print(f"lodestone-router: worker {args.index}: {exc}", file=sys.stderr)
                return 1
            cfg = _load(args.config, text.encode("utf-8"))
        else:
            try:   # read once: a supervisor hands its workers exactly the text it checked
                data = args.config.read_bytes()
            except OSError:
                data = None   # _load names the problem
            cfg = _load(args.config, data)
            text = data.decode("utf-8")    # it loaded: UTF-8
        if args.command == "run" and args.workers is not None and args.workers < 0:
            raise ConfigError("<command line>", "--workers", f"{args.workers} must be >= 0")
        if args.command != "check":

            for acc in cfg.acceptors:  # certificate/key problems are config errors too
                if acc.tls_cert is not None:
                    try:
                        server_context(acc.tls_cert, acc.tls_key, client_ca=acc.tls_client_ca)
                    except (OSError, ValueError) as exc:
                        raise ConfigError(cfg.file or args.config, f"acceptors.{acc.name}.tls-cert",
                                          f"{str(acc.tls_cert)!r}: {exc}") from None
    except ConfigError as exc:
        print(f"lodestone-router: {exc}", file=sys.stderr)
        return 2

    if args.command == "check":
        print(f"{args.config}: ok ({len(cfg.routers)} router(s), {len(cfg.acceptors)} acceptor(s))")
        import resource

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # what `run` raises the limit to
        warning = budget_warning(cfg.acceptors, hard if hard != resource.RLIM_INFINITY else 1 << 20)
        if warning:
            print(f"lodestone-router: warning: {warning}", file=sys.stderr)
        return 0

    setup_logging(args.log_level, args.log_json)
    import logging

    log = logging.getLogger("router.main")
    limits = raise_nofile_limit()  # workers inherit it
    if limits is not None:
        before, now, hard = limits
        if args.command != "worker":
            log.info("open-files limit: %d (was %d, hard limit %d)", now, before, hard)
        warning = budget_warning(cfg.acceptors, now)
        if warning and args.command != "worker":
            log.warning("%s", warning)
    drain = args.drain_timeout_s
    if args.command == "worker":
        return _run(cfg, worker=args.index, workers=args.count, ports=json.loads(args.ports), drain=drain,
                    control_fd=args.control_fd)

    workers = cfg.workers if args.workers is None else args.workers
    if workers == 0:
        workers = default_workers()
    if workers > 1:
        extra = ["--log-level", args.log_level] + (["--log-json"] if args.log_json else [])
        if drain is not None:
            extra += ["--drain-timeout-s", str(drain)]
        return _guard(lambda: run_supervisor(str(args.config), cfg, workers, worker_args=extra,
                                             drain_timeout_s=drain, config_text=text))
    return _run(cfg, worker=0, workers=1, ports=None, drain=drain)


def _run(cfg, *, worker: int, workers: int, ports, drain, control_fd: int | None = None) -> int:

    def run() -> int:
        trio.run(lambda: serve_router(cfg, worker=worker, workers=workers, ports=ports, control_fd=control_fd,
                                      drain_timeout_s=DEFAULT_DRAIN_TIMEOUT_S if drain is None else drain))
        return 0

    return _guard(run)


def _guard(run) -> int:
    """Run ``run()``; a config error exits 2, an OS error (port in use) 1, Ctrl-C 0."""

    try:
        return run()
    except BaseException as exc:  # noqa: BLE001 - unwrapped and re-raised below if unknown
        leaf = single_leaf(exc)
        if isinstance(leaf, ConfigError):
            print(f"lodestone-router: {leaf}", file=sys.stderr)
            return 2
        if isinstance(leaf, OSError):  # port in use, address not available
            # the listener's message names what and where; "[Errno 98] " adds nothing to it
            text = leaf.strerror if leaf.errno and leaf.filename is None and leaf.strerror \
                and "cannot listen on" in leaf.strerror else str(leaf)
            print(f"lodestone-router: {text}", file=sys.stderr)
            return 1
        if isinstance(leaf, KeyboardInterrupt):
            return 0
        raise


if __name__ == "__main__":
    sys.exit(main())
