"""Several router worker processes sharing the acceptor ports with ``SO_REUSEPORT``, run as one router.

Theory of operation
-------------------
With ``workers = 1`` (the default) ``lodestone-router run`` is one trio process and this module is
not used. With ``workers = N > 1`` the command becomes a **supervisor** (a trio process that
accepts no client connections) and N **workers** (``python -m router worker ...``) that do:

1. The supervisor picks every acceptor's port (port 0: a placeholder socket bound with
   ``SO_REUSEPORT`` that never listens, so it receives no connections, held for the supervisor's
   lifetime so a restarted worker can always bind it again).
2. It builds the routing services itself — the **owner** of the router's runtime state: one
   health prober per router (brokers see one probe per target per check-period, not N), the
   runtime filters, and the sticky cache (``memory`` or ``embedded``; the embedded file has exactly
   one writer, this process). It serves the management API.
3. Per worker it creates a ``socketpair`` (the control channel, ``router.control``), queues the
   ``state`` message (current filters + pool readiness) and starts the worker with the other end.
   A worker applies the state before it binds, binds every acceptor with ``SO_REUSEPORT`` (the
   kernel spreads connections), then reports ``ready``. Once every worker is ready the supervisor
   prints the ``listening`` lines.
4. While running: every probe round is pushed to every worker (``pool``); a filter PUT on the
   management API is applied here (validation), sent to every live worker (``set_filter``) and
   answered once each confirmed (or timed out, reported in the response); a worker's local cache
   miss asks here (``cache_get``), a new decision is claimed here (``cache_write``,
   compare-and-set) before the client gets it, so the same key lands on the same target
   whichever worker accepts it; the management counters and metrics are summed over the workers
   (``stats``); a worker whose proxy could not connect to a target says so (``upstream_failed``)
   and this process's prober probes that target again at once (rate-limited); a worker that
   routed a connection elsewhere while a target was down says so (``diverted``), which decides
   whether that target is held when it returns (``allow-failback = false``), and a hold or
   readmit on the management API is answered once every worker confirmed it (``sync_pool``).
5. A worker that dies (crash, ``kill -9``) is restarted with the same index (its routing log is
   appended to; it gets the current state first); its open connections are lost, the others keep
   serving. More than ``MAX_RESTARTS`` restarts of one worker within ``RESTART_WINDOW_S`` (a crash
   loop), or a worker that fails before the router was first ready (bad config, port in use),
   stops the router with exit status 1 (2 for a config error). A worker restarted later that
   cannot start because a file its configuration names does not load (status 2: a certificate,
   key, users or pins file broken on disk since) is retried after 2 s, doubled up to 60 s, while
   the others serve; ``/health`` says ``degraded`` (component ``worker``) meanwhile.
6. SIGHUP or ``POST /api/v1/reload``: the supervisor reloads every process in two phases
   (``router.reload.SupervisorReloader``: prepared everywhere, then applied everywhere, or
   refused whole); a worker always runs the configuration text in force, sent first on its
   control channel (``config``), so a restart after a refused reload never runs the broken file.
7. SIGTERM/SIGINT: ``/health`` says draining, SIGTERM goes to every worker (each drains its
   connections for ``--drain-timeout-s``), workers still alive ``KILL_GRACE_S`` after the drain
   timeout are killed, the cache is flushed, exit 0. If the supervisor itself dies, each worker
   sees its control channel close and drains and exits.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys

import trio
from router.server import DEFAULT_DRAIN_TIMEOUT_S
from router.control import ChannelClosed, Link, RemoteFailure, stream_from_socket
from router.net.edge import EdgeContext
from router.net.stats import EdgeStats
from router.routelog import RouteLog
from router.server import RunningRouter
from router.service import build_router, build_services
from broker.wire.io.logsetup import print_listening
from router.management import serve_management
from router.server import _url
from router.reload import (ReloadRefused, SupervisorReloader, apply_routers, changed_pins, new_services,
                           reload_on_sighup, remove_routers, run_watched, stop_services)
from broker.wire.io.users import load_users

log = logging.getLogger("router.workers")

MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0
RESTART_DELAY_S = 0.3
KILL_GRACE_S = 10.0
FILTER_ACK_TIMEOUT_S = 5.0
STATS_TIMEOUT_S = 2.0
CONFIG_RETRY_S = 2.0        # a worker that cannot start on its files: first retry, doubled each time
CONFIG_RETRY_MAX_S = 60.0


def _check_not_listened(acc) -> None:
    """Refuse a fixed port another process listens on, as a router with one worker does: the
    workers bind with SO_REUSEPORT, which would otherwise share the port with that process
    (another router, say) and the kernel would split the clients between the two. A bind with
    SO_REUSEADDR alone fails only on a listening socket (not on old connections in TIME_WAIT)."""
    for family, type_, proto, _c, sockaddr in socket.getaddrinfo(acc.host, acc.port, type=socket.SOCK_STREAM,
                                                                 flags=socket.AI_PASSIVE):
        with socket.socket(family, type_, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                raise OSError(exc.errno, f"acceptors.{acc.name}: cannot listen on {acc.host}:{acc.port}: "
                                         f"{exc.strerror}") from None


def reserve_ports(acceptors) -> tuple[dict[str, int], dict[str, socket.socket]]:
    """Pick the port for each acceptor (``name -> port``); for port 0, bind a placeholder with
    SO_REUSEPORT and return it (``name -> socket``) so the caller keeps it while workers bind
    (and rebind). Raises OSError (the placeholders bound so far closed)."""
    ports: dict[str, int] = {}
    held: dict[str, socket.socket] = {}
    try:
        for acc in acceptors:
            if acc.port != 0:
                _check_not_listened(acc)
                ports[acc.name] = acc.port
                continue
            infos = socket.getaddrinfo(acc.host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, type_, proto, _c, sockaddr = infos[0]
            s = socket.socket(family, type_, proto)
            held[acc.name] = s
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(sockaddr)
            ports[acc.name] = s.getsockname()[1]
    except OSError:
        for s in held.values():
            s.close()
        raise
    return ports, held


class WorkerSlot:
    """One worker index: its current process and control link, restarts so far."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc = None
        self.link = None
        self.pid: int | None = None
        self.ready = False
        self.restarts = 0
        self.restart_times: collections.deque[float] = collections.deque()
        self.text: str | None = None     # the configuration text this process was started with
        self.config_failures = 0         # starts in a row that failed on a file (exit status 2)
        self.failure: str | None = None  # why it is not serving, while it cannot start

    def info(self) -> dict:
        return {"worker": self.index, "pid": self.pid, "ready": self.ready, "restarts": self.restarts}


class Supervisor:
    """The owner of a multi-worker router's state; see the module docstring."""

    def __init__(self, config_path: str, cfg, count: int, ports: dict[str, int], *,
                 worker_args: list[str] | None = None, drain_timeout_s: float | None = None,
                 config_text: str | None = None, placeholders: dict | None = None) -> None:

        self.config_path = config_path
        self.cfg = cfg
        #: the configuration file's content in force: every worker runs it (router.control, config)
        self.config_text = config_text
        self.placeholders: dict[str, socket.socket] = placeholders if placeholders is not None else {}
        self.scopes: dict[str, trio.CancelScope] = {}    # router:<name> -> its service's task
        self.count = count
        self.ports = ports
        self.worker_args = list(worker_args or [])
        self.drain_timeout_s = DEFAULT_DRAIN_TIMEOUT_S if drain_timeout_s is None else drain_timeout_s
        self.slots = [WorkerSlot(i) for i in range(count)]
        self.services: dict = {}
        self.running = None
        self.status = 0
        self.stopping = False
        self.serving = False
        self._stop_event = trio.Event()
        self._all_ready = trio.Event()
        self._system: trio.Nursery | None = None

    # -- management hooks (router.management) ---------------------------------------------------
    def worker_info(self) -> list[dict]:
        """``[{worker, pid, ready, restarts}]`` for the management API."""
        return [s.info() for s in self.slots]

    def failing_workers(self) -> list[dict]:
        """``/health``'s ``degraded`` entries for the workers that cannot start."""
        return [{"component": "worker", "worker": s.index, "error": s.failure} for s in self.slots if s.failure]

    def _live(self) -> list[WorkerSlot]:
        return [s for s in self.slots if s.link is not None and not s.link.closed.is_set()]

    async def gather_stats(self) -> list[dict]:
        """Every ready worker's ``stats`` (``router.server.worker_stats``), by worker index."""
        return sorted(await self._ask_ready("stats", "its counters"), key=lambda st: st["worker"])

    async def gather_recent(self) -> list[dict]:
        """Every ready worker's last routing decisions (``router.dashboard``), oldest first."""
        answers = await self._ask_ready("recent", "its decisions")
        return sorted((d for a in answers for d in a["decisions"]), key=lambda d: d["time"])

    async def _ask_ready(self, op: str, what: str) -> list[dict]:
        """Ask every ready worker ``{"op": op}`` at once; a worker that fails or misses
        STATS_TIMEOUT_S is logged and left out."""
        out: list[dict] = []

        async def ask(slot: WorkerSlot) -> None:
            try:
                out.append(await slot.link.request({"op": op}, timeout_s=STATS_TIMEOUT_S))
            except (ChannelClosed, RemoteFailure, trio.TooSlowError) as exc:
                log.warning("worker %d did not report %s: %s", slot.index, what, exc or "timeout")

        async with trio.open_nursery() as nursery:
            for slot in self._live():
                if slot.ready:
                    nursery.start_soon(ask, slot)
        return out

    async def broadcast_filter(self, router: str, field: str, value) -> dict:
        """Send a filter (already applied and validated here) to every live worker and wait for
        each to confirm. Returns ``{"applied_workers": [...], "failed_workers": [{worker, error}]}``;
        a worker started later gets the filter in its initial state."""
        return await self._confirm_all({"op": "set_filter", "router": router, "field": field, "value": value})

    async def sync_pool(self, router: str) -> dict:
        """Send the router's pool state (holds included) to every live worker and wait for each
        to confirm: a hold or readmit answers once every worker routes by it."""
        return await self._confirm_all({"op": "pool", "router": router,
                                        "states": self.services[router].pool_states()})

    async def _confirm_all(self, msg: dict) -> dict:
        """Send ``msg`` to every live worker and wait for each to confirm (or fail):
        ``{"applied_workers": [...], "failed_workers": [{worker, error}]}``."""
        slots = self._live()
        failed = await self.ask_workers(slots, msg, timeout_s=FILTER_ACK_TIMEOUT_S,
                                        exited="worker exited (a restart applies it)", late="no confirmation")
        bad = {index for index, _ in failed}
        return {"applied_workers": sorted(s.index for s in slots if s.index not in bad),
                "failed_workers": [{"worker": index, "error": error} for index, error in failed]}

    # -- control channel: supervisor side --------------------------------------------------------
    def _state_message(self) -> dict:
        return {"op": "state",
                "filters": {name: {"key_filter": svc.get_key_filter(),
                                   "local_target_filter": svc.get_local_target_filter()}
                            for name, svc in self.services.items()},
                "pools": {name: svc.pool_states() for name, svc in self.services.items()}}

    def _handle(self, slot: WorkerSlot, msg: dict) -> dict | None:
        op = msg.get("op")
        if op == "cache_get":
            return {"value": self.services[msg["router"]].shared_get(msg["key"])}
        if op == "cache_write":
            conflicts = self.services[msg["router"]].shared_write(
                [tuple(p) for p in msg["puts"]], msg["touches"], msg["deletes"])
            return {"conflicts": conflicts}
        if op == "upstream_failed":  # a worker's proxy could not reach a target: probe it now
            svc = self.services.get(msg["router"])
            if svc is not None:
                svc.upstream_failed(str(msg["slot"]), str(msg.get("error") or "upstream failed"))
            return None
        if op == "diverted":  # a worker routed a connection elsewhere while a group was down
            svc = self.services.get(msg["router"])
            if svc is not None:
                svc.pool.note_diverted(str(msg["group"]))
            return None
        if op == "ping":
            return {}
        if op == "ready":
            slot.ready = True
            slot.config_failures, slot.failure = 0, None
            slot.pid = msg.get("pid", slot.pid)
            log.info("worker %d (pid %s) ready", slot.index, slot.pid)
            if all(s.ready for s in self.slots):
                self._all_ready.set()
            return None
        raise ValueError(f"unknown control message {op!r}")

    def _push_pool(self, name: str) -> None:

        msg = {"op": "pool", "router": name, "states": self.services[name].pool_states()}
        for slot in self._live():
            try:
                slot.link.send(msg)
            except ChannelClosed:
                pass

    # -- processes -------------------------------------------------------------------------------
    def _argv(self, index: int, fd: int) -> list[str]:
        return [sys.executable, "-m", "router", "worker", "--index", str(index), "--count", str(self.count),
                "--ports", json.dumps(self.ports), "--control-fd", str(fd), self.config_path, *self.worker_args]

    async def _keep_worker(self, slot: WorkerSlot) -> None:
        """Run worker ``slot.index``; restart it when it dies unexpectedly (see the docstring)."""

        while not self.stopping:
            ours, theirs = socket.socketpair()
            link = Link(stream_from_socket(ours), functools.partial(self._handle, slot),
                        name=f"worker {slot.index} control")
            if self.config_text is None:   # tests that build a Supervisor by hand
                self.config_text = open(self.config_path, encoding="utf-8").read()
            slot.text = self.config_text
            link.send({"op": "config", "text": slot.text})   # read before the worker starts trio
            link.send(self._state_message())  # then the state, before any change sent later
            slot.link, slot.ready = link, False
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run)
                try:
                    proc = await trio.lowlevel.open_process(
                        self._argv(slot.index, theirs.fileno()), pass_fds=(theirs.fileno(),),
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
                except OSError as exc:
                    theirs.close()
                    self._fatal(f"cannot start worker {slot.index}: {exc}", 1)
                    nursery.cancel_scope.cancel()
                    return
                theirs.close()
                slot.proc, slot.pid = proc, proc.pid
                if slot.text != self.config_text:   # a reload applied while it was being started
                    self.restart_worker(slot.index)
                rc = await proc.wait()
                with trio.move_on_after(1.0):
                    await link.closed.wait()  # read what it sent last
                nursery.cancel_scope.cancel()
            was_ready, slot.ready = slot.ready, False
            slot.proc = None
            if self.stopping:
                return
            if rc == 2 and not was_ready and self.serving:
                # its files on disk (certificate, key, users, pins) do not load: it said which. The
                # others serve; retrying at once would only fail again, and stopping the router
                # for it would end every connection of the others
                slot.config_failures += 1
                delay = min(CONFIG_RETRY_MAX_S, CONFIG_RETRY_S * 2 ** (slot.config_failures - 1))
                slot.failure = (f"cannot start: a file its configuration names does not load (its own line "
                                f"in the log says which); trying again in {delay:g}s")
                slot.restarts += 1
                print(f"lodestone-router: worker {slot.index} (pid {slot.pid}) {slot.failure}; the other workers "
                      "serve", file=sys.stderr, flush=True)
                await trio.sleep(delay)
                if self.stopping:
                    return
                continue
            how = f"signal {-rc}" if rc < 0 else f"status {rc}"
            if not self.serving:
                self._fatal(f"worker {slot.index} (pid {slot.pid}) exited with {how} while starting",
                            rc if rc in (1, 2) else 1)
                return
            now = trio.current_time()
            slot.restart_times.append(now)
            while slot.restart_times and now - slot.restart_times[0] > RESTART_WINDOW_S:
                slot.restart_times.popleft()
            if len(slot.restart_times) > MAX_RESTARTS:
                self._fatal(f"worker {slot.index} exited {len(slot.restart_times)} times within "
                            f"{RESTART_WINDOW_S:g}s (last: {how}); stopping the router", 1)
                return
            slot.restarts += 1
            print(f"lodestone-router: worker {slot.index} (pid {slot.pid}) exited with {how}; restarting it",
                  file=sys.stderr, flush=True)
            await trio.sleep(RESTART_DELAY_S)
            if self.stopping:
                return

    def _fatal(self, message: str, status: int) -> None:
        print(f"lodestone-router: {message}", file=sys.stderr, flush=True)
        if not self.status:
            self.status = status
        self._stop()

    def _stop(self) -> None:
        """Stop accepting everywhere: SIGTERM every worker (they drain), kill stragglers later."""
        if self.stopping:
            return
        self.stopping = True
        if self.running is not None:
            self.running.draining = True
        self._stop_event.set()
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                try:
                    slot.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        if self._system is not None:
            self._system.start_soon(self._kill_after, self.drain_timeout_s + KILL_GRACE_S)

    async def _kill_after(self, delay: float) -> None:
        await trio.sleep(delay)
        for slot in self.slots:
            if slot.proc is not None and slot.proc.returncode is None:
                log.warning("worker %d did not exit after draining; killing it", slot.index)
                slot.proc.kill()

    async def _signals(self, signals) -> None:
        async for signum in signals:
            log.info("received %s: stopping the workers (they drain)", signal.Signals(signum).name)
            self._stop()

    # -- reload (router.reload.SupervisorReloader) ---------------------------------------------
    def ready_workers(self) -> list[WorkerSlot]:
        return [s for s in self._live() if s.ready]

    async def ask_workers(self, slots: list[WorkerSlot], msg: dict, *, timeout_s: float,
                          exited: str = "worker exited", late: str = "no answer") -> list[tuple[int, str]]:
        """Send ``msg`` to each of ``slots`` (on its link as it was when asked) and wait for every
        answer; returns ``[(worker, error)]``, sorted, for those that failed, died (``exited``)
        or did not answer in time (``late`` within ``timeout_s``)."""
        failed: list[tuple[int, str]] = []

        async def ask(slot: WorkerSlot, link) -> None:
            try:
                await link.request(msg, timeout_s=timeout_s)
            except ChannelClosed:
                failed.append((slot.index, exited))    # (a restart gets the state in force first)
            except RemoteFailure as exc:
                failed.append((slot.index, str(exc)))
            except trio.TooSlowError:
                failed.append((slot.index, f"{late} within {timeout_s:g}s"))

        async with trio.open_nursery() as nursery:
            for slot in slots:
                nursery.start_soon(ask, slot, slot.link)
        return sorted(failed)

    async def prepare_reload(self, old, new, plan) -> dict:
        """What can fail on the supervisor's side, before any worker is asked: the new routers
        built and started (their first probe round done), changed pins read, and a port (a
        placeholder) for each new acceptor. Raises ReloadRefused with nothing changed."""
        pins = changed_pins(old, new, plan)
        olds = {a.name for a in old.acceptors}
        try:
            ports, held = reserve_ports([a for a in new.acceptors if a.name not in olds])
        except OSError as exc:
            raise ReloadRefused(f"{new.file}: acceptors: cannot reserve a port: {exc.strerror or exc}") from None
        own = {"services": {}, "pins": pins, "ports": ports, "placeholders": held}
        try:
            own["services"] = services = await new_services(old, new, build_router)
            for name, svc in services.items():
                await self._system.start(run_watched, self.scopes, f"router:{name}", svc.run)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.discard_reload(own)
            raise
        return own

    async def discard_reload(self, own: dict) -> None:
        for s in own["placeholders"].values():
            s.close()
        await stop_services(own["services"], self.scopes)

    def apply_reload(self, old, new, plan, own: dict, text: str) -> list[str]:
        """The supervisor's side of a reload, all at once: its routers, the configuration and
        text in force (what a restarted worker runs), the acceptors' ports."""
        reset = apply_routers(self.services, old, new, own)
        for name in own["services"]:
            self._adopt(name, self.services[name])
        remove_routers(self.services, self.scopes, old, new)
        self.cfg = self.running.config = new
        self.config_text = text
        self.ports.update(own["ports"])
        self.placeholders.update(own["placeholders"])
        news = {a.name for a in new.acceptors}
        for name in list(self.ports):
            if name not in news:
                self.ports.pop(name)
                s = self.placeholders.pop(name, None)
                if s is not None:
                    s.close()
        self.running.ports = dict(self.ports)
        for acc in new.acceptors:
            if acc.name in own["ports"]:
                log.info("acceptor %s listening on %s", acc.name, _url(acc, acc.host, self.ports[acc.name]))
        return reset

    def after_reload(self) -> None:
        """Every router's pool to every worker; a worker (re)started during the reload with the
        old text is restarted on the new one (it drains first)."""
        for name in self.services:
            self._push_pool(name)
        for slot in self.slots:
            if slot.text != self.config_text and slot.proc is not None and slot.proc.returncode is None:
                log.warning("worker %d started during the reload; restarting it on the new configuration",
                            slot.index)
                self.restart_worker(slot.index)

    def restart_worker(self, index: int) -> None:
        """SIGTERM one worker (it drains, then ``_keep_worker`` restarts it with the text in force)."""
        slot = self.slots[index]
        if slot.proc is not None and slot.proc.returncode is None:
            try:
                slot.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _adopt(self, name: str, svc) -> None:
        """A router of this supervisor: its probe rounds go to the workers, which hold its
        proxied connections (a drain counts and shares them)."""
        svc.round_listeners.append(functools.partial(self._push_pool, name))
        svc.processes = self.count
        svc.count_proxied = functools.partial(self.count_proxied, name)

    async def count_proxied(self, router: str, group: str) -> tuple[int, int]:
        """Proxied connections to ``group`` held by every worker, and those its drain ended."""
        stats = await self.gather_stats()
        return (sum(st.get("proxied", {}).get(router, {}).get(group, 0) for st in stats),
                sum(st.get("drained", {}).get(router, {}).get(group, 0) for st in stats))

    # -- main ------------------------------------------------------------------------------------
    async def run(self) -> int:
        """Run until signalled (exit status 0) or a fatal worker failure (1, or 2)."""

        cfg = self.cfg
        authenticator = None
        if cfg.users_file is not None:

            authenticator = load_users(cfg.users_file)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            self.services = build_services(cfg)
            edge = EdgeContext(EdgeStats(), RouteLog(None), authenticator, worker=-1)
            self.running = RunningRouter(cfg, self.services, {}, {}, edge, ports=dict(self.ports),
                                         worker=None, workers=self.count, supervisor=self)
            self.running.reloader = SupervisorReloader(self)
            try:
                await self._serve(signals)
            finally:
                with trio.CancelScope(shield=True):
                    for svc in self.services.values():
                        await svc.aclose()  # the cache file's only writer: flushed and closed
        return self.status

    async def _serve(self, signals) -> None:

        cfg = self.cfg
        async with trio.open_nursery() as system:
            self._system = system
            system.start_soon(self._signals, signals)
            system.start_soon(reload_on_sighup, self.running.reloader)
            for name, svc in self.services.items():
                await system.start(run_watched, self.scopes, f"router:{name}", svc.run)  # first probe round done
            for name, svc in self.services.items():
                self._adopt(name, svc)
            self.running.management_address = await system.start(serve_management, self.running)
            async with trio.open_nursery() as keepers:
                for slot in self.slots:
                    keepers.start_soon(self._keep_worker, slot)
                async with trio.open_nursery() as wait:
                    async def on(ev: trio.Event) -> None:
                        await ev.wait()
                        wait.cancel_scope.cancel()

                    wait.start_soon(on, self._all_ready)
                    wait.start_soon(on, self._stop_event)
                if not self.stopping:
                    self.serving = True
                    for acc in cfg.acceptors:
                        print_listening(acc.name, _url(acc, acc.host, self.ports[acc.name]))
                    host, port = self.running.management_address
                    print_listening("management", f"http://{host}:{port}")
                    log.info("router %s: %d workers serving", cfg.name, self.count)
            system.cancel_scope.cancel()


def run_supervisor(config_path: str, cfg, workers: int, *, worker_args: list[str] | None = None,
                   drain_timeout_s: float | None = None, config_text: str | None = None) -> int:
    """Run a supervisor and ``workers`` worker processes until signalled; returns the exit status.
    ``config_text``: the file's content ``cfg`` was read from. Raises what ``trio.run`` raises
    (ConfigError, OSError) for the caller to report."""
    ports, held = reserve_ports(cfg.acceptors)
    sup = Supervisor(config_path, cfg, workers, ports, worker_args=worker_args, drain_timeout_s=drain_timeout_s,
                     config_text=config_text, placeholders=held)
    try:
        return trio.run(sup.run)
    finally:
        for s in sup.placeholders.values():
            s.close()


def default_workers() -> int:
    """Workers that use every core (``workers = 0``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
