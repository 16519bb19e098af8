"""The router process: routing services, acceptors, management API, routing log, drain.

Structure (trio, per STYLE.md): one *system* nursery runs the long-lived services (each router's
``RouterService.run`` — health probes, cache tiers —, the routing-log flusher, the management
API); one *handlers* nursery holds every client connection; one *accept* nursery runs the accept
loops. On SIGTERM/SIGINT the accept nursery is cancelled and the listeners closed (no new
connections), the handlers nursery gets ``drain_timeout_s`` to finish on its own (redirects and
refusals finish in milliseconds; proxied connections run until they close), then whatever is
left is cancelled, the routing log is flushed and the process exits 0.

``serve_router(cfg, ...)`` is the entry point ``python -m router run`` uses; tests may call it
in-process too.

A worker of a multi-worker router (``control_fd`` set, see ``router.workers``) differs in four
ways: its services follow the supervisor over the control channel (filters, pool readiness, the
shared sticky cache — ``router.control``), it serves no management API and prints nothing (the
supervisor does both), it reports ``ready`` once bound, and it drains and exits when the
supervisor goes away (the channel closes).
"""

from __future__ import annotations

import logging
import functools
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import trio

from broker.wire.io.logsetup import print_listening
from router.config import AcceptorConfig, RouterProcessConfig
from router.net.edge import Acceptor, AcceptorSettings, EdgeContext
from router.net.listener import ConnectionLimit, listener_port, open_listeners, serve_listeners
from router.net.stats import EdgeStats
from broker.wire.io.tls import client_context, server_context
from router.routelog import RouteLog, worker_log_path
from router.service import build_router, build_services
from broker.wire.io.users import load_users
from router.control import Link, stream_from_fd
from router.net.proxy import SharedPoller
from router.dashboard import recent_decisions
from router.management import io_status, serve_management
from router.reload import Reloader, ReloadRefused, reload_on_sighup, run_watched

log = logging.getLogger("router.server")

DEFAULT_DRAIN_TIMEOUT_S = 10.0


@dataclass
class RunningRouter:
    """What a started router exposes (management API and tests use it)."""

    config: RouterProcessConfig
    services: dict[str, Any]
    acceptors: dict[str, Acceptor]
    limits: dict[str, ConnectionLimit]
    edge: EdgeContext
    ports: dict[str, int] = field(default_factory=dict)
    management_address: tuple[str, int] | None = None
    worker: int | None = 0
    workers: int = 1
    draining: bool = False
    #: the supervisor of a multi-worker router (``router.workers.Supervisor``), else None
    supervisor: Any = None
    #: applies a reloaded configuration (``router.reload``; SIGHUP, ``POST /api/v1/reload``)
    reloader: Any = None


def acceptor_settings(acc: AcceptorConfig) -> AcceptorSettings:
    """Build the run-time settings of one acceptor from its config."""
    ssl_ctx = None
    if acc.tls_cert is not None:
        ssl_ctx = server_context(acc.tls_cert, acc.tls_key, client_ca=acc.tls_client_ca)
    mechs = list(acc.sasl_mechanisms)
    if acc.anonymous and "ANONYMOUS" not in mechs:
        mechs.append("ANONYMOUS")
    if ssl_ctx is None or acc.tls_client_ca is None:
        mechs = [m for m in mechs if m != "EXTERNAL"]  # EXTERNAL needs a verified client certificate
    upstream_ctx = None
    if acc.mode != "redirect":  # proxy, auto
        upstream_ctx = client_context(ca=acc.upstream_ca) if acc.upstream_ca is not None else client_context()
    return AcceptorSettings(
        name=acc.name, mode=acc.mode, router=acc.router, ssl_context=ssl_ctx, mechanisms=tuple(mechs) or ("PLAIN",),
        tls_handshake_timeout_s=acc.tls_handshake_timeout_ms / 1000,
        handshake_timeout_s=acc.handshake_timeout_ms / 1000,
        upstream_connect_timeout_s=acc.connect_timeout_ms / 1000,
        tcp_user_timeout_ms=acc.tcp_user_timeout_ms,
        connect_retries=acc.connect_retries,
        upstream_close_grace_s=acc.upstream_close_grace_ms / 1000,
        idle_timeout_s=acc.idle_timeout_s or None,
        upstream_ssl_context=upstream_ctx,
        upstream_tls=acc.upstream_tls,
        upstream_proxy_protocol=acc.upstream_proxy_protocol,
        # diagnostic knob for loadtest/bench_proxy.py: LODESTONE_SPLICE=0 forces the stream pump
        use_splice=os.environ.get("LODESTONE_SPLICE", "1") != "0",
        limits=acc.limits,
        max_connections=acc.max_connections,
    )


def build_acceptor(settings: AcceptorSettings, service, edge: EdgeContext) -> Acceptor:
    """One acceptor of a router process (at start and for one a reload adds); its settings from
    ``acceptor_settings``, its router from ``router.service.build_router``."""
    return Acceptor(settings, service, edge)


def build_limit(acc: AcceptorConfig) -> ConnectionLimit:
    """An acceptor's ``max-connections`` gate (0: none)."""
    return ConnectionLimit(acc.max_connections or None)


def _url(acc: AcceptorConfig, host: str, port: int) -> str:
    scheme = "amqps" if acc.tls_cert is not None else "amqp"
    h = f"[{host}]" if ":" in host else host
    return f"{scheme}://{h}:{port}"


def worker_stats(running: RunningRouter) -> dict:
    """This process's counters, for the supervisor's aggregated management views."""
    st = running.edge.stats
    return {"worker": running.worker, "pid": os.getpid(), "draining": running.draining,
            "counters": [[a, n, v] for (a, n), v in st.counters.items()],
            "active": dict(st.active), "bytes_up": dict(st.bytes_up), "bytes_down": dict(st.bytes_down),
            "routers": {name: dict(svc.counters) for name, svc in running.services.items()},
            "proxied": {name: {g: len(c) for g, c in svc.proxied.items()} for name, svc in running.services.items()},
            "drained": {name: {g: d.proxied_ended for g, d in svc.drains.items()}
                        for name, svc in running.services.items()},
            "routing_log": [running.edge.routelog.lines_written, running.edge.routelog.lines_dropped,
                            running.edge.routelog.write_errors, running.edge.routelog.error],
            "io": io_status(running),
            "logins": dict(running.edge.login_gate.counters) if running.edge.login_gate else {}}


def _control_handler(running_box: dict, services: dict, state_applied: trio.Event):
    """The worker's side of the control channel (see router.control for the messages)."""

    def set_filter(svc, field: str, value) -> None:
        get = svc.get_key_filter if field == "key_filter" else svc.get_local_target_filter
        if get() == value:  # unchanged: keep the config's compiled filter as it is
            return
        (svc.set_key_filter if field == "key_filter" else svc.set_local_target_filter)(value)

    def handle(msg: dict) -> dict | None:
        op = msg.get("op")
        if op == "state":
            for name, filters in msg["filters"].items():
                svc = services.get(name)
                if svc is not None:
                    for field, value in filters.items():
                        set_filter(svc, field, value)
            for name, states in msg["pools"].items():
                if name in services:
                    services[name].apply_pool_states(states)
            state_applied.set()
            return None
        if op == "pool":
            svc = services.get(msg["router"])
            if svc is not None:
                svc.apply_pool_states(msg["states"])
            return None
        if op == "set_filter":
            svc = services[msg["router"]]
            field = msg["field"]
            if field not in ("key_filter", "local_target_filter"):
                raise ValueError(f"unknown filter {field!r}")
            set_filter(svc, field, msg["value"])
            get = svc.get_key_filter if field == "key_filter" else svc.get_local_target_filter
            log.info("%s of router %s set to %r by the supervisor", field, msg["router"], get())
            return {"value": get()}
        if op in ("reload_prepare", "reload_commit", "reload_abort"):
            running = running_box.get("running")
            if running is None or running.reloader is None:
                raise ValueError("not started yet")
            return _reload_step(running.reloader, msg)
        if op in ("stats", "recent"):
            running = running_box.get("running")
            if running is None:
                raise ValueError("not started yet")
            return worker_stats(running) if op == "stats" else {"decisions": recent_decisions(running)}
        raise ValueError(f"unknown control message {op!r}")

    return handle


async def serve_router(cfg: RouterProcessConfig, *, worker: int = 0, workers: int = 1,
                       ports: dict[str, int] | None = None, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                       print_lines: bool = True, control_fd: int | None = None,
                       task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run the router until SIGTERM/SIGINT (then drain) or cancellation.

    ``worker``/``workers``/``ports``/``control_fd`` are set by the multi-process supervisor
    (router.workers); a process without ``control_fd`` serves the management API and prints the
    ``listening`` lines. ``task_status.started(RunningRouter)`` once every socket is bound.
    """

    authenticator = None
    if cfg.users_file is not None:

        authenticator = load_users(cfg.users_file)
        for w in authenticator.warnings():
            log.warning("%s", w)
    link = None
    running_box: dict = {}
    state_applied = trio.Event()
    if control_fd is not None:

        link = Link(stream_from_fd(control_fd), lambda m: None, name=f"worker {worker} control")
        services = build_services(cfg, shared=link)
        link.handler = _control_handler(running_box, services, state_applied)
    else:
        services = build_services(cfg)
    rl = cfg.routing_log
    path = None
    if rl.enabled and rl.path is not None:
        path = worker_log_path(rl.path, worker, workers)
    routelog = RouteLog(path, max_bytes=rl.max_bytes, backup_count=rl.backups,
                        max_field_chars=rl.max_field_chars)
    edge = EdgeContext(EdgeStats(), routelog, authenticator, worker=worker)
    acceptors: dict[str, Acceptor] = {}
    limits: dict[str, ConnectionLimit] = {}
    for acc in cfg.acceptors:
        acceptors[acc.name] = build_acceptor(acceptor_settings(acc), services[acc.router], edge)
        limits[acc.name] = build_limit(acc)
    running = RunningRouter(cfg, services, acceptors, limits, edge, worker=worker, workers=workers)
    running_box["running"] = running
    primary = link is None
    bound: dict[str, list[trio.SocketListener]] = {}

    async def bind(acc: AcceptorConfig, port: int) -> list[trio.SocketListener]:
        try:
            return await open_listeners(acc.host, port, reuse_port=workers > 1)
        except OSError as exc:  # name the address: "Address already in use" alone tells nothing
            raise OSError(exc.errno, f"acceptors.{acc.name}: cannot listen on "
                                     f"{acc.host}:{port}: {exc.strerror}") from None

    def log_path(rl):
        return worker_log_path(rl.path, worker, workers) if rl.enabled and rl.path is not None else None

    reloader = running.reloader = Reloader(
        running, bound=bound, make_settings=acceptor_settings,
        make_acceptor=functools.partial(build_acceptor, edge=edge), make_limit=build_limit,
        make_service=functools.partial(build_router, shared=link),
        open_bound=bind, serve=None, log_path=log_path, ports=dict(ports or {}))

    try:
        async with trio.open_nursery() as system:
            if link is not None:
                await system.start(link.run)
                await _wait_for_state(link, state_applied)
            reloader.system = system
            if primary:   # SIGHUP never ends the process: a reload, refused while starting or draining
                system.start_soon(reload_on_sighup, reloader)
            else:   # a worker: its supervisor answers a SIGHUP sent to the whole group
                system.start_soon(_ignore_sighup)
            for name, service in services.items():
                await system.start(run_watched, reloader.scopes, f"router:{name}", service.run)
            await system.start(routelog.run)
            if any(acc.mode != "redirect" for acc in cfg.acceptors):

                await system.start(SharedPoller().run)

            try:
                for acc in cfg.acceptors:
                    bound[acc.name] = await bind(acc, (ports or {}).get(acc.name, acc.port))
                    running.ports[acc.name] = listener_port(bound[acc.name])
                if primary:

                    running.management_address = await system.start(serve_management, running)
            except BaseException:
                for ls in bound.values():
                    for listener in ls:
                        await listener.aclose()
                raise
            # SIGTERM/SIGINT are caught from before the listening lines: whoever reads them may stop us
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as stop_signals:
                if print_lines and primary:
                    for acc in cfg.acceptors:
                        print_listening(acc.name, _url(acc, acc.host, running.ports[acc.name]))
                    if running.management_address is not None:
                        host, port = running.management_address
                        print_listening("management", f"http://{host}:{port}")
                log.info("router %s worker %d/%d serving %d acceptor(s)", cfg.name, worker, workers, len(bound))
                if link is not None:
                    link.send({"op": "ready", "pid": os.getpid(), "ports": running.ports})
                task_status.started(running)

                with trio.CancelScope() as handlers_scope:
                    async with trio.open_nursery() as handlers:
                        async with trio.open_nursery() as accepting:
                            for acc in cfg.acceptors:
                                a = acceptors[acc.name]
                                accepting.start_soon(run_watched, reloader.scopes, f"acceptor:{acc.name}", _serve_acceptor,
                                                     a, bound[acc.name], handlers, limits[acc.name], edge)
                            accepting.start_soon(_wait_for_signal, stop_signals, accepting.cancel_scope)
                            reloader.accepting = accepting
                            reloader.serve = lambda a, ls, limit: _serve_acceptor(a, ls, handlers, limit, edge)
                            if link is not None:
                                accepting.start_soon(_wait_for_supervisor_exit, link, accepting.cancel_scope)
                        # accepting is over (signal): stop listening, then drain
                        running.draining = True
                        for ls in bound.values():
                            for listener in ls:
                                await trio.aclose_forcefully(listener)
                        active = sum(edge.stats.active.values())
                        log.info("draining: %d connection(s) open, up to %.1fs", active, drain_timeout_s)
                        handlers_scope.deadline = trio.current_time() + drain_timeout_s
                if handlers_scope.cancelled_caught:
                    log.info("drain deadline reached; remaining connections were closed")
            system.cancel_scope.cancel()
    finally:
        for ls in bound.values():  # already closed when draining; not when cancelled
            for listener in ls:
                listener.socket.close()
        await routelog.aclose()
        with trio.CancelScope(shield=True):
            for service in services.values():
                await service.aclose()  # cache file flushed and closed, Redis client released


async def _reload_step(reloader: Reloader, msg: dict) -> dict:
    """A worker's step of the supervisor's reload (``router.reload``); a refusal is the answer's
    error text."""
    try:
        op = msg["op"]
        if op == "reload_prepare":
            return await reloader.prepare_remote(msg["text"], msg["files"], msg["ports"], msg["pools"])
        if op == "reload_commit":
            return await reloader.commit_remote()
        return await reloader.abort_remote()
    except ReloadRefused as exc:
        return {"error": str(exc)}


async def _ignore_sighup() -> None:
    with trio.open_signal_receiver(signal.SIGHUP) as hups:
        async for _ in hups:
            pass


async def _serve_acceptor(acceptor: Acceptor, listeners, handlers: trio.Nursery, limit: ConnectionLimit,
                          edge: EdgeContext) -> None:
    name = acceptor.settings.name
    await serve_listeners(acceptor.handle, listeners, handler_nursery=handlers, limit=limit,
                          on_rejected=lambda: edge.stats.inc(name, "connection_limit_rejected"),
                          on_fd_exhausted=lambda: edge.stats.inc(name, "fd_limit_rejected"),
                          refuse=acceptor.refuse_over_limit)


async def _wait_for_signal(signals, accept_scope: trio.CancelScope) -> None:
    async for signum in signals:
        log.info("received %s: no new connections; draining", signal.Signals(signum).name)
        accept_scope.cancel()
        return


async def _wait_for_state(link, state_applied: trio.Event) -> None:
    """A worker starts serving only with the supervisor's filters and pool applied."""
    async with trio.open_nursery() as nursery:
        async def closed() -> None:
            await link.closed.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(closed)
        await state_applied.wait()
        nursery.cancel_scope.cancel()
    if not state_applied.is_set():
        raise RuntimeError("the supervisor closed the control channel before sending the state")


async def _wait_for_supervisor_exit(link, accept_scope: trio.CancelScope) -> None:
    await link.closed.wait()
    log.warning("the supervisor is gone (control channel closed): no new connections; draining")
    accept_scope.cancel()
