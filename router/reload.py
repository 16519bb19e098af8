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

A router with ``workers`` > 1 reloads in two phases (``SupervisorReloader``): the supervisor
reads the file once, plans, starts its new routers and reserves new acceptors' ports, then sends
the text it read to every worker (``reload_prepare``); each worker plans and prepares the same way
(its certificates, its new listeners) and answers. If any step fails anywhere, every prepared
worker is told ``reload_abort`` and the reload is refused whole; otherwise the supervisor applies
its side and tells every worker ``reload_commit``. A worker started later (a restart) runs the
text in force, never the file as it is on disk then (``router.control``, ``config``).
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


class ReloadEntry:
    """What both reloaders share: one lock held for a whole reload (a runtime filter change
    waits for it) and the entry point ``reload``, which logs the outcome."""

    def __init__(self) -> None:
        self._lock = trio.Lock()

    @property
    def lock(self) -> trio.Lock:
        return self._lock

    async def reload(self, cause: str) -> dict:
        """Read the configuration file again and apply it; ``cause`` for the log (``SIGHUP``,
        ``POST /api/v1/reload by admin``). Returns ``{"applied", "summary", "changes",
        "filters_reset"}``; raises :class:`ReloadRefused` (logged) when nothing was changed."""
        async with self._lock:
            try:
                answer = await self._reload()
            except ReloadRefused as exc:
                log.error("reload (%s) refused, the configuration in force stays: %s", cause, exc)
                raise
            log.warning("reload (%s): %s", cause, answer["summary"])
            return answer

    async def _reload(self) -> dict:
        raise NotImplementedError


class Reloader(ReloadEntry):
    """Applies a reloaded configuration to the router ``serve_router`` runs (one process).

    ``serve_router`` fills in the nurseries as it opens them and hands over how it builds an
    acceptor's settings, an acceptor, a router service and an acceptor's accept loop, so this
    module holds no second copy of how a router is built."""

    def __init__(self, running: Any, *, bound: dict, make_settings: Callable, make_acceptor: Callable,
                 make_limit: Callable, make_service: Callable, open_bound: Callable, serve: Callable,
                 log_path: Callable, ports: dict | None = None) -> None:
        self.running = running
        self.bound = bound                       # acceptor name -> its listeners
        self.make_settings = make_settings       # AcceptorConfig -> AcceptorSettings
        self.make_acceptor = make_acceptor       # (AcceptorSettings, service) -> Acceptor
        self.make_limit = make_limit             # AcceptorConfig -> ConnectionLimit
        self.make_service = make_service         # RouterConfig -> RouterService
        self.open_bound = open_bound             # async (AcceptorConfig, port) -> listeners
        self.ports = ports if ports is not None else {}   # a worker: the supervisor's port per acceptor
        self.serve = serve                       # async (Acceptor, listeners, ConnectionLimit) -> None
        self.log_path = log_path                 # RoutingLogConfig -> Path | None
        self.system: trio.Nursery | None = None      # services run here
        self.accepting: trio.Nursery | None = None   # accept loops run here
        self.scopes: dict[str, trio.CancelScope] = {}     # accept loops and services, to stop one
        self.digests = file_digests(running.config)
        super().__init__()
        self._pending: tuple | None = None       # a worker: a prepared reload awaiting its commit

    # -- the entry point: ReloadEntry.reload -> _reload -------------------------------------------
    async def _reload(self) -> dict:
        old: RouterProcessConfig = self.running.config
        self._check_serving()
        new, plan, digests = read_and_plan(old, self.digests)
        prepared = await self._prepare(old, new, plan)
        reset = await self._commit(old, new, plan, prepared, digests)
        return result(plan, reset)

    def _check_serving(self) -> None:
        if self.running.config.file is None:
            raise ReloadRefused("this router was not started from a configuration file")
        if self.running.draining or self.accepting is None:
            raise ReloadRefused("the router is starting or draining; try again once it serves")

    async def _commit(self, old, new, plan, prepared, digests) -> list[str]:
        reset = self._apply(old, new, plan, prepared)
        self.running.config = new
        self.digests = digests
        await self._apply_routing_log(old, new)
        return reset

    # -- a worker of a multi-worker router: the supervisor's two phases ------------------------
    async def prepare_remote(self, text: str, files: dict, ports: dict, pools: dict) -> dict:
        """``reload_prepare``: plan and prepare the configuration ``text`` the supervisor read
        (``files``: the digests it saw; ``ports``: the port of each acceptor it added; ``pools``:
        its new routers' first probe results). Nothing changes until ``commit_remote``. The three
        steps hold the reload lock: an abort that arrives while a slow prepare runs waits for it
        and then discards what it prepared."""
        async with self._lock:
            await self._abort()
            self._check_serving()
            old: RouterProcessConfig = self.running.config
            new, plan, digests = read_and_plan(old, self.digests, text.encode("utf-8"))
            moved = sorted(p for p in set(files) | set(digests) if files.get(p) != digests.get(p))
            if moved:
                raise ReloadRefused(f"{', '.join(moved)}: changed while the reload was read; reload again")
            self.ports.update(ports)
            prepared = await self._prepare(old, new, plan)
            for name, states in pools.items():
                if name in prepared["services"]:
                    prepared["services"][name].apply_pool_states(states)
            self._pending = (old, new, plan, prepared, digests)
            return {"changes": len(plan.changes)}

    async def commit_remote(self) -> dict:
        """``reload_commit``: apply what ``prepare_remote`` prepared."""
        async with self._lock:
            if self._pending is None:
                raise ReloadRefused("no reload prepared")
            old, new, plan, prepared, digests = self._pending
            self._pending = None
            if self.running.config is not old:
                await self._discard(prepared["services"], prepared["listeners"])
                raise ReloadRefused("the configuration changed since the reload was prepared")
            reset = await self._commit(old, new, plan, prepared, digests)
            log.warning("reload (by the supervisor): %s", plan.summary())
            return {"filters_reset": reset}

    async def abort_remote(self) -> dict:
        """``reload_abort``: discard what ``prepare_remote`` prepared (after it finished)."""
        async with self._lock:
            await self._abort()
            return {}

    async def _abort(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            await self._discard(pending[3]["services"], pending[3]["listeners"])

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
        services = await new_services(old, new, self.make_service)
        try:
            pins = changed_pins(old, new, plan)
        except ReloadRefused:
            await self._discard(services, {})
            raise
        olds = {a.name for a in old.acceptors}
        listeners: dict[str, list] = {}
        try:
            for acc in new.acceptors:
                if acc.name not in olds:
                    listeners[acc.name] = await self.open_bound(acc, self.ports.get(acc.name, acc.port))
        except OSError as exc:
            await self._discard(services, listeners)
            raise ReloadRefused(f"{new.file}: {exc.strerror or exc}") from None
        for name, svc in services.items():     # nothing can fail after this: they start serving
            await self._start_service(name, svc)
        return {"settings": settings, "services": services, "listeners": listeners, "pins": pins}

    async def _discard(self, services: dict, listeners: dict) -> None:
        """Undo a prepare: close its listeners, stop its routers (started or not)."""
        for ls in listeners.values():
            for listener in ls:
                await listener.aclose()
        await stop_services(services, self.scopes)

    # -- all at once (no checkpoint in between) ----------------------------------------------
    def _apply(self, old: RouterProcessConfig, new: RouterProcessConfig, plan: ReloadPlan,
               prepared: dict) -> list[str]:
        running = self.running
        reset = apply_routers(running.services, old, new, prepared)
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
        remove_routers(running.services, self.scopes, old, new)
        return reset

    async def _apply_routing_log(self, old: RouterProcessConfig, new: RouterProcessConfig) -> None:
        if old.routing_log == new.routing_log:
            return
        rl = new.routing_log
        await self.running.edge.routelog.reconfigure(self.log_path(rl), max_bytes=rl.max_bytes,
                                                     backup_count=rl.backups, max_field_chars=rl.max_field_chars)

    # -- tasks -------------------------------------------------------------------------------------
    def _start_accepting(self, name: str, acceptor, listeners) -> None:
        self.accepting.start_soon(run_watched, self.scopes, f"acceptor:{name}", self.serve, acceptor, listeners,
                                  self.running.limits[name])

    async def _start_service(self, name: str, svc) -> None:
        """Start a new router and wait for its first probe round (as at start)."""
        await self.system.start(run_watched, self.scopes, f"router:{name}", svc.run)


class SupervisorReloader(ReloadEntry):
    """The supervisor's side of a multi-worker reload (see the module docstring): one file read,
    prepared here and in every worker, then applied everywhere or nowhere. The supervisor
    (``router.workers.Supervisor``) supplies its own steps: ``prepare_reload``,
    ``discard_reload``, ``apply_reload`` and ``ask_workers``."""

    #: how long a worker may take to prepare (certificates, listeners) or to commit
    STEP_TIMEOUT_S = 30.0

    def __init__(self, supervisor: Any) -> None:
        self.sup = supervisor
        self.digests = file_digests(supervisor.cfg)
        super().__init__()

    async def _reload(self) -> dict:
        sup = self.sup
        old: RouterProcessConfig = sup.cfg
        if old.file is None:
            raise ReloadRefused("this router was not started from a configuration file")
        if sup.stopping or not sup.serving:
            raise ReloadRefused("the router is starting or draining; try again once it serves")
        try:
            data = Path(old.file).read_bytes()
        except OSError as exc:
            raise ReloadRefused(str(ConfigError(old.file, "", f"cannot read: {exc.strerror}"))) from None
        new, plan, digests = read_and_plan(old, self.digests, data)
        text = data.decode("utf-8")     # it loaded: UTF-8
        own = await sup.prepare_reload(old, new, plan)
        slots = sup.ready_workers()
        applied = False
        try:
            failed = await sup.ask_workers(slots, {
                "op": "reload_prepare", "text": text, "files": digests, "ports": own["ports"],
                "pools": {name: svc.pool_states() for name, svc in own["services"].items()}},
                timeout_s=self.STEP_TIMEOUT_S)
            if failed:
                raise ReloadRefused("; ".join(f"worker {i}: {err}" for i, err in failed))
            links = {s.index: s.link for s in slots}     # a restart meanwhile has another link
            reset = sup.apply_reload(old, new, plan, own, text)
            applied = True
        finally:
            if not applied:      # refused, or a bug: nothing of it stays anywhere
                with trio.CancelScope(shield=True):
                    await sup.ask_workers(slots, {"op": "reload_abort"}, timeout_s=self.STEP_TIMEOUT_S)
                    await sup.discard_reload(own)
        self.digests = digests
        failed = await sup.ask_workers(slots, {"op": "reload_commit"}, timeout_s=self.STEP_TIMEOUT_S)
        restarted = [index for index, _ in failed]
        for s in slots:
            if s.index not in restarted and s.link is links[s.index]:
                s.text = text                           # this process now runs the new text
        for index, err in failed:   # a bug, or it died: it must not serve the old configuration
            log.error("worker %d did not apply the reload (%s); restarting it on the new configuration",
                      index, err)
            sup.restart_worker(index)
        sup.after_reload()
        return result(plan, reset, workers={"applied": sorted(s.index for s in slots if s.index not in restarted),
                                            "restarted": restarted})


async def run_watched(scopes: dict, key: str, fn, *args, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run ``fn(*args)`` — or, without ``args``, a service's ``fn(task_status=…)``, started once
    its first probe round is done — in a cancel scope kept as ``scopes[key]`` (``router:<name>``,
    ``acceptor:<name>``), so a reload can stop that one router or accept loop."""
    with trio.CancelScope() as scope:
        scopes[key] = scope
        if args:
            task_status.started()
            await fn(*args)
        else:
            await fn(task_status=task_status)


async def new_services(old: RouterProcessConfig, new: RouterProcessConfig, make_service: Callable) -> dict:
    """The routers ``new`` adds, built (not started); ReloadRefused if one cannot be built."""
    services = {}
    for name, rc in new.routers.items():
        if name not in old.routers:
            try:
                services[name] = make_service(rc)
            except Exception as exc:  # noqa: BLE001 - a cache file, a Redis URL...: refused whole
                for svc in services.values():
                    await svc.aclose()
                raise ReloadRefused(f"{new.file}: routers.{name}: {exc}") from None
    return services


def changed_pins(old: RouterProcessConfig, new: RouterProcessConfig, plan: ReloadPlan) -> dict:
    """The pin tables of the kept routers whose pins changed (file or content), read and checked
    now; ReloadRefused if one has no valid pin."""
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
                raise ReloadRefused(f"{new.file}: routers.{name}.pins: {exc}") from None
    return pins


def apply_routers(services: dict, old: RouterProcessConfig, new: RouterProcessConfig, prepared: dict) -> list[str]:
    """Add the new routers (``prepared["services"]``) to ``services`` and reconfigure the kept
    ones; returns the routers whose runtime filters were set back to the file's values."""
    reset = []
    for name, svc in prepared["services"].items():
        services[name] = svc
    for name, rc in new.routers.items():
        svc = services[name]
        if name in old.routers:
            was = old.routers[name]
            if (svc.get_key_filter() != was.key_filter or
                    svc.get_local_target_filter() != was.local_target_filter):
                reset.append(name)          # set at runtime (PUT): the file's value again
            svc.reconfigure(rc, pins=prepared["pins"].get(name))
    return reset


async def stop_services(services: dict, scopes: dict) -> None:
    """Stop routers started for a reload that did not apply: their tasks (``scopes``), then
    their resources."""
    for name, svc in services.items():
        scope = scopes.pop(f"router:{name}", None)
        if scope is not None:
            scope.cancel()
        await svc.aclose()


def remove_routers(services: dict, scopes: dict, old: RouterProcessConfig, new: RouterProcessConfig) -> None:
    """Stop the routers ``new`` no longer has (their tasks run in ``scopes["router:<name>"]``)."""
    for name in old.routers:
        if name not in new.routers:
            scope = scopes.pop(f"router:{name}", None)
            if scope is not None:
                scope.cancel()
            services.pop(name, None)


def read_and_plan(old: RouterProcessConfig, old_digests: dict, data: bytes | None = None):
    """Read the configuration file (``data``: its content, already read) and plan the reload
    from ``old``: ``(new, plan, digests)``; raises ReloadRefused (an invalid file, a change that
    cannot apply live)."""
    try:
        new = load_router_config(old.file, data)
    except ConfigError as exc:
        raise ReloadRefused(str(exc)) from None
    digests = file_digests(new)
    plan = plan_reload(old, new, old_files=old_digests, new_files=digests)
    if not plan.ok:
        raise ReloadRefused(f"{new.file}: {plan.summary()}")
    return new, plan, digests


def result(plan: ReloadPlan, reset: list[str], **extra: Any) -> dict:
    """The answer of an applied reload (``POST /api/v1/reload``), also its log line's summary."""
    summary = plan.summary()
    if reset:
        summary += f"; runtime filters set back to the file's ({', '.join(reset)})"
    return {"applied": True, "summary": summary, "changes": [str(c) for c in plan.changes],
            "filters_reset": reset, **extra}


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
