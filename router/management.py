"""The router's management HTTP API (JSON over HTTP/1.1 on ``broker.wire.io.http``), OpenAPI described.

Routes (``/openapi.json`` has the full document; docs/router.md has examples):

=======  ==============================================  ==============================================
GET      /health                                         liveness + degraded I/O components (open, no credentials)
GET      /api/v1/router                                  process summary: name, worker(s), acceptors, routers
POST     /api/v1/reload                                  read the configuration file again, apply it all or nothing
GET      /api/v1/routers                                 every router: config, filters, pool readiness
GET      /api/v1/routers/{r}                             one router
GET      /api/v1/routers/{r}/target?key=K                Artemis ``getTargetAsJSON`` + outcome + explanation
GET/PUT  /api/v1/routers/{r}/key-filter                  ``{"key_filter": "regex" | null}``
GET/PUT  /api/v1/routers/{r}/local-target-filter         ``{"local_target_filter": "regex" | null}``
GET      /api/v1/routers/{r}/pool                        targets (ready, node id, connections), quorum
GET      /api/v1/routers/{r}/cache?limit=&after=         sticky-cache entries, one page (key order)
POST     /api/v1/routers/{r}/targets/{t}/hold            hold a target out of routing (planned switchover)
POST     /api/v1/routers/{r}/targets/{t}/readmit         let a held target take connections (failback)
POST     /api/v1/routers/{r}/targets/{t}/drain           move a target's clients elsewhere (router.drain)
POST     /api/v1/routers/{r}/targets/{t}/undrain         let a drained target take new connections
GET      /api/v1/counters                                edge counters (total and per acceptor) + routers'
GET      /                                               the dashboard (router.dashboard), HTML
GET      /api/v1/dashboard                               what the dashboard draws: pools, rates, decisions, brokers
GET      /metrics                                        Prometheus text format
GET      /openapi.json                                   this API as OpenAPI 3.0
=======  ==============================================  ==============================================

Credentials: HTTP Basic. With ``[management] user``/``password`` those are checked; otherwise,
with a users file, any user holding the ``manage`` permission on ``activemq.management`` (as on the
broker). With neither, the API is open — it binds to 127.0.0.1 by default.

Like Artemis' ``getTargetAsJSON``, the target lookup runs the router's decision for the raw key
(no key filter), populates the sticky cache as a side effect and names the same target a real
connection with that key gets.

With ``workers = N`` the API is served by the supervisor (``running.supervisor``) and answers for the
whole router: counters and metrics are summed over the workers (``per_worker`` in
``/api/v1/counters`` breaks them down), pool, filters and sticky cache are the supervisor's (the
one prober, the filters every worker follows, the cache every worker shares), and a filter PUT
returns once every live worker confirmed it (``applied_workers`` / ``failed_workers``).
"""

from __future__ import annotations

import contextlib
import hmac
import inspect
import logging
import re
import time
from urllib.parse import unquote, urlsplit
from typing import Any

import trio

from collections import Counter
from dataclasses import dataclass, field

from broker.wire.io.http import HttpError, Metric, Request, Response, json_response, metrics_response, require_basic_auth, serve_http
from router.core.cache import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from router.core.decide import Decision, Outcome
from router.dashboard import STATIC, ClusterView, recent_decisions, static_response
from router.net.edge.context import RECENT_DECISIONS
from router.errors import FilterError
from router.fdlimit import fd_limit, open_fd_count
from router.net.stats import COUNTER_NAMES, EdgeStats
from router.reload import ReloadRefused
from broker.wire.io.http import basic_auth

log = logging.getLogger("router.management")

MANAGEMENT_ADDRESS = "activemq.management"
_ROUTE = re.compile(r"^/api/v1/routers/([^/]+)(/[a-z-]+)?$")
_TARGET_OP = re.compile(r"^/api/v1/routers/([^/]+)/targets/([^/]+)/(hold|readmit|drain|undrain)$")


def _drain_options(request: Request) -> dict:
    """The optional body of ``POST .../drain``: ``{"rate-per-s": R, "grace-ms": G}`` (the
    pool's ``drain-rate-per-s`` / ``drain-grace-ms`` when absent)."""
    if not request.body:
        return {}
    body = request.json()
    if body is None:
        return {}
    if not isinstance(body, dict) or set(body) - {"rate-per-s", "grace-ms"}:
        raise HttpError(400, 'body must be {"rate-per-s": <number>, "grace-ms": <integer>} (both optional)')
    out = {}
    rate = body.get("rate-per-s")
    if rate is not None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.01 <= rate <= 100000:
            raise HttpError(400, f"rate-per-s: {rate!r} must be a number from 0.01 to 100000")
        out["rate_per_s"] = float(rate)
    grace = body.get("grace-ms")
    if grace is not None:
        if isinstance(grace, bool) or not isinstance(grace, int) or grace < 0:
            raise HttpError(400, f"grace-ms: {grace!r} must be an integer >= 0")
        out["grace_ms"] = grace
    return out


async def serve_management(running, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve the management API for a ``RunningRouter``; ``task_status.started((host, port))``."""
    cfg = running.config.management
    api = ManagementApi(running)
    await serve_http(api.handle, cfg.host, cfg.port, task_status=task_status)


_READ_ONLY = frozenset({"/health", "/openapi.json", "/metrics", "/api/v1/router", "/api/v1/routers",
                        "/api/v1/counters", "/api/v1/dashboard", *STATIC})


@dataclass
class Aggregate:
    """What the counter views read: one process's numbers, or the sum over every worker."""

    stats: EdgeStats
    routers: dict[str, dict[str, int]]
    lines_written: int = 0
    lines_dropped: int = 0
    per_worker: list[dict] | None = None
    log_write_errors: int = 0
    failing: list[dict] = field(default_factory=list)
    open_fds: int | None = None
    fd_limit: int | None = None
    processes: list[dict] | None = field(default=None)
    logins: dict[str, int] = field(default_factory=dict)   # broker.wire.io.login.LoginGate counters
    #: router → group → connections proxied to it now (every process)
    proxied: dict[str, dict[str, int]] = field(default_factory=dict)


def aggregate_workers(reports: list[dict], services: dict) -> Aggregate:
    """Sum the workers' ``stats`` reports (``router.server.worker_stats``) and the supervisor's
    own service counters (probe rounds, persistence, management lookups)."""
    stats = EdgeStats()
    routers: dict[str, Counter] = {name: Counter(dict(svc.counters)) for name, svc in services.items()}
    written = dropped = errors = 0
    failing: list[dict] = []
    fds = 0
    per_worker = []
    logins: Counter = Counter()
    proxied: dict[str, Counter] = {}
    for rep in reports:
        logins.update(rep.get("logins", {}))
        for name, groups in rep.get("proxied", {}).items():
            proxied.setdefault(name, Counter()).update(groups)
        mine = EdgeStats()
        for a, n, v in rep["counters"]:
            stats.counters[(a, n)] += v
            mine.counters[(a, n)] += v
        for attr in ("active", "bytes_up", "bytes_down"):
            getattr(stats, attr).update(rep[attr])
        for name, counts in rep["routers"].items():
            routers.setdefault(name, Counter()).update(counts)
        written += rep["routing_log"][0]
        dropped += rep["routing_log"][1]
        errors += rep["routing_log"][2] if len(rep["routing_log"]) > 2 else 0
        io = rep.get("io", {})
        failing += [{**f, "worker": rep["worker"]} for f in io.get("failing", [])]
        fds += io.get("open_fds") or 0
        per_worker.append({"worker": rep["worker"], "pid": rep["pid"], "edge": mine.totals(),
                           "active_connections": sum(rep["active"].values()), "routers": rep["routers"],
                           "routing_log": {"lines_written": rep["routing_log"][0],
                                           "lines_dropped": rep["routing_log"][1]}})
    return Aggregate(stats, {n: dict(c) for n, c in routers.items()}, written, dropped, per_worker,
                     log_write_errors=errors, failing=failing, open_fds=fds, logins=dict(logins),
                     proxied={n: dict(c) for n, c in proxied.items()})


class RouterResources:
    """The ``/api/v1/routers`` resources over a set of ``RouterService``s: the router process's
    (``ManagementApi``) or a broker's embedded routers (``broker.management``). Subclasses give
    ``services`` (name → service), ``router_configs`` (name → RouterConfig) and may override
    ``broadcast_filter`` (a multi-worker router's supervisor confirms a filter with its workers).
    """

    services: dict
    router_configs: dict

    async def broadcast_filter(self, name: str, field: str, value) -> dict | None:
        return None

    async def sync_pool(self, name: str) -> dict | None:
        return None

    async def handle_routers(self, request: Request, path: str) -> Response | None:
        """Answer ``/api/v1/routers`` and ``/api/v1/routers/{r}/...`` (the caller authorized
        the request); None for any other path."""
        if path == "/api/v1/routers":
            if request.method not in ("GET", "HEAD"):
                raise HttpError(405, f"{request.method} not allowed on {path} (GET)", [("Allow", "GET")])
            return json_response([self.router_view(n) for n in self.services])
        m = _TARGET_OP.match(path)
        if m:
            return await self._target_op(request, path, *m.groups())
        m = _ROUTE.match(path)
        if not m:
            return None
        name, sub = m.group(1), m.group(2) or ""
        service = self.services.get(name)
        if service is None:
            raise HttpError(404, f"no router named {name!r} (routers: {', '.join(self.services)})")
        if sub == "" and request.method == "GET":
            return json_response(self.router_view(name))
        if sub == "/target" and request.method == "GET":
            key = request.query.get("key")
            if key is None:
                raise HttpError(400, "missing query parameter: key")
            too_long = getattr(service, "key_too_long", None)
            reason = too_long(key) if too_long is not None else None
            if reason is not None:  # refused as a connection with that key would be
                raise HttpError(400, f"router {name!r} refuses this key: {reason}")
            return json_response(await self.target_for_key(name, key))
        if sub in ("/key-filter", "/local-target-filter"):
            field = sub[1:].replace("-", "_")
            if request.method == "GET":
                return json_response({field: self._get_filter(service, field)})
            if request.method == "PUT":
                return json_response(await self._put_filter(name, service, field, request))
            raise HttpError(405, f"{request.method} not allowed on {path} (GET, PUT)")
        if sub == "/pool" and request.method == "GET":
            return json_response(self.pool_view(name))
        if sub == "/cache" and request.method == "GET":
            return json_response(self.cache_view(name, request.query))
        if request.method != "GET":
            raise HttpError(405, f"{request.method} not allowed on {path}")
        raise HttpError(404, f"no such resource: {path}")

    async def _target_op(self, request: Request, path: str, name: str, target: str, op: str) -> Response:
        """``POST .../targets/<t>/hold`` and ``/readmit`` (no automatic failback,
        docs/site-failover.md), ``/drain`` and ``/undrain`` (``router.drain``): 200 with the
        pool, 404 for an unknown router or target, 409 for a hold or drain that would leave no
        target ready."""
        service = self.services.get(name)
        if service is None:
            raise HttpError(404, f"no router named {name!r} (routers: {', '.join(self.services)})")
        if request.method != "POST":
            raise HttpError(405, f"{request.method} not allowed on {path} (POST)", [("Allow", "POST")])
        target = unquote(target)
        if service.pool.group_of(target) is None:
            raise HttpError(404, f"router {name!r} has no target named {target!r}")
        try:
            if op == "drain":
                out = service.drain_target(target, **_drain_options(request))
            elif op == "undrain":
                out = service.undrain_target(target)
            else:
                out = service.readmit_target(target) if op == "readmit" else service.hold_target(target)
        except ValueError as exc:
            raise HttpError(409, str(exc)) from None
        workers = await self.sync_pool(name)  # several workers: answered once each routes by it
        if workers is not None:
            out.update(workers)
        return json_response(out)

    def router_view(self, name: str) -> dict:
        service = self.services[name]
        rc = self.router_configs.get(name)
        out = {
            "name": name,
            "key_type": rc.key_type.value if rc is not None else None,
            "key_filter": self._get_filter(service, "key_filter"),
            "local_target_filter": self._get_filter(service, "local_target_filter"),
            "policy": (rc.policy.name if rc is not None and rc.policy is not None else None),
            "policy_properties": dict(rc.policy.properties) if rc is not None and rc.policy is not None else {},
            "degraded": bool(getattr(service, "degraded", False)),
            "degraded_reason": getattr(service, "degraded_reason", None),
            # bounded load (CONSISTENT_HASH + LOAD_FACTOR): live assignments per target slot
            "live_assignments": getattr(service, "live_assignments", None),
        }
        out.update({"pool": self.pool_view(name)})
        return out

    def pool_view(self, name: str) -> dict | None:
        service = self.services[name]
        pool = getattr(service, "pool", None)
        if pool is None:
            return None
        snap = pool.snapshot() if hasattr(pool, "snapshot") else {}
        if getattr(service, "drains", None):
            snap["drains"] = service.drain_views()   # draining targets: what is left to move
        membership = getattr(service, "membership_status", None)
        if membership is not None and membership() is not None:
            snap["membership"] = membership()  # a dynamic source: where it reads, last error
        return snap

    def cache_view(self, name: str, query: dict | None = None) -> Any:
        """One page of the sticky cache: ``limit`` entries (default DEFAULT_PAGE_SIZE, at most
        MAX_PAGE_SIZE) with keys after ``after``, in key order; ``next`` is the cursor for the
        following page (null on the last one)."""
        query = query or {}
        raw_limit = query.get("limit")
        try:
            limit = DEFAULT_PAGE_SIZE if raw_limit is None else int(raw_limit)
        except ValueError:
            raise HttpError(400, f"limit: {raw_limit[:40]!r} is not an integer") from None
        if not 1 <= limit <= MAX_PAGE_SIZE:
            raise HttpError(400, f"limit: {limit} must be between 1 and {MAX_PAGE_SIZE}")
        after = query.get("after") or None
        service = self.services[name]
        if getattr(service, "core", None) is None or service.core.cache is None:
            return {"enabled": False, "total": 0, "entries": [], "next": None}
        return {"enabled": True, **service.cache_page(after=after, limit=limit)}

    async def target_for_key(self, name: str, key: str) -> dict:
        service = self.services[name]
        decision = service.route_for_key(key)
        if inspect.isawaitable(decision):
            decision = await decision
        rc = self.router_configs.get(name)
        imported = {tc.name: (tc.connector_params, tc.connector_extra)
                    for tc in (rc.pool.targets if rc is not None and rc.pool is not None else ())
                    if tc.connector_params is not None}
        return target_json(decision, imported)

    # -- filters ---------------------------------------------------------------------------------
    @staticmethod
    def _filter_accessors(service, field: str):
        get_name = "get_key_filter" if field == "key_filter" else "get_local_target_filter"
        set_name = "set_key_filter" if field == "key_filter" else "set_local_target_filter"
        for obj in (service, getattr(service, "router", None)):
            if obj is not None and hasattr(obj, get_name) and hasattr(obj, set_name):
                return getattr(obj, get_name), getattr(obj, set_name)
        raise HttpError(500, f"router service has no {field} accessors")

    def _get_filter(self, service, field: str):
        get, _ = self._filter_accessors(service, field)
        return get()

    async def _put_filter(self, name: str, service, field: str, request: Request) -> dict:
        body = request.json()
        if not isinstance(body, dict) or field not in body:
            raise HttpError(400, f'body must be {{"{field}": "<regex>"}} or {{"{field}": null}}')
        value = body[field]
        if value is not None and not isinstance(value, str):
            raise HttpError(400, f"{field} must be a string or null")
        lock = getattr(getattr(self.running, "reloader", None), "lock", None)
        async with lock if lock is not None else contextlib.nullcontext():   # never inside a reload
            if self.services.get(name) is not service:
                raise HttpError(404, f"no router named {name!r} (a reload removed it)")
            return await self._set_filter(name, service, field, value)

    async def _set_filter(self, name: str, service, field: str, value) -> dict:
        _, setter = self._filter_accessors(service, field)
        try:
            setter(value)
        except (FilterError, ValueError) as exc:
            raise HttpError(400, f"{field}: {exc}") from None
        get, _ = self._filter_accessors(service, field)
        log.info("%s set to %r via management", field, get())
        out = {field: get()}
        confirmed = await self.broadcast_filter(name, field, get())
        if confirmed is not None:
            out.update(confirmed)
            if out["failed_workers"]:
                log.warning("%s of router %s not confirmed by %s", field, name, out["failed_workers"])
        return out


class ManagementApi(RouterResources):
    """Request handler over a ``router.server.RunningRouter``."""

    def __init__(self, running):
        self.running = running
        self.cluster = ClusterView()

    @property
    def cfg(self):
        """The configuration in force (a reload replaces it)."""
        return self.running.config

    @property
    def services(self) -> dict:
        return self.running.services

    @property
    def router_configs(self) -> dict:
        return self.cfg.routers

    async def sync_pool(self, name: str) -> dict | None:
        if self.running.supervisor is None:
            return None
        return await self.running.supervisor.sync_pool(name)

    async def broadcast_filter(self, name: str, field: str, value) -> dict | None:
        if self.running.supervisor is None:
            return None
        return await self.running.supervisor.broadcast_filter(name, field, value)

    # -- auth ------------------------------------------------------------------------------------
    async def _check(self, user: str, password: str, source: str | None) -> bool:
        """Basic credentials: the ``[management]`` user, else a users-file user with the manage
        permission. Failures are throttled and delayed like AMQP logins (``broker.wire.io.login``)."""
        gate = self.running.edge.login_gate
        m = self.cfg.management
        if m.user is not None:
            ok = hmac.compare_digest(user.encode(), m.user.encode()) and \
                hmac.compare_digest(password.encode(), (m.password or "").encode())
            if not ok and gate is not None:
                await gate.failed(source, trio.current_time())
            return ok
        auth = self.running.edge.authenticator
        if auth is None:
            return True
        if gate is None:  # pragma: no cover - an authenticator that is not a users file
            principal = await trio.to_thread.run_sync(auth.authenticate, user, password, source)
        else:
            principal = (await gate.login(user, password, source)).principal
        return principal is not None and auth.check(principal, "manage", MANAGEMENT_ADDRESS)

    def _auth_required(self) -> bool:
        return self.cfg.management.user is not None or self.running.edge.authenticator is not None

    async def _authorize(self, request: Request) -> None:
        if not self._auth_required():
            return

        creds = basic_auth(request)
        ok = creds is not None and await self._check(creds[0], creds[1], request.client)
        require_basic_auth(request, lambda u, p: ok, realm="lodestone-router")

    # -- dispatch --------------------------------------------------------------------------------
    # (the resources that only answer GET; the per-router ones check their methods below)
    async def handle(self, request: Request) -> Response:
        path = request.path.rstrip("/") or "/"
        if path in _READ_ONLY and request.method not in ("GET", "HEAD"):
            raise HttpError(405, f"{request.method} not allowed on {path} (GET)", [("Allow", "GET")])
        if path == "/health":
            return json_response(*await self.health())
        if path == "/openapi.json":
            return json_response(openapi_document())
        await self._authorize(request)
        if request.method not in ("GET", "HEAD"):
            _same_origin(request)
        page = static_response(path)
        if page is not None:
            return page
        if path == "/api/v1/dashboard":
            return json_response(await self.dashboard())
        if path == "/metrics":
            return metrics_response(self.metrics(await self.aggregate()))
        if path == "/api/v1/router":
            return json_response(self.summary(await self.aggregate()))
        if path == "/api/v1/counters":
            return json_response(self.counters(await self.aggregate()))
        if path == "/api/v1/reload":
            return await self.reload(request)
        resp = await self.handle_routers(request, path)
        if resp is not None:
            return resp
        raise HttpError(404, f"no such resource: {path}")

    async def reload(self, request: Request) -> Response:
        if request.method != "POST":
            raise HttpError(405, f"{request.method} not allowed on /api/v1/reload (POST)", [("Allow", "POST")])
        reloader = getattr(self.running, "reloader", None)
        if reloader is None:
            raise HttpError(409, "reload refused, the configuration in force stays: this process does not reload")
        who = basic_auth(request)
        try:
            return json_response(await reloader.reload(f"POST /api/v1/reload by {who[0] if who else 'anonymous'}"))
        except ReloadRefused as exc:
            raise HttpError(409, f"reload refused, the configuration in force stays: {exc}") from None

    # -- views -----------------------------------------------------------------------------------
    async def aggregate(self) -> Aggregate:
        """This process's numbers, or (supervisor of several workers) the sum over the workers."""
        r = self.running
        own = io_status(r)
        if r.supervisor is None:
            return Aggregate(r.edge.stats, {name: dict(getattr(svc, "counters", None) or {})
                                            for name, svc in r.services.items()},
                             r.edge.routelog.lines_written, r.edge.routelog.lines_dropped,
                             log_write_errors=r.edge.routelog.write_errors,
                             failing=own["failing"], open_fds=own["open_fds"],
                             fd_limit=own["fd_limit"],
                             logins=dict(r.edge.login_gate.counters) if r.edge.login_gate else {},
                             proxied={name: {g: len(c) for g, c in getattr(svc, "proxied", {}).items()}
                                      for name, svc in r.services.items()})
        agg = aggregate_workers(await r.supervisor.gather_stats(), r.services)
        if r.edge.login_gate is not None:   # the supervisor's own (management) logins
            for k, v in r.edge.login_gate.counters.items():
                agg.logins[k] = agg.logins.get(k, 0) + v
        agg.processes = r.supervisor.worker_info()
        agg.failing = own["failing"] + agg.failing  # the supervisor's cache file, then workers'
        agg.fd_limit = own["fd_limit"]
        agg.open_fds = (agg.open_fds or 0) + (own["open_fds"] or 0)
        return agg

    async def dashboard(self) -> dict:
        """``GET /api/v1/dashboard``: what the page at ``/`` draws (``router.dashboard``)."""
        r = self.running
        agg = await self.aggregate()
        status, failing = self._status(agg)
        decisions = await r.supervisor.gather_recent() if r.supervisor is not None else recent_decisions(r)
        routers = []
        for name in list(self.services):
            view = self.router_view(name)
            view["counters"] = agg.routers.get(name, {})
            view["proxied"] = agg.proxied.get(name, {})
            routers.append(view)
        return {"time": round(time.time(), 3), "name": self.cfg.name,
                "status": status, "degraded": failing,
                "summary": self.summary(agg), "edge": agg.stats.totals(), "routers": routers,
                "decisions": decisions[-RECENT_DECISIONS:], "cluster": await self.cluster.read(self.services)}

    def summary(self, agg: Aggregate | None = None) -> dict:
        r = self.running
        stats = agg.stats if agg is not None else r.edge.stats
        out = {
            "name": self.cfg.name,
            "worker": r.worker,
            "workers": r.workers,
            "draining": r.draining,
            "acceptors": [{"name": a.name, "mode": a.mode, "router": a.router, "host": a.host,
                           "port": r.ports.get(a.name, a.port), "tls": a.tls_cert is not None,
                           "mtls": a.tls_client_ca is not None, "max_connections": a.max_connections,
                           "active_connections": stats.active[a.name]}
                          for a in self.cfg.acceptors],
            "routers": list(r.services),
        }
        if agg is not None and agg.processes is not None:
            out["processes"] = agg.processes
        return out

    async def health(self) -> tuple[dict, int]:
        """``/health``: ``ok``, ``degraded`` (still serving, 200: some I/O component — routing
        log, cache file, Redis — is failing and being retried; ``degraded`` lists them) or
        ``draining`` (503)."""
        status, failing = self._status(await self.aggregate())
        return {"status": status, "router": self.cfg.name, "degraded": failing}, \
            503 if self.running.draining else 200

    def _status(self, agg: Aggregate) -> tuple[str, list[dict]]:
        """The process's status and its failing components: every process's I/O failures (the
        supervisor's, then each worker's) and a worker that cannot start on its files."""
        r = self.running
        failing = list(agg.failing)
        if r.supervisor is not None:
            failing += r.supervisor.failing_workers()
        return ("draining" if r.draining else "degraded" if failing else "ok"), failing

    def counters(self, agg: Aggregate) -> dict:
        r = self.running
        out = {"worker": r.worker, "workers": r.workers, "edge": agg.stats.totals(),
               "acceptors": agg.stats.by_acceptor(a.name for a in self.cfg.acceptors),
               "routers": agg.routers,
               "routing_log": {"lines_written": agg.lines_written, "lines_dropped": agg.lines_dropped}}
        out["routing_log"]["write_errors"] = agg.log_write_errors
        out["io"] = {"failing": agg.failing, "open_fds": agg.open_fds, "fd_limit": agg.fd_limit}
        if agg.per_worker is not None:
            out["per_worker"] = agg.per_worker
        return out

    # -- metrics ---------------------------------------------------------------------------------
    def metrics(self, agg: Aggregate) -> list[Metric]:
        r = self.running
        stats = agg.stats
        ms = [Metric("lodestone_router_edge_events_total", "counter",
                     "Edge events per acceptor (see docs/router.md for each event)",
                     tuple(({"acceptor": a, "event": e}, v) for (a, e), v in sorted(stats.counters.items()))),
              Metric("lodestone_router_active_connections", "gauge", "Open client connections per acceptor",
                     tuple(({"acceptor": a.name}, stats.active[a.name]) for a in self.cfg.acceptors)),
              Metric("lodestone_router_proxied_bytes_total", "counter", "Bytes proxied per acceptor and direction",
                     tuple(({"acceptor": a.name, "direction": "client_to_broker"}, stats.bytes_up[a.name])
                           for a in self.cfg.acceptors) +
                     tuple(({"acceptor": a.name, "direction": "broker_to_client"}, stats.bytes_down[a.name])
                           for a in self.cfg.acceptors)),
              Metric("lodestone_router_routing_log_lines_total", "counter", "Routing-log lines written",
                     (({}, agg.lines_written),)),
              Metric("lodestone_router_routing_log_dropped_total", "counter",
                     "Routing-log lines dropped because the writer fell behind",
                     (({}, agg.lines_dropped),)),
              Metric("lodestone_router_logins_total", "counter",
                     "Password logins by outcome (edge and management; see docs/security.md)",
                     tuple(({"outcome": k}, v) for k, v in sorted(agg.logins.items()))),
              Metric("lodestone_router_routing_log_write_errors_total", "counter",
                     "Routing-log writes/rotations that failed (ENOSPC, EMFILE, EIO...; retried)",
                     (({}, agg.log_write_errors),)),
              Metric("lodestone_router_degraded", "gauge",
                     "1 per I/O component currently failing (routing_log, cache_file, redis); 0 = healthy",
                     tuple(({"component": c}, int(any(f["component"] == c for f in agg.failing)))
                           for c in ("routing_log", "cache_file", "redis"))),
              Metric("lodestone_router_open_fds", "gauge", "Open file descriptors (summed over the router's processes)",
                     (({}, agg.open_fds or 0),)),
              Metric("lodestone_router_fd_limit", "gauge", "RLIMIT_NOFILE soft limit (per process)",
                     (({}, agg.fd_limit or 0),))]
        ready, total, quorum, target_ready, pair_states, target_held = [], [], [], [], [], []
        service_counters = []
        for name, service in r.services.items():
            pool = getattr(service, "pool", None)
            if pool is not None:
                ready.append(({"router": name}, pool.ready_count))
                total.append(({"router": name}, pool.total_count))
                quorum.append(({"router": name}, 1 if pool.quorum_met else 0))
                for st in pool.all_states():
                    t = st.target
                    target_held.append(({"router": name, "target": t.name or f"{t.host}:{t.port}"},
                                        1 if st.held else 0))
                    target_ready.append(({"router": name, "target": t.name or f"{t.host}:{t.port}",
                                          "node_id": t.node_id or ""}, 1 if st.ready else 0))
                if pool.pair_count:
                    for p in pool.pairs():
                        for state in ("serving", "failing_over", "split_brain"):
                            pair_states.append(({"router": name, "pair": p["name"], "state": state},
                                                1 if p["state"] == state else 0))
            for cname, v in sorted(agg.routers.get(name, {}).items()):
                service_counters.append(({"router": name, "event": str(cname)}, v))
        ms += [Metric("lodestone_router_pool_ready_targets", "gauge", "Ready targets per router", tuple(ready)),
               Metric("lodestone_router_pool_targets", "gauge", "Targets per router", tuple(total)),
               Metric("lodestone_router_pool_quorum_met", "gauge", "1 when the pool has its quorum", tuple(quorum)),
               Metric("lodestone_router_target_ready", "gauge", "1 when a target is ready", tuple(target_ready)),
               Metric("lodestone_router_target_held", "gauge", "1 when a target is held out of "
                      "routing (allow-failback = false, or an operator's hold)", tuple(target_held)),
               Metric("lodestone_router_pair_state", "gauge", "1 for each HA pair's current state: serving, "
                      "failing_over (no member active), split_brain (several active)", tuple(pair_states)),
               Metric("lodestone_router_routing_events_total", "counter", "Routing-core events per router",
                      tuple(service_counters)),
               Metric("lodestone_router_redis_miss_read_share", "gauge",
                      "Share of local cache misses that read Redis (redis_reads / (redis_reads + "
                      "redis_reads_skipped)); 1 when none was skipped",
                      tuple(({"router": name}, _share(c.get("redis_reads", 0), c.get("redis_reads_skipped", 0)))
                            for name, c in agg.routers.items()
                            if getattr(r.services.get(name), "remote_tier", None) == "redis"))]
        return ms


def _same_origin(request: Request) -> None:
    """A browser's request that changes something must come from a page of this API (the
    dashboard): with HTTP Basic, a browser would otherwise send its cached credentials with a
    form another site posts here. Clients that are not browsers send neither header."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise HttpError(403, f"cross-site request refused (Sec-Fetch-Site: {site[:40]})")
    origin = request.headers.get("origin")
    if origin is None:
        return
    host = request.headers.get("host")
    if host is None or urlsplit(origin).netloc.lower() != host.lower():
        raise HttpError(403, f"cross-origin request refused: Origin {origin[:100]!r} is not this API ({host!r})")


def _share(done: int, skipped: int) -> float:
    return round(done / (done + skipped), 4) if done + skipped else 1.0


NETTY_CONNECTOR_FACTORY = "org.apache.activemq.artemis.core.remoting.impl.netty.NettyConnectorFactory"


def _masked(params: dict) -> dict:
    # Deliberately unlike Artemis (whose toJson shows them): no secret leaves through the API
    return {k: ("***" if k.endswith("Password") else v) for k, v in params.items()}


def connector_json(t, imported: tuple | None = None) -> dict:
    """A remote target as Artemis's ``TransportConfiguration.toJson()`` of the netty connector
    ``tcp://host:port[?sslEnabled=true]`` named after the target.

    Artemis builds a connector from its URL with ``TCPTransportConfigurationSchema``:
    ``BeanSupport.setData`` puts ``"host"`` and ``"port"`` as *strings* (``"" + uri.getPort()``)
    and each allowed query key with its string value (``sslEnabled`` only when the URL has it);
    ``extraProps`` holds the query keys a connector does not know (none here).
    """
    if imported is not None:  # a broker.xml connector: the params Artemis built from its URL
        params, extra = dict(imported[0]), dict(imported[1])
    else:
        params, extra = {"host": t.host, "port": str(int(t.port))}, {}
        if t.tls:
            params["sslEnabled"] = "true"
    return {"name": t.name or f"{t.host}:{t.port}", "factoryClassName": NETTY_CONNECTOR_FACTORY,
            "params": _masked(params), "extraProps": _masked(extra)}


def target_json(decision: Decision, connectors: dict | None = None) -> dict:
    """Artemis ``getTargetAsJSON`` shape (``nodeID``, ``local``, ``connector``) plus Lodestone's
    extensions ``outcome``, ``target`` and ``explanation``.

    As ``ConnectionRouterControlImpl.getTargetAsJSON``: a local target has ``"connector": null``,
    a remote one its connector (``connector_json``). Where Artemis returns ``null`` (a refusing
    result) we answer ``nodeID``/``connector`` null, ``local`` false, with the outcome and why.
    """
    t = decision.target if decision.outcome is Outcome.OK else None
    connector = None
    if t is not None and not decision.local:
        connector = connector_json(t, (connectors or {}).get(t.name))
    return {"nodeID": t.node_id if t is not None else None,
            "local": bool(decision.local) if t is not None else False,
            "connector": connector,
            "outcome": decision.outcome.value,
            "target": None if t is None else {"name": t.name, "node_id": t.node_id, "host": t.host,
                                              "port": t.port, "tls": t.tls},
            "explanation": decision.explanation.to_dict()}


def openapi_document() -> dict:
    """The OpenAPI 3.0 description of this API."""
    def op(summary: str, schema: dict | None = None, *, params: list | None = None, body: dict | None = None,
           auth: bool = True, body_required: bool = True) -> dict:
        o: dict = {"summary": summary, "responses": {"200": {"description": "OK", "content": {
            "application/json": {"schema": schema or {"type": "object"}}}}}}
        if params:
            o["parameters"] = params
        if body:
            o["requestBody"] = {"required": body_required, "content": {"application/json": {"schema": body}}}
            o["responses"]["400"] = {"description": "invalid body or regular expression"}
        if auth:
            o["responses"]["401"] = {"description": "credentials required"}
        else:
            o["security"] = []
        return o

    router_param = {"name": "router", "in": "path", "required": True, "schema": {"type": "string"}}
    target_param = {"name": "target", "in": "path", "required": True, "schema": {"type": "string"}}
    nullable_str = {"type": "string", "nullable": True}
    target_schema = {"type": "object", "properties": {
        "nodeID": nullable_str, "local": {"type": "boolean"},
        "connector": {"type": "object", "nullable": True, "properties": {
            "name": {"type": "string"}, "factoryClassName": {"type": "string"},
            "params": {"type": "object"}, "extraProps": {"type": "object"}}},
        "outcome": {"type": "string", "enum": [o.value for o in Outcome]},
        "target": {"type": "object", "nullable": True},
        "explanation": {"type": "object"}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "Lodestone router management API", "version": "1"},
        "components": {"securitySchemes": {"basic": {"type": "http", "scheme": "basic"}}},
        "security": [{"basic": []}],
        "paths": {
            "/health": {"get": op("Liveness: status ok | degraded (200; degraded lists the failing I/O "
                                  "components: routing_log, cache_file, redis) | draining (503)", {
                                      "type": "object", "properties": {
                                          "status": {"type": "string", "enum": ["ok", "degraded", "draining"]},
                                          "router": {"type": "string"},
                                          "degraded": {"type": "array", "items": {"type": "object", "properties": {
                                              "component": {"type": "string"}, "error": {"type": "string"},
                                              "router": {"type": "string"}, "worker": {"type": "integer"}}}}}},
                                  auth=False)},
            "/openapi.json": {"get": op("This document", auth=False)},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
                "description": "text exposition format 0.0.4", "content": {"text/plain": {}}}}}},
            "/api/v1/router": {"get": op("Process summary: acceptors, routers, workers")},
            "/api/v1/reload": {"post": {**op("Read the configuration file again and apply it, all or nothing "
                                             "(docs/router.md, Reload): applied, summary, changes", {
                                                 "type": "object", "properties": {
                                                     "applied": {"type": "boolean"}, "summary": {"type": "string"},
                                                     "changes": {"type": "array", "items": {"type": "string"}}}}),
                                        "description": "409: refused (nothing changed); the body's error says why"}},
            "/api/v1/routers": {"get": op("Every router", {"type": "array", "items": {"type": "object"}})},
            "/api/v1/routers/{router}": {"get": op("One router: key type, filters, policy, pool",
                                                   params=[router_param])},
            "/api/v1/routers/{router}/target": {"get": op(
                "The target for a key (Artemis getTargetAsJSON + outcome + explanation); the key filter "
                "is not applied and the sticky cache is populated, as in Artemis", target_schema,
                params=[router_param, {"name": "key", "in": "query", "required": True,
                                       "schema": {"type": "string"}}])},
            "/api/v1/routers/{router}/key-filter": {
                "get": op("Current key filter", {"type": "object", "properties": {"key_filter": nullable_str}},
                          params=[router_param]),
                "put": op("Replace the key filter (null or blank clears it)", params=[router_param],
                          body={"type": "object", "required": ["key_filter"],
                                "properties": {"key_filter": nullable_str}})},
            "/api/v1/routers/{router}/local-target-filter": {
                "get": op("Current local-target filter",
                          {"type": "object", "properties": {"local_target_filter": nullable_str}},
                          params=[router_param]),
                "put": op("Replace the local-target filter (null or blank clears it)", params=[router_param],
                          body={"type": "object", "required": ["local_target_filter"],
                                "properties": {"local_target_filter": nullable_str}})},
            "/api/v1/routers/{router}/pool": {"get": op("Targets with readiness, node ids, connection counts; "
                                                        "quorum; HA pairs (serving member, failing over, "
                                                        "split brain)", params=[router_param])},
            "/api/v1/routers/{router}/targets/{target}/hold": {"post": op(
                "Hold a target (its HA pair) out of routing: new connections go to the others; "
                "409 when no other target is ready", params=[router_param, target_param])},
            "/api/v1/routers/{router}/targets/{target}/readmit": {"post": op(
                "Let a held target take connections again (the operator's failback with "
                "allow-failback = false)", params=[router_param, target_param])},
            "/api/v1/routers/{router}/targets/{target}/drain": {"post": op(
                "Drain a target (its HA pair): new connections go to the others at once; its "
                "proxied clients are ended, then the broker's clients are closed with a redirect to "
                "their key's new target, at rate-per-s after grace-ms (the pool's drain-rate-per-s, "
                "drain-grace-ms by default); 409 when no other target is ready",
                params=[router_param, target_param],
                body={"type": "object", "properties": {"rate-per-s": {"type": "number", "minimum": 0.01},
                                                       "grace-ms": {"type": "integer", "minimum": 0}}},
                body_required=False)},
            "/api/v1/routers/{router}/targets/{target}/undrain": {"post": op(
                "Let a drained target take new connections again", params=[router_param, target_param])},
            "/api/v1/routers/{router}/cache": {"get": op(
                "One page of sticky-cache entries in key order; follow next as after for the next page",
                {"type": "object", "properties": {
                    "enabled": {"type": "boolean"}, "total": {"type": "integer"},
                    "max_entries": {"type": "integer"},
                    "entries": {"type": "array", "items": {"type": "object", "properties": {
                        "key": {"type": "string"}, "node_id": {"type": "string"},
                        "idle_s": {"type": "number"}, "age_s": {"type": "number"}}}},
                    "next": nullable_str}},
                params=[router_param,
                        {"name": "limit", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_SIZE,
                                    "default": DEFAULT_PAGE_SIZE}},
                        {"name": "after", "in": "query", "required": False,
                         "description": "return keys greater than this (the previous page's next)",
                         "schema": {"type": "string"}}])},
            "/": {"get": {"summary": "The dashboard: an HTML page that polls /api/v1/dashboard", "responses": {
                "200": {"description": "HTML", "content": {"text/html": {}}},
                "401": {"description": "credentials required"}}}},
            "/api/v1/dashboard": {"get": op(
                "What the dashboard draws: status, edge counters, routers with their pools and proxied "
                "connections, the last routing decisions with their explanation, and the brokers as "
                "their management APIs describe themselves", {"type": "object", "properties": {
                    "time": {"type": "number"}, "name": {"type": "string"}, "status": {"type": "string"},
                    "degraded": {"type": "array", "items": {"type": "object"}},
                    "summary": {"type": "object"}, "edge": {"type": "object"},
                    "routers": {"type": "array", "items": {"type": "object"}},
                    "decisions": {"type": "array", "items": {"type": "object"}},
                    "cluster": {"type": "array", "items": {"type": "object"}}}})},
            "/api/v1/counters": {"get": op("Edge counters (" + ", ".join(COUNTER_NAMES) + ") in total and per "
                                           "acceptor, and each router's counters")},
        },
    }


def io_status(running) -> dict:
    """This process's I/O health: failing components, error counts, descriptor budget."""
    rl = running.edge.routelog
    failing = []
    if rl.error is not None:
        failing.append({"component": "routing_log", "error": rl.error})
    for name, svc in running.services.items():
        for comp, err in getattr(svc, "io_errors", {}).items():
            failing.append({"component": comp, "router": name, "error": err})
    return {"failing": failing, "routing_log_write_errors": rl.write_errors,
            "open_fds": open_fd_count(), "fd_limit": fd_limit()}
