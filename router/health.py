"""Health probes feeding a pool's readiness (run by ``RouterService.run``).

Each target is probed by its own task: at once (initial delay 0), then ``check-period`` ms after
its previous probe finished (fixed delay, as Artemis's ``TargetMonitor``), each probe with its own
timeout, so a slow target never holds back the others:

* with a ``management_url``: HTTP/1.1 ``GET <management_url>/api/v1/broker`` with Basic auth
  (the pool's username/password), JSON body ``{"node_id", "active", "connection_count", ...}``.
  Ready iff status 200 and ``active`` is true; ``node_id`` is learned from the body and
  ``connection_count`` kept for LEAST_CONNECTIONS.
* without one (targets imported from an Artemis broker.xml): a TCP connect; ready iff it connects.

Any error (refused, timeout, TLS, bad status, bad JSON) makes the target not ready at once and the
error text is kept for the management API.

Sooner than check-period (``ProbeKicks``):

* **re-probe on an upstream failure**: when the proxy cannot connect to a target the service
  marks it not ready and *kicks* its probe task, which probes again at once — but never while a
  probe of it is in flight (the kick is kept and served when that probe ends, whose answer may
  predate the failure) and never sooner than ``REPROBE_MIN_INTERVAL_S`` after the previous probe
  started: a flood of failing connections is at most one probe per target per 100 ms;
* **a pair failing over** (no member of an HA pair ready, ``Pool.failing_over_slots``): its
  members are probed at once, then every 100 ms doubling to ``FAILOVER_PROBE_MAX_S`` (never
  slower than check-period) until one is ready, so the router routes to the backup as soon as
  its probe answers ``active``. The HTTP client is ``broker.wire.io.http``'s (h11 over
``trio.open_tcp_stream``, TLS via ``trio.SSLStream`` for https URLs).

With ``workers = N`` only the supervisor probes (``router.workers``): it pushes each probe's
result to every worker, so brokers see one probe per target per check-period, not N.
"""

from __future__ import annotations

import base64
import json
import ssl
from dataclasses import dataclass
from typing import Callable

import h11
import trio

from broker.wire.io.http import get_json_url
from router.core.policies.base import Target
from router.core.pool import Pool

MAX_BODY = 1 << 20
REPROBE_MIN_INTERVAL_S = 0.1  # a target's probes start at least this far apart when hurried
FAILOVER_PROBE_MAX_S = 1.0    # a failing-over pair's members: 0.1 s doubling to this


class ProbeKicks:
    """Requests to probe a target now, from the shell (``RouterService.upstream_failed``) to
    the probe task of that target in :func:`run_health_checks`. ``kick`` never blocks; kicks of
    one target coalesce into its next probe (see the module docstring)."""

    def __init__(self) -> None:
        self._events: dict[str, trio.Event] = {}
        self.kicks = 0

    def kick(self, slot: str) -> None:
        """Probe the target in ``slot`` as soon as its rate limit allows."""
        self.kicks += 1
        self.event(slot).set()

    def event(self, slot: str) -> trio.Event:
        ev = self._events.get(slot)
        if ev is None:
            ev = self._events[slot] = trio.Event()
        return ev

    def rearm(self, slot: str) -> None:
        """A probe of ``slot`` starts: kicks from now on ask for the one after it."""
        self._events[slot] = trio.Event()

    def forget(self, slot: str) -> None:
        self._events.pop(slot, None)


@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    node_id: str | None = None
    connection_count: int | None = None
    error: str | None = None


async def http_get(url: str, *, headers: list[tuple[str, str]] = (), timeout_s: float = 2.0,
                   ssl_context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    """GET ``url`` over HTTP/1.1 (``Connection: close``); returns (status, body). Raises on error.

    ``broker.wire.io.http.get_json_url`` with the probes' body limit (one HTTP client in the code
    base); https URLs use ``ssl_context`` or the system trust store.
    """
    return await get_json_url(url, headers=headers, timeout_s=timeout_s, ssl_context=ssl_context,
                              max_body_bytes=MAX_BODY)


def basic_auth(username: str | None, password: str | None) -> list[tuple[str, str]]:
    if username is None:
        return []
    token = base64.b64encode(f"{username}:{password or ''}".encode()).decode("ascii")
    return [("Authorization", f"Basic {token}")]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, trio.TooSlowError):
        return "timeout"
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


async def probe_target(target: Target, *, username: str | None = None,
                       password: str | None = None, timeout_s: float = 2.0,
                       ssl_context: ssl.SSLContext | None = None) -> ProbeResult:
    """Probe one target once (never raises: errors become ``ok=False`` with the error text)."""
    if target.management_url is None:
        try:
            with trio.fail_after(timeout_s):
                s = await trio.open_tcp_stream(target.host, target.port)
            await trio.aclose_forcefully(s)
            return ProbeResult(True)
        except (OSError, trio.TooSlowError) as exc:
            return ProbeResult(False, error=f"tcp connect: {_describe(exc)}")
    url = target.management_url.rstrip("/") + "/api/v1/broker"
    try:
        status, body = await http_get(url, headers=basic_auth(username, password),
                                      timeout_s=timeout_s, ssl_context=ssl_context)
    except (OSError, trio.TooSlowError, trio.BrokenResourceError, h11.ProtocolError, ValueError,
            ssl.SSLError) as exc:
        return ProbeResult(False, error=f"GET {url}: {_describe(exc)}")
    if status != 200:
        return ProbeResult(False, error=f"GET {url}: HTTP {status}")
    try:
        info = json.loads(body)
        if not isinstance(info, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        return ProbeResult(False, error=f"GET {url}: bad JSON: {exc}")
    node_id = info.get("node_id")
    count = info.get("connection_count")
    node_id = node_id if isinstance(node_id, str) and node_id else None
    count = count if isinstance(count, int) and not isinstance(count, bool) else None
    if info.get("active") is not True:
        return ProbeResult(False, node_id, count, error=f"GET {url}: broker not active")
    if info.get("journal_error"):   # it cannot store a durable send until it is restarted
        return ProbeResult(False, node_id, count, error=f"GET {url}: the broker's journal failed: "
                                                       f"{str(info['journal_error'])[:300]}")
    return ProbeResult(True, node_id, count)


async def run_health_checks(pool: Pool, *, check_period_ms: int, username: str | None = None,
                            password: str | None = None, clock: Callable[[], float],
                            ssl_context: ssl.SSLContext | None = None,
                            on_round: Callable[[], None] | None = None,
                            credentials: dict[str, tuple[str | None, str | None]] | None = None,
                            probe_local: bool = True, kicks: ProbeKicks | None = None,
                            task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Probe every target of ``pool``, each in its own task; never returns.

    As Artemis's ``TargetMonitor`` (one ``ActiveMQScheduledComponent`` per target, initial delay
    0, ``scheduleWithFixedDelay(check-period)``): each target is probed at once, then
    ``check_period_ms`` after its previous probe *finished*, with its own timeout
    (``min(check-period, 2 s)``), so a slow or hung target delays only itself. ``on_round`` is
    called after each probe result (the supervisor then pushes the pool to its workers).
    ``started()`` is reported once every target present at start has a first result.
    Targets that join or leave the pool (a dynamic membership source) get or lose their task
    as soon as the pool changes.
    ``credentials`` maps a target's name to its own (username, password), overriding the pool's.
    ``probe_local = False``: the local target is not probed (a router inside a broker: the
    broker sets its own readiness).
    ``kicks``: re-probe requests (an upstream failure), and the members of a pair that is failing
    over are probed sooner (module docstring).
    """
    period = check_period_ms / 1000.0
    timeout = min(period, 2.0)
    if kicks is None:
        kicks = ProbeKicks()

    def state(slot: str):
        for st in pool.all_states():
            if st.target.slot == slot:
                return st
        return None

    async def probe_forever(slot: str, first_done: Callable[[], None]) -> None:
        hurry: float | None = None  # the current interval while the target's pair fails over
        while True:
            st = state(slot)
            if st is None:  # left the pool
                first_done()
                kicks.forget(slot)
                return
            target = st.target
            user, pw = (credentials or {}).get(target.name, (username, password))
            kicks.rearm(slot)
            started = trio.current_time()
            res = await probe_target(target, username=user, password=pw,
                                     timeout_s=timeout, ssl_context=ssl_context)
            pool.report_probe(slot, res.ok, res.node_id, res.connection_count, clock(),
                              error=res.error)
            first_done()
            if on_round is not None:
                on_round()
            # the next probe: check-period after this one finished (fixed delay); sooner while
            # its pair fails over, or when kicked (an upstream failure, a pair that just lost
            # its last active member)
            if slot in pool.failing_over_slots():
                hurry = REPROBE_MIN_INTERVAL_S if hurry is None else min(hurry * 2,
                                                                         FAILOVER_PROBE_MAX_S)
                delay = min(period, hurry)
            else:
                hurry, delay = None, period
            ev = kicks.event(slot)
            with trio.move_on_after(delay):
                await ev.wait()
            if ev.is_set():
                hurry = None
            # never two probes of one target closer than REPROBE_MIN_INTERVAL_S
            rest = started + REPROBE_MIN_INTERVAL_S - trio.current_time()
            if rest > 0:
                await trio.sleep(rest)

    async with trio.open_nursery() as nursery:
        tasks: dict[str, trio.CancelScope] = {}
        def probed() -> set[str]:
            return {st.target.slot for st in pool.all_states() if probe_local or not st.local}

        pending = probed()
        all_first = trio.Event()
        if not pending:
            all_first.set()

        def first_done_for(slot: str) -> Callable[[], None]:
            def done() -> None:
                pending.discard(slot)
                if not pending:
                    all_first.set()
            return done

        async def run_one(slot: str, scope: trio.CancelScope) -> None:
            with scope:
                await probe_forever(slot, first_done_for(slot))
            if tasks.get(slot) is scope:
                del tasks[slot]

        def reconcile() -> None:
            slots = probed()
            for slot in slots - tasks.keys():
                scope = tasks[slot] = trio.CancelScope()
                nursery.start_soon(run_one, slot, scope)
            for slot in set(tasks) - slots:
                tasks.pop(slot).cancel()

        changed = trio.Event()
        failing: set[str] = set()

        def on_pool_change(_pool: Pool) -> None:
            nonlocal failing
            changed.set()
            now_failing = pool.failing_over_slots()
            for slot in now_failing - failing:  # a pair lost its last active member
                kicks.kick(slot)
            failing = now_failing

        reconcile()
        await all_first.wait()
        task_status.started()
        failing = pool.failing_over_slots()
        pool.listeners.append(on_pool_change)
        try:
            while True:
                # a target that joins is probed at once, one that leaves loses its task at once
                with trio.move_on_after(period):
                    await changed.wait()
                changed = trio.Event()
                reconcile()
        finally:
            pool.listeners.remove(on_pool_change)
