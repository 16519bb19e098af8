"""Hot reload of a running router: ``SIGHUP`` and ``POST /api/v1/reload`` (docs/router.md, "Reload").

The configuration file is read again and compared with the one in force
(``router.core.reload.plan_reload``; certificate, key and pins files by the SHA-256 of their
content). The reload is all or nothing:

* a file that does not load (the one-line error of a start: file, key, value), a change that
  cannot apply live, a certificate that does not load or an acceptor address that cannot be
  bound refuses the whole reload, and the configuration in force stays;
* otherwise every change is applied at once, between two connections' steps (trio runs one task
  at a time): new routers start, changed routers take their filters, policy, pins, cache
  settings and pool (``RouterService.reconfigure``), changed acceptors their settings and
  certificates (``Acceptor.reconfigure``), new acceptors listen, removed ones stop listening,
  the routing log moves; then removed routers stop.

No established connection is touched: a proxied connection keeps its broker, a connection in its
handshake finishes with the settings it started with, a removed acceptor's connections run on.
The runtime filters (``PUT .../key-filter``) are set back to the file's values, and the answer
says so. One log line lists what changed (or why nothing did).

A router with ``workers`` > 1 is not reloaded yet: its reload is refused with a message that
says so (the configuration in force stays).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, Callable

import trio

from broker.wire.io.tomlconfig import ConfigError
from router.config import RouterProcessConfig, load_router_config
from router.core.reload import ReloadPlan, plan_reload
from router.errors import PinFileError
from router.service import load_pins

log = logging.getLogger("router.reload")


class ReloadRefused(Exception):
    """Why a reload was refused (``str``: one line); the configuration in force stays."""


def file_digests(cfg: RouterProcessConfig) -> dict[str, str | None]:
    """SHA-256 of every file whose content a reload compares (certificates, keys, CAs, pins);
    None for a file that cannot be read."""
    paths = []
    for a in cfg.acceptors:
        paths += [a.tls_cert, a.tls_key, a.tls_client_ca, a.upstream_ca]
    for rc in cfg.routers.values():
        if rc.pins is not None:
            paths.append(rc.pins.file)
    out: dict[str, str | None] = {}
    for p in paths:
        if p is None or str(p) in out:
            continue
        try:
            out[str(p)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
        except OSError:
            out[str(p)] = None
    return out


class Reloader:
    """Applies a reloaded configuration to the router ``serve_router`` runs (one process).

    ``serve_router`` fills in the nurseries as it opens them and hands over how it builds an
    acceptor's settings, an acceptor, a router service and an acceptor's accept loop, so this
    module holds no second copy of how a router is built."""

    def __init__(self, running: Any, *, bound: dict, make_settings: Callable, make_acceptor: Callable,
                 make_limit: Callable, make_service: Callable, open_bound: Callable, serve: Callable,
                 log_path: Callable) -> None:
        self.running = running
        self.bound = bound                       # acceptor name -> its listeners
        self.make_settings = make_settings       # AcceptorConfig -> AcceptorSettings
        self.make_acceptor = make_acceptor       # (AcceptorSettings, service) -> Acceptor
        self.make_limit = make_limit             # AcceptorConfig -> ConnectionLimit
        self.make_service = make_service         # RouterConfig -> RouterService
        self.open_bound = open_bound             # async AcceptorConfig -> listeners
        self.serve = serve                       # async (Acceptor, listeners, ConnectionLimit) -> None
        self.log_path = log_path                 # RoutingLogConfig -> Path | None
        self.system: trio.Nursery | None = None      # services run here
        self.accepting: trio.Nursery | None = None   # accept loops run here
        self.scopes: dict[str, trio.CancelScope] = {}     # accept loops and services, to stop one
        self.digests = file_digests(running.config)
        self._lock = trio.Lock()

    # -- the entry points ------------------------------------------------------------------------
    async def reload(self, cause: str) -> dict:
        """Read the configuration file again and apply it; ``cause`` for the log (``SIGHUP``,
        ``POST /api/v1/reload by admin``). Returns ``{"applied", "summary", "changes"}``; raises
        :class:`ReloadRefused` (logged) when nothing was changed."""
        async with self._lock:
            try:
                result = await self._reload()
            except ReloadRefused as exc:
                log.error("reload (%s) refused, the configuration in force stays: %s", cause, exc)
                raise
            log.warning("reload (%s): %s", cause, result["summary"])
            return result

    async def _reload(self) -> dict:
        running = self.running
        old: RouterProcessConfig = running.config
        if running.workers > 1:
            raise ReloadRefused(f"{old.file}: workers = {running.workers}: a router with more than one "
                                "worker cannot reload yet; restart it")
        if old.file is None:
            raise ReloadRefused("this router was not started from a configuration file")
        if running.draining or self.accepting is None:
            raise ReloadRefused("the router is starting or draining; try again once it serves")
        try:
            new = load_router_config(old.file)
        except ConfigError as exc:
            raise ReloadRefused(str(exc)) from None
        digests = file_digests(new)
        plan = plan_reload(old, new, old_files=self.digests, new_files=digests)
        if not plan.ok:
            raise ReloadRefused(f"{new.file}: {plan.summary()}")
        prepared = await self._prepare(old, new, plan)
        reset = self._apply(old, new, plan, prepared)
        running.config = new
        self.digests = digests
        await self._apply_routing_log(old, new)
        summary = plan.summary()
        if reset:
            summary += f"; runtime filters set back to the file's ({', '.join(reset)})"
        return {"applied": True, "summary": summary, "changes": [str(c) for c in plan.changes],
                "filters_reset": reset}

    # -- before anything changes: what can still fail -----------------------------------------
    async def _prepare(self, old: RouterProcessConfig, new: RouterProcessConfig, plan: ReloadPlan) -> dict:
        changed = {c.part.split(".")[1] for c in plan.changes if c.part.startswith("acceptors.")}
        settings = {}
        for acc in new.acceptors:
            if acc.name in changed:
                try:
                    settings[acc.name] = self.make_settings(acc)
                except (OSError, ValueError) as exc:   # ssl.SSLError is an OSError
                    raise ReloadRefused(f"{new.file}: acceptors.{acc.name}: cannot load its TLS files: {exc}") \
                        from None
        services = {}
        for name, rc in new.routers.items():
            if name not in old.routers:
                try:
                    services[name] = self.make_service(rc)
                except Exception as exc:  # noqa: BLE001 - a cache file, a Redis URL...: refused whole
                    for svc in services.values():
                        await svc.aclose()
                    raise ReloadRefused(f"{new.file}: routers.{name}: {exc}") from None
        pins = {}
        for name, rc in new.routers.items():
            if name in old.routers and rc.pins is not None and any(
                    c.part.startswith(f"routers.{name}.pins") for c in plan.changes):
                bad: list[str] = []
                try:
                    pins[name] = load_pins(rc.pins.file, bad_lines=bad)
                    if bad and not pins[name]:      # as the pins loop: a bad line loses only itself
                        raise PinFileError(f"no valid pin: {'; '.join(bad[:3])}")
                except PinFileError as exc:
                    await self._discard(services, {})
                    raise ReloadRefused(f"{new.file}: routers.{name}.pins: {exc}") from None
        olds = {a.name for a in old.acceptors}
        listeners: dict[str, list] = {}
        try:
            for acc in new.acceptors:
                if acc.name not in olds:
                    listeners[acc.name] = await self.open_bound(acc)
        except OSError as exc:
            await self._discard(services, listeners)
            raise ReloadRefused(f"{new.file}: {exc.strerror or exc}") from None
        for name, svc in services.items():     # nothing can fail after this: they start serving
            await self._start_service(name, svc)
        return {"settings": settings, "services": services, "listeners": listeners, "pins": pins}

    @staticmethod
    async def _discard(services: dict, listeners: dict) -> None:
        for ls in listeners.values():
            for listener in ls:
                await listener.aclose()
        for svc in services.values():
            await svc.aclose()

    # -- all at once (no checkpoint in between) ----------------------------------------------
    def _apply(self, old: RouterProcessConfig, new: RouterProcessConfig, plan: ReloadPlan,
               prepared: dict) -> list[str]:
        running = self.running
        reset = []
        for name, svc in prepared["services"].items():
            running.services[name] = svc
        for name, rc in new.routers.items():
            svc = running.services[name]
            if name in old.routers:
                was = old.routers[name]
                if (svc.get_key_filter() != was.key_filter or
                        svc.get_local_target_filter() != was.local_target_filter):
                    reset.append(name)          # set at runtime (PUT): the file's value again
                svc.reconfigure(rc, pins=prepared["pins"].get(name))
        olds = {a.name: a for a in old.acceptors}
        for acc in new.acceptors:
            if acc.name in olds:
                if acc.name in prepared["settings"]:
                    running.acceptors[acc.name].reconfigure(prepared["settings"][acc.name], running.services[acc.router])
                    running.limits[acc.name].limit = acc.max_connections or None
                continue
            a = self.make_acceptor(prepared["settings"][acc.name], running.services[acc.router])
            running.acceptors[acc.name] = a
            running.limits[acc.name] = self.make_limit(acc)
            ls = prepared["listeners"][acc.name]
            self.bound[acc.name] = ls
            running.ports[acc.name] = ls[0].socket.getsockname()[1]
            self._start_accepting(acc.name, a, ls)
            log.info("acceptor %s listening on %s:%d", acc.name, acc.host, running.ports[acc.name])
        news = {a.name for a in new.acceptors}
        for name in olds:
            if name not in news:
                scope = self.scopes.pop(f"acceptor:{name}", None)
                if scope is not None:
                    scope.cancel()      # its accept loop ends; its connections run on in the handlers
                for listener in self.bound.pop(name, []):
                    listener.socket.close()
                running.ports.pop(name, None)
                log.info("acceptor %s no longer listening (its connections run on)", name)
        for name in old.routers:
            if name not in new.routers:
                scope = self.scopes.pop(f"router:{name}", None)
                if scope is not None:
                    scope.cancel()
                running.services.pop(name, None)
        return reset

    async def _apply_routing_log(self, old: RouterProcessConfig, new: RouterProcessConfig) -> None:
        if old.routing_log == new.routing_log:
            return
        rl = new.routing_log
        await self.running.edge.routelog.reconfigure(self.log_path(rl), max_bytes=rl.max_bytes,
                                                     backup_count=rl.backups, max_field_chars=rl.max_field_chars)

    # -- tasks -------------------------------------------------------------------------------------
    def _start_accepting(self, name: str, acceptor, listeners) -> None:
        limit = self.running.limits[name]

        async def accept() -> None:
            with trio.CancelScope() as scope:
                self.scopes[f"acceptor:{name}"] = scope
                await self.serve(acceptor, listeners, limit)

        self.accepting.start_soon(accept)

    async def _start_service(self, name: str, svc) -> None:
        """Start a new router and wait for its first probe round (as at start)."""
        async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:
                self.scopes[f"router:{name}"] = scope
                await svc.run(task_status=task_status)

        await self.system.start(run)

    def watch(self, key: str, scope: trio.CancelScope) -> None:
        """``serve_router``'s own accept loops and services (``acceptor:<name>``,
        ``router:<name>``), so a reload can stop one."""
        self.scopes[key] = scope


async def reload_on_sighup(reloader: Reloader) -> None:
    """Each ``SIGHUP`` reloads (a refused reload is logged; the router serves on)."""
    import signal
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            try:
                await reloader.reload("SIGHUP")
            except ReloadRefused:
                pass
            except Exception:   # a bug in one reload must not stop the router
                log.exception("reload (SIGHUP) failed")
