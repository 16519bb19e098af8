"""The router's dashboard: ``GET /`` on the management port (same credentials as the API).

A page of plain HTML, CSS and JavaScript (``index.html``, ``dashboard.css``, ``dashboard.js``,
``favicon.svg`` in this folder; no build step, no third-party code) that polls ``GET /api/v1/dashboard`` once a
second and draws:

* each router's pool: targets and HA pairs, ready / held / draining, the broker's connection
  count (from its probe) and the connections this router proxies to it, the quorum;
  drain and undrain buttons (``POST .../targets/<t>/drain`` and ``/undrain``);
* decisions per second by outcome and the cache hit rate, from the difference between two
  snapshots of the counters (the page keeps the previous one);
* the last decisions with their explanation: raw → filtered → transformed key, cache, pin,
  policy, quorum, target, what the client got;
* the cluster as the brokers see it: for every management URL the pools know, the broker's
  identity, HA role and phase, cluster members, its deepest queues and its broker connections
  (``GET /api/v1/broker``, ``/ha``, ``/cluster``, ``/queues``, ``/broker-connections``).

``dashboard_snapshot`` builds that JSON; with several workers the supervisor asks each worker
for its last decisions (control message ``recent``) and its counters, so the page shows the
whole router.
"""

from __future__ import annotations

import json
import logging
import time
from importlib import resources
from typing import Any

import trio

from broker.wire.io.http import Response, call_json_url

log = logging.getLogger("router.dashboard")

#: path → (file in this package, content type)
STATIC = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "/favicon.svg": ("favicon.svg", "image/svg+xml"),
}
#: the longest string of a decision the page shows (keys and container ids are client input)
MAX_FIELD_CHARS = 200
#: the cluster view is read from the brokers at most this often, whatever the number of pages
CLUSTER_MAX_AGE_S = 2.0
CLUSTER_TIMEOUT_S = 1.5
#: the queues shown per broker (deepest first)
TOP_QUEUES = 8

_cache: dict[str, bytes] = {}


def static_response(path: str) -> Response | None:
    """The page's files, or None for another path."""
    entry = STATIC.get(path)
    if entry is None:
        return None
    name, ctype = entry
    body = _cache.get(name)
    if body is None:
        body = _cache[name] = resources.files(__package__).joinpath(name).read_bytes()
    return Response(200, body, ctype, [("Cache-Control", "no-cache"),
                                       ("Content-Security-Policy", "default-src 'self'; frame-ancestors 'none'"),
                                       ("X-Content-Type-Options", "nosniff")])


def _bounded(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
        return value[:MAX_FIELD_CHARS] + f"… ({len(value)} chars)"
    return value


def decision_view(record: tuple, worker: int | None) -> dict:
    """One entry of ``EdgeContext.recent`` as JSON."""
    wall, router, acceptor, mode, conn_id, host, user, container_id, decision, decision_us, action = record
    e = decision.explanation
    t = decision.target
    return {"time": round(wall, 3), "worker": worker, "router": router, "acceptor": acceptor, "mode": mode,
            "connection_id": conn_id, "client_address": host, "user": _bounded(user),
            "container_id": _bounded(container_id),
            "key_type": e.key_type, "key_raw": _bounded(e.raw_key), "key_filtered": _bounded(e.filtered_key),
            "key_transformed": _bounded(e.key), "key_filter": e.key_filter, "pin": _bounded(e.pin),
            "cache": e.cache, "cache_tier": e.cache_tier, "policy": e.policy,
            "ready_targets": e.ready_targets, "total_targets": e.total_targets,
            "quorum_size": e.quorum_size, "quorum_met": e.quorum_met, "failover": e.failover,
            "waited_s": e.waited_s, "reason": e.reason, "outcome": decision.outcome.value,
            "local": bool(decision.local),
            "target": None if t is None else (t.name or f"{t.host}:{t.port}"),
            "target_node_id": None if t is None else t.node_id,
            "decision_us": int(decision_us or 0), "action": action}


def recent_decisions(running) -> list[dict]:
    """This process's last decisions, oldest first."""
    return [decision_view(r, running.worker) for r in list(running.edge.recent)]


class ClusterView:
    """The brokers behind the pools, as their management APIs describe themselves."""

    def __init__(self, max_age_s: float = CLUSTER_MAX_AGE_S, timeout_s: float = CLUSTER_TIMEOUT_S) -> None:
        self.max_age_s = max_age_s
        self.timeout_s = timeout_s
        self._at: float | None = None
        self._value: list[dict] = []
        self._lock = trio.Lock()
        self._names: dict[str, str] = {}   # management URL → the broker's name when it last answered

    async def read(self, services: dict) -> list[dict]:
        async with self._lock:   # concurrent pages share one read
            now = time.monotonic()
            if self._at is None or now - self._at >= self.max_age_s:
                self._value = await self._read(services)
                self._at = time.monotonic()
            return self._value

    async def _read(self, services: dict) -> list[dict]:
        brokers: dict[str, dict] = {}
        for name, svc in services.items():
            pool = getattr(svc, "pool", None)
            pc = getattr(getattr(svc, "config", None), "pool", None)
            if pool is None:
                continue
            creds = {t.name: (t.username, t.password) for t in (pc.targets if pc is not None else ())
                     if t.username is not None}
            default = (pc.username, pc.password or "") if pc is not None and pc.username is not None else None
            for st in pool.all_states():
                t = st.target
                if not t.management_url:
                    continue
                entry = brokers.setdefault(t.management_url, {
                    "management_url": t.management_url, "targets": [], "routers": [],
                    "auth": creds.get(t.name, default)})
                label = t.name or f"{t.host}:{t.port}"
                if label not in entry["targets"]:
                    entry["targets"].append(label)
                if name not in entry["routers"]:
                    entry["routers"].append(name)
        out: list[dict] = []

        async def one(entry: dict) -> None:
            out.append(await self._broker(entry))

        async with trio.open_nursery() as nursery:
            for entry in brokers.values():
                nursery.start_soon(one, entry)
        return sorted(out, key=lambda b: (b.get("name") or "", b["management_url"]))

    async def _get(self, url: str, path: str, auth) -> Any:
        status, body = await call_json_url(url.rstrip("/") + path, "GET", auth=auth, timeout_s=self.timeout_s,
                                           max_body_bytes=8 << 20)
        if status == 404:
            return None
        if status // 100 != 2:
            raise ValueError(f"GET {path}: HTTP {status}")
        return json.loads(body) if body else None

    async def _broker(self, entry: dict) -> dict:
        url, auth = entry["management_url"], entry.pop("auth")
        view: dict[str, Any] = {**entry, "reachable": False, "error": None}
        parts: dict[str, Any] = {}
        errors: list[str] = []

        async def get(key: str, path: str) -> None:
            try:
                parts[key] = await self._get(url, path, auth)
            except (OSError, ValueError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                errors.append(f"{path}: {type(exc).__name__}: {exc or 'timeout'}")

        async with trio.open_nursery() as nursery:
            for key, path in (("broker", "/api/v1/broker"), ("ha", "/api/v1/ha"), ("cluster", "/api/v1/cluster"),
                              ("queues", "/api/v1/queues"), ("connections", "/api/v1/broker-connections")):
                nursery.start_soon(get, key, path)
        broker = parts.get("broker")
        if not isinstance(broker, dict):
            view["error"] = errors[0] if errors else "no answer"
            view["name"] = self._names.get(url)   # as it was known: the page keeps its card in place
            return view
        if isinstance(broker.get("name"), str):
            self._names[url] = broker["name"]
        view.update(reachable=True, error="; ".join(errors) or None, name=broker.get("name"),
                    node_id=broker.get("node_id"), active=broker.get("active"),
                    connection_count=broker.get("connection_count"), uptime_s=broker.get("uptime_s"))
        ha = parts.get("ha")
        if isinstance(ha, dict):
            view["ha"] = {"policy": ha.get("policy"), "role": ha.get("role"), "phase": ha.get("phase"),
                          "active": ha.get("active")}
        cluster = parts.get("cluster")
        if isinstance(cluster, dict):
            view["cluster"] = {"name": cluster.get("name"),
                               "members": [{"node_id": m.get("node_id"), "connector": m.get("connector"),
                                            "connected": m.get("connected"), "role": m.get("role")}
                                           for m in cluster.get("members", []) if isinstance(m, dict)]}
        queues = parts.get("queues")
        if isinstance(queues, list):
            shown = [q for q in queues if isinstance(q, dict) and not str(q.get("name", "")).startswith("$")
                     and not q.get("temporary")]
            shown.sort(key=lambda q: (-(q.get("depth") or 0), str(q.get("name"))))
            view["queues"] = {"count": len(shown), "depth": sum(q.get("depth") or 0 for q in shown),
                              "top": [{"name": _bounded(q.get("name")), "depth": q.get("depth"),
                                       "consumers": q.get("consumers")} for q in shown[:TOP_QUEUES]]}
        conns = parts.get("connections")
        if isinstance(conns, list):
            view["broker_connections"] = [{"name": c.get("name"), "state": c.get("state"),
                                           "uri": c.get("uri")} for c in conns if isinstance(c, dict)]
        return view
