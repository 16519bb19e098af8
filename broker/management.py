"""The broker's management HTTP API (routes over :mod:`broker.wire.io.http`).

Routes and JSON shapes are the contract in ``docs/architecture.md`` (the router's health checks
and LEAST_CONNECTIONS policy read ``/health`` and ``/api/v1/broker``). ``/health``,
``/openapi.json`` are open; every ``/api/...`` route — and ``/metrics`` unless ``[management]
metrics-auth = false`` — needs HTTP Basic credentials of a users-file user holding the
``manage`` permission on :data:`MANAGEMENT_ADDRESS` (deleting needs ``deleteAddress`` on the
address concerned as well).

``/metrics`` must stay cheap with many queues: the per-queue series (five lines per queue) are
rebuilt at most once per ``[management] metrics-cache-ms`` whatever the number of scrapers
(concurrent scrapes share one rebuild), and a rebuild yields to the event loop every
:data:`RENDER_SLICE_QUEUES` queues so producers and consumers keep being served while it runs.
The node-wide series (connections, events, journal) are fresh on every scrape.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

import trio

from broker.amqp.host import INTERNAL_PREFIX
from broker.cluster.bridge import CLUSTER_ROLE
from broker.wire.io.users import MANAGEMENT_ADDRESS, Principal
from broker.wire.io.http import (
    HttpError,
    Metric,
    Request,
    Response,
    escape_label,
    basic_auth,
    json_response,
    render_metrics,
)

from router.embed import RouterResources, routers_openapi_paths
from broker import VERSION
from broker.core.filters import SelectorError, compile_queue_filter
from broker.core.departures import END_OF_STREAM, FORCED, CloseRequestError, parse_close_request
from broker.role import plain_view

if TYPE_CHECKING:  # pragma: no cover
    from broker.node import Node

__all__ = ["make_handler", "MANAGEMENT_ADDRESS", "openapi_document"]

#: what the cluster user may read (the probes of an embedded router's cluster pool, and a
#: member's view of the cluster): everything else needs a users-file user with ``manage``
CLUSTER_READABLE = frozenset({"/api/v1/broker", "/api/v1/cluster", "/api/v1/ha"})
COLOCATED_PATH = "/api/v1/ha/colocated"   # another primary asks this node to host its backup
CLOSE_PATH = "/api/v1/connections/close"   # close (redirect) client connections: a router's drain
CONNECTIONS_PATH = "/api/v1/broker-connections"   # the connections this broker dials (broker.connections)


async def _principal(node: "Node", request: Request):
    creds = basic_auth(request)
    challenge = [("WWW-Authenticate", 'Basic realm="lodestone-broker"')]
    if creds is None:
        raise HttpError(401, "authentication required", challenge)
    ip = request.client.rsplit(":", 1)[0].strip("[]")
    cluster = node.cluster
    if cluster is not None:
        ok = cluster.check_login(creds[0], creds[1], ip)
        if ok is not None:  # the cluster user: its own password (loopback only when weak)
            if not ok:
                node.counters["cluster_login_refused"] += 1
                await trio.sleep(node.security.login.failure_delay_s)
                raise HttpError(401, "bad credentials", challenge)
            path = request.path.rstrip("/") or "/"
            if not ((request.method == "GET" and path in CLUSTER_READABLE)
                    or (request.method == "POST" and path == COLOCATED_PATH)):
                raise HttpError(403, f"the cluster user may only read {', '.join(sorted(CLUSTER_READABLE))} "
                                     f"and ask for a colocated backup (POST {COLOCATED_PATH})")
            return Principal(creds[0], (CLUSTER_ROLE,))
    result = await node.login_gate.login(creds[0], creds[1], ip)   # throttled like AMQP logins
    principal = result.principal
    if principal is None:
        raise HttpError(401, "bad credentials", challenge)
    if not node.security.check(principal, "manage", MANAGEMENT_ADDRESS):
        raise HttpError(403, f"user {creds[0]!r} lacks the manage permission")
    return principal


def ha_view(node: "Node") -> dict:
    """``GET /api/v1/ha``: this process's HA policy, role and state (docs/ha.md)."""
    return node.role.describe(node) if node.role is not None else plain_view(node)


def broker_info(node: "Node") -> dict:
    return {"node_id": node.node_id or None, "name": node.cfg.name, "active": node.active,
            "version": _version(), "connection_count": node.connection_count,
            "uptime_s": round(time.monotonic() - node.started_mono, 3),
            # a journal that failed a write (disk full) refuses every durable send until a restart:
            # routers take the node out of their pools (router.health)
            "journal_error": getattr(node.journal, "failure", None)}


def _version() -> str:
    return VERSION


def addresses_view(node: "Node") -> list[dict]:
    dups = node.core.duplicates
    shared = node.shared_queues.addresses if node.shared_queues is not None else ()
    return [{"name": a.name, "routing_types": sorted(a.routing_types), "queues": sorted(a.queues),
             "duplicate_ids": dups.remembered(a.name), "duplicates_dropped": dups.dropped.get(a.name, 0),
             "shared": a.name in shared}
            for a in sorted(node.core.addresses.values(), key=lambda a: a.name)]


def queues_view(node: "Node") -> list[dict]:
    remote = node.core.cluster.remote
    return [{"name": q.name, "address": q.address, "routing_type": q.routing_type, "durable": q.durable,
             "depth": q.depth, "consumers": q.consumer_count, "enqueued": q.enqueued, "acked": q.acked,
             "dead_lettered": q.dead_lettered, "expired": q.expired, "temporary": q.temporary,
             "filter": q.filter_text,
             "remote_bindings": [{"node_id": e.binding.node_id, "consumers": e.binding.consumers,
                                  "distance": e.binding.distance, "connected": e.binding.connected}
                                 for e in remote(q.address).get(q.name, {}).values()]}
            for q in sorted(node.core.queues.values(), key=lambda q: q.name)]


def cluster_view(node: "Node") -> dict:
    """``GET /api/v1/cluster``: this node's view of its cluster (404 when it has none)."""
    if node.cluster is None:
        raise HttpError(404, "this node is not part of a cluster (no [cluster] table)")
    # the members include every HA backup this node knows, its own and the members' (role
    # "backup", the node id they back up: a router's cluster pool pairs them; docs/ha.md "Topology")
    return node.cluster.describe()


RENDER_SLICE_QUEUES = 1000
LIMITS = ("max-connections", "max-queues", "max-sessions", "max-links", "max-transactions")
_QUEUE_FAMILIES = (
    ("lodestone_broker_queue_depth", "gauge", "messages in a queue (incl. unsettled)"),
    ("lodestone_broker_queue_consumers", "gauge", "consumers on a queue"),
    ("lodestone_broker_queue_enqueued_total", "counter", "messages enqueued"),
    ("lodestone_broker_queue_acked_total", "counter", "messages acknowledged"),
    ("lodestone_broker_queue_dead_lettered_total", "counter", "messages dead-lettered"),
)


def metrics(node: "Node", exporter: "MetricsExporter | None" = None) -> list[Metric]:
    """The node-wide series (fresh on every scrape; the per-queue ones come from the exporter)."""
    c = node.counters
    out = [
        Metric("lodestone_broker_up", "gauge", "1 while the node is active", (({}, 1 if node.active else 0),)),
        Metric("lodestone_broker_connections", "gauge", "open AMQP connections", (({}, node.connection_count),)),
        Metric("lodestone_broker_messages_in_total", "counter", "messages received from producers",
               (({}, node.messages_in),)),
        Metric("lodestone_broker_queues", "gauge", "queues on the node", (({}, len(node.core.queues)),)),
        Metric("lodestone_broker_duplicate_ids", "gauge", "_AMQ_DUPL_ID ids remembered over all addresses",
               (({}, node.core.duplicates.address_ids),)),
        Metric("lodestone_broker_resource_limit_exceeded_total", "counter",
               "requests refused by a resource limit (amqp:resource-limit-exceeded)",
               tuple(({"limit": lim}, c.get(f"resource_limit_{lim.replace('-', '_')}", 0)) for lim in LIMITS)),
        Metric("lodestone_broker_decode_errors_total", "counter",
               "connections closed with amqp:decode-error (where), messages rejected undecodable",
               (({"where": "frame"}, c.get("decode_error", 0)),
                ({"where": "message"}, c.get("message_decode_error", 0)))),
        Metric("lodestone_broker_events_total", "counter", "broker events by outcome",
               tuple(({"event": k}, v) for k, v in sorted(c.items()))),
        Metric("lodestone_broker_logins_total", "counter", "password logins by outcome (broker.wire.io.login)",
               tuple(({"outcome": k}, v) for k, v in sorted(node.login_gate.counters.items()))),
    ]
    ha = node.role.status if node.role is not None else None
    if ha is not None:
        out += [
            Metric("lodestone_broker_ha_active", "gauge", "1 while this HA member serves its pair's node id",
                   (({"role": ha.role}, 1 if ha.active else 0),)),
            Metric("lodestone_broker_ha_activations_total", "counter", "times this process became active",
                   (({}, ha.activations),)),
            Metric("lodestone_broker_ha_failovers_total", "counter", "activations of a backup (its live node failed)",
                   (({}, ha.failovers),)),
            Metric("lodestone_broker_ha_failbacks_total", "counter",
                   "times this active backup handed over to its returning primary", (({}, ha.failbacks),)),
            Metric("lodestone_broker_ha_votes_total", "counter", "quorum votes this member asked for, by outcome",
                   tuple(({"outcome": k}, v) for k, v in sorted(ha.votes.items()))),
        ]
        mgr = getattr(node.role, "manager", None)
        if mgr is not None:   # [ha.manager] (broker.ha.quorum)
            c = mgr.counters
            out += [
                Metric("lodestone_broker_ha_lock_events_total", "counter",
                       "the coordination lock: taken, released, lost (session expired or lease run out)",
                       (({"event": "acquired"}, c["lock_acquired"]), ({"event": "released"}, c["lock_released"]),
                        ({"event": "lost"}, c["lock_lost"]))),
                Metric("lodestone_broker_ha_coordination_connected", "gauge",
                       "1 while the ZooKeeper session is connected", (({}, 1 if mgr.state == "connected" else 0),)),
                Metric("lodestone_broker_ha_coordination_sessions_lost_total", "counter",
                       "ZooKeeper sessions that expired", (({}, c["session_lost"]),)),
                Metric("lodestone_broker_ha_lock_held", "gauge", "1 while this member holds the coordination lock",
                       (({}, 1 if mgr.holding else 0),)),
            ]
        repl = node.replication
        if repl is not None:
            lag = repl.describe()["lag_records"]
            out.append(Metric("lodestone_broker_ha_replication_lag_records", "gauge",
                              "journal records appended and not yet confirmed by the backup (-1: no backup)",
                              (({"state": repl.state}, -1 if lag is None else lag),)))
    if exporter is not None:
        out += [
            Metric("lodestone_broker_metrics_scrapes_total", "counter", "GET /metrics answered",
                   (({}, exporter.scrapes),)),
            Metric("lodestone_broker_metrics_rebuilds_total", "counter", "per-queue series rebuilt",
                   (({}, exporter.rebuilds),)),
            Metric("lodestone_broker_metrics_rebuild_loop_seconds", "gauge",
                   "event-loop time of the last per-queue rebuild (sum of its slices)",
                   (({}, round(exporter.last_loop_s, 6)),)),
            Metric("lodestone_broker_metrics_rebuild_slice_max_seconds", "gauge",
                   "longest event-loop slice of the last per-queue rebuild", (({}, round(exporter.last_slice_s, 6)),)),
        ]
    cl = node.cluster
    if cl is not None:
        bridges = [b for b in cl.bridges.values() if not b.stopped and b.node_id]
        out += [
            Metric("lodestone_broker_cluster_bridge_up", "gauge", "1 while the bridge to a node is connected",
                   tuple(({"peer": b.node_id}, 1 if b.connected else 0) for b in bridges)),
            Metric("lodestone_broker_cluster_forwarded_total", "counter", "messages sent to a node over its bridge",
                   tuple(({"peer": b.node_id}, b.forwarded) for b in bridges)),
            Metric("lodestone_broker_cluster_acked_total", "counter", "forwarded messages a node accepted",
                   tuple(({"peer": b.node_id}, b.acked) for b in bridges)),
            Metric("lodestone_broker_cluster_pending", "gauge", "messages waiting in a bridge's store-and-forward queue",
                   tuple(({"peer": b.node_id}, b.pending) for b in bridges)),
            Metric("lodestone_broker_cluster_duplicates_dropped_total", "counter",
                   "forwarded messages dropped as duplicates, by origin node",
                   tuple(({"origin": n}, c.dropped) for n, c in sorted(cl.caches.items()))),
            Metric("lodestone_broker_cluster_redistributed_total", "counter", "messages moved by redistribution",
                   (({}, cl.redistributed),)),
            Metric("lodestone_broker_cluster_remote_bindings", "gauge", "remote bindings known",
                   (({}, len(node.core.cluster)),)),
            Metric("lodestone_broker_cluster_events_total", "counter", "cluster events by outcome",
                   tuple(({"event": k}, v) for k, v in sorted(cl.counters.items()))),
        ]
        el = cl.election
        if el is not None:   # OpenAMQ's root election (docs/cluster.md "Primaries, secondaries and the root")
            d = el.decision
            out += [
                Metric("lodestone_broker_cluster_root", "gauge", "1 while this node is the cluster's root",
                       (({"partition": el.partition}, 1 if el.is_root else 0),)),
                Metric("lodestone_broker_cluster_root_known", "gauge",
                       "1 while this node knows a root (itself or a connected primary that says it is root)",
                       (({}, 1 if el.root is not None else 0),)),
                Metric("lodestone_broker_cluster_electorate", "gauge",
                       "active primaries this primary sees, itself included (a secondary: none)",
                       (({"defined": str(len(el.primaries))}, d.electorate if d is not None else 0),)),
                Metric("lodestone_broker_cluster_election_events_total", "counter",
                       "root election events: votes cast, elected, resigned, root changes seen",
                       tuple(({"event": k}, v) for k, v in sorted(el.counters.items()))),
            ]
        sh = cl.shared
        if sh is not None:   # OpenAMQ's shared queues (docs/cluster.md "Shared queues")
            out += [
                Metric("lodestone_broker_cluster_shared_relaying", "gauge",
                       "sends to shared queues relayed to the root and not answered yet (held without a root included)",
                       (({}, len(sh.pending)),)),
                Metric("lodestone_broker_cluster_shared_events_total", "counter",
                       "shared queue events: relayed, accepted, refused without a root, moved, ...",
                       tuple(({"event": k}, v) for k, v in sorted(sh.counters.items()))),
            ]
    bc = node.component("broker-connections")
    if bc is not None:
        views = bc.describe()
        out += [
            Metric("lodestone_broker_connection_up", "gauge", "1 while a broker connection is connected",
                   tuple(({"connection": v["name"]}, 1 if v["connected"] else 0) for v in views)),
            Metric("lodestone_broker_connection_attempts_total", "counter", "connection attempts of a broker connection",
                   tuple(({"connection": v["name"]}, v["attempts"]) for v in views)),
            Metric("lodestone_broker_connection_sent_total", "counter",
                   "messages a broker connection's senders handed to the peer (resends excluded)",
                   tuple(({"connection": v["name"], "queue": s["queue"]}, s["sent"]) for v in views
                         for s in v["senders"])),
            Metric("lodestone_broker_connection_acknowledged_total", "counter",
                   "messages the peer accepted from a broker connection's senders",
                   tuple(({"connection": v["name"], "queue": s["queue"]}, s["acknowledged"]) for v in views
                         for s in v["senders"])),
            Metric("lodestone_broker_connection_received_total", "counter",
                   "messages a broker connection's receivers stored here",
                   tuple(({"connection": v["name"], "local": r["local"]}, r["stored"]) for v in views
                         for r in v["receivers"])),
            Metric("lodestone_broker_mirror_pending", "gauge",
                   "mirror events waiting in the store-and-forward queue (or in flight)",
                   tuple(({"connection": v["name"]}, v["mirror"]["pending"]) for v in views if v["mirror"])),
            Metric("lodestone_broker_mirror_sync_held", "gauge",
                   "sends and commits a sync mirror holds until its target has their events",
                   tuple(({"connection": v["name"]}, v["mirror"]["held"]) for v in views
                         if v["mirror"] and v["mirror"]["sync"])),
            Metric("lodestone_broker_mirror_events_total", "counter", "mirror events by kind (sends, acks) and "
                   "those the target accepted (acknowledged)",
                   tuple(({"connection": v["name"], "kind": k}, v["mirror"][k]) for v in views if v["mirror"]
                         for k in ("sends", "acks", "acknowledged"))),
        ]
    mt = node.component("mirror-target")
    if mt is not None:
        out.append(Metric("lodestone_broker_mirror_target_events_total", "counter",
                          "what this node applied as a mirror's target, by event",
                          tuple(({"event": k}, v) for k, v in sorted(mt.describe().items())
                                if k not in ("tracked", "pending_acks"))))
        out.append(Metric("lodestone_broker_mirror_target_pending_acks", "gauge",
                          "mirror acknowledgements waiting for a consumer here to settle or give back the message",
                          (({}, mt.describe()["pending_acks"]),)))
    j = node.journal
    if j is not None:
        out.append(Metric("lodestone_broker_journal_bytes", "gauge", "journal record bytes on disk",
                          (({}, j.total_bytes),)))
        out.append(Metric("lodestone_broker_journal_last_seq", "gauge", "newest journal record appended",
                          (({}, j.last_seq),)))
        out.append(Metric("lodestone_broker_journal_synced_seq", "gauge",
                          "newest journal record made durable (group commit)", (({}, j.synced_seq),)))
    return out


class MetricsExporter:
    """``/metrics`` for one node: node-wide series fresh, per-queue series cached and sliced.

    The per-queue text is rebuilt when older than ``cache_s`` (one rebuild shared by concurrent
    scrapes); the rebuild walks a snapshot of the queues in slices of ``slice_queues`` with a
    checkpoint between slices, so its cost never blocks the loop in one piece and does not grow
    with the number of scrapers.
    """

    def __init__(self, node: "Node", cache_s: float, slice_queues: int = RENDER_SLICE_QUEUES):
        self.node = node
        self.cache_s = cache_s
        self.slice_queues = slice_queues
        self._queue_text = b""
        self._built_at: float | None = None
        self._building: trio.Event | None = None
        self._labels: dict[tuple[str, str], str] = {}
        self.scrapes = 0
        self.rebuilds = 0
        self.last_loop_s = 0.0
        self.last_slice_s = 0.0

    async def body(self) -> bytes:
        """The exposition text, UTF-8 (the per-queue part is kept encoded: no copy per scrape)."""
        self.scrapes += 1
        now = trio.current_time()
        if self._built_at is None or now - self._built_at >= self.cache_s:
            if self._building is not None:
                await self._building.wait()
            else:
                self._building = done = trio.Event()
                try:
                    self._queue_text = await self._rebuild()
                    self._built_at = trio.current_time()
                finally:
                    self._building = None
                    done.set()
        return render_metrics(metrics(self.node, self)).encode() + self._queue_text

    async def _rebuild(self) -> bytes:
        clock = time.perf_counter
        t0 = clock()
        qs = sorted(self.node.core.queues.values(), key=lambda q: q.name)
        labels = self._labels
        if len(labels) > 2 * len(qs) + 1024:  # forget deleted queues now and then
            labels.clear()
        fams = [[f"# HELP {n} {h}", f"# TYPE {n} {k}"] for n, k, h in _QUEUE_FAMILIES]
        depth, consumers, enq, acked, dead = fams
        names = [n for n, _k, _h in _QUEUE_FAMILIES]
        loop_s = slice_max = 0.0
        for start in range(0, len(qs), self.slice_queues):
            for q in qs[start:start + self.slice_queues]:
                key = (q.name, q.address)
                lab = labels.get(key)
                if lab is None:
                    lab = labels[key] = f'{{queue="{escape_label(q.name)}",address="{escape_label(q.address)}"}} '
                depth.append(f"{names[0]}{lab}{q.depth}")
                consumers.append(f"{names[1]}{lab}{len(q.subs)}")
                enq.append(f"{names[2]}{lab}{q.enqueued}")
                acked.append(f"{names[3]}{lab}{q.acked}")
                dead.append(f"{names[4]}{lab}{q.dead_lettered}")
            spent = clock() - t0
            loop_s += spent
            slice_max = max(slice_max, spent)
            await trio.sleep(0)  # let the connections run between slices
            t0 = clock()
        text = ("\n".join("\n".join(f) for f in fams) + "\n").encode()
        spent = clock() - t0
        self.last_loop_s = loop_s + spent
        self.last_slice_s = max(slice_max, spent)
        self.rebuilds += 1
        return text


def make_handler(node: "Node"):
    """The ``handler(Request) -> Response`` for :func:`broker.wire.io.http.serve_http`."""
    mcfg = node.cfg.management
    exporter = MetricsExporter(node, mcfg.metrics_cache_ms / 1000)
    routers = _EmbeddedRouters(node)

    async def handler(request: Request) -> Response:
        path = request.path.rstrip("/") or "/"
        method = request.method
        if method == "GET" and path == "/health":
            failure = getattr(node.journal, "failure", None) if node.active else None
            if failure is not None:
                return json_response({"status": "failed", "active": True, "node_id": node.node_id,
                                      "error": failure}, 503)
            if node.active:
                return json_response({"status": "ok", "active": True, "node_id": node.node_id})
            status = node.role.status if node.role is not None else None
            passive = status is not None and status.phase != "starting"
            return json_response({"status": "passive" if passive else "starting", "active": False,
                                  "node_id": node.node_id or None}, 503)
        if method == "GET" and path == "/metrics":
            if mcfg.metrics_auth:
                await _principal(node, request)
            return Response(200, await exporter.body(), "text/plain; version=0.0.4; charset=utf-8")
        if method == "GET" and path == "/openapi.json":
            return json_response(openapi_document())
        if not path.startswith("/api/"):
            raise HttpError(404, f"no route {path}")
        principal = await _principal(node, request)
        if path.startswith("/api/v1/routers") and node.routing is not None:
            resp = await routers.handle_routers(request, path)
            if resp is not None:
                return resp
        if method == "GET":
            if path == "/api/v1/broker":
                return json_response(broker_info(node))
            if path == "/api/v1/addresses":
                return json_response(addresses_view(node))
            if path == "/api/v1/queues":
                return json_response(queues_view(node))
            if path == "/api/v1/connections":
                return json_response(node.connections())
            if path == "/api/v1/cluster":
                return json_response(cluster_view(node))
            if path == "/api/v1/ha":
                return json_response(ha_view(node))
            if path == CONNECTIONS_PATH:
                bc = node.component("broker-connections")
                return json_response(bc.describe() if bc is not None else [])
        if method == "POST" and path.startswith(CONNECTIONS_PATH + "/"):
            return _broker_connection_call(node, path[len(CONNECTIONS_PATH) + 1:])
        if method == "POST" and path == COLOCATED_PATH:
            answer = node.role.host_backup(request.json()) if node.role is not None else None
            if answer is None:
                raise HttpError(404, "this node hosts no colocated backups ([ha.colocated] max-backups)")
            status, body = answer
            return json_response(body, status)
        if method == "POST" and path == "/api/v1/addresses":
            return _create_address(node, principal, request.json())
        if method == "POST" and path == CLOSE_PATH:
            return _close_connections(node, request.json())
        if method == "DELETE":
            for prefix, kind in (("/api/v1/queues/", "queue"), ("/api/v1/addresses/", "address")):
                if path.startswith(prefix):
                    name = path[len(prefix):]
                    return _delete(node, principal, kind, name)
        raise HttpError(404 if method in ("GET", "DELETE", "POST") else 405, f"no route {method} {path}")

    return handler


def _broker_connection_call(node: "Node", rest: str) -> Response:
    """``POST /api/v1/broker-connections/<name>/start`` (or ``/stop``)."""
    name, _, action = rest.rpartition("/")
    bc = node.component("broker-connections")
    if action not in ("start", "stop") or not name:
        raise HttpError(404, f"no route POST {CONNECTIONS_PATH}/{rest} (…/<name>/start or …/<name>/stop)")
    if bc is None or name not in bc.connections:
        raise HttpError(404, f"no broker connection {name!r} ([broker-connections.<name>])")
    return json_response(bc.start(name) if action == "start" else bc.stop_connection(name))


class _EmbeddedRouters(RouterResources):
    """``/api/v1/routers`` of this broker's embedded routers (broker.routing): the router's own
    resources (``router.management.RouterResources``), same paths and shapes."""

    def __init__(self, node: "Node") -> None:
        self.node = node

    @property
    def services(self) -> dict:
        return self.node.routing.services if self.node.routing is not None else {}

    @property
    def router_configs(self) -> dict:
        return self.node.routing.configs if self.node.routing is not None else {}


def _create_address(node: "Node", principal, body) -> Response:
    """``POST /api/v1/addresses`` ``{"name", "routing_types", "filter"?}``: declare an address (an
    anycast one gets its queue, with the filter); in a cluster it joins the replicated state."""
    if not isinstance(body, dict):
        raise HttpError(400, "expected a JSON object {\"name\", \"routing_types\", \"filter\"}")
    name = body.get("name")
    types = body.get("routing_types", ["anycast"])
    ftext = body.get("filter")
    if not isinstance(name, str) or not name or len(name) > 1024 or name.startswith(INTERNAL_PREFIX):
        raise HttpError(400, f"name {name!r} must be a non-empty string of at most 1024 characters, not internal")
    if not isinstance(types, list) or not types or any(t not in ("anycast", "multicast") for t in types):
        raise HttpError(400, f"routing_types {types!r} must be a non-empty list of anycast/multicast")
    if ftext is not None:
        if not isinstance(ftext, str) or "anycast" not in types:
            raise HttpError(400, "filter must be a selector string, for an anycast address")
        try:
            compiled = compile_queue_filter(ftext)
        except SelectorError as exc:
            raise HttpError(400, f"filter {ftext!r}: {exc}") from None
    if not node.security.check(principal, "createAddress", name):
        raise HttpError(403, f"createAddress denied on {name!r}")
    shared = body.get("shared", False)
    if not isinstance(shared, bool):
        raise HttpError(400, f"shared {shared!r} must be true or false")
    if shared and ("anycast" not in types or node.cluster is None or node.cluster.shared is None):
        raise HttpError(400, "shared needs the anycast routing type and a cluster with a root ([cluster] primaries)")
    cluster = node.cluster
    if cluster is not None and not cluster.declare(name, types, ftext, shared=shared):
        raise HttpError(507, f"the cluster state is full (max-state-bytes = {cluster.state.max_bytes})")
    node.core.declare_address(name, types)
    if ftext is not None:
        node.core.set_queue_filter(name, compiled, ftext)
    addr = node.core.addresses[name]
    return json_response({"name": name, "routing_types": sorted(addr.routing_types), "queues": sorted(addr.queues)},
                         201)


def _close_connections(node: "Node", body) -> Response:
    """``POST /api/v1/connections/close`` (docs/broker.md, "Closing client connections"): the
    selected client connections are closed — ``amqp:connection:redirect`` to ``redirect`` for
    those that follow redirects, the rest ended without a Close (``unmodified``
    ``end-of-stream``, the default) or with ``amqp:connection:forced`` — spread at
    ``rate-per-second``. Answers 202 at once with the plan; the closes run in the background."""

    try:
        req = parse_close_request(body)
    except CloseRequestError as exc:
        raise HttpError(400, str(exc)) from None
    if not node.active or node.connection_nursery is None:
        raise HttpError(503, "this node is not active: it serves no client connection")
    plan = node.plan_departures(req.selector, req.target, "closed by the management API", req.unmodified)
    node.connection_nursery.start_soon(functools.partial(node.depart, plan, rate_per_second=req.rate_per_second))
    redirected = sum(1 for d in plan if d.info is not None)
    rate = req.rate_per_second
    return json_response({
        "selected": len(plan), "redirected": redirected,
        "forced": sum(1 for d in plan if d.condition == FORCED),
        "ended": sum(1 for d in plan if d.condition == END_OF_STREAM),
        "redirect": str(req.target) if req.target is not None else None, "rate_per_second": rate,
        "duration_s": round((len(plan) - 1) / rate, 3) if rate and plan else 0.0,
        "connections": [{"id": d.conn_id, "condition": d.condition} for d in plan]}, 202)


def _delete(node: "Node", principal, kind: str, name: str) -> Response:
    core = node.core
    if kind == "queue":
        q = core.queues.get(name)
        if q is None:
            raise HttpError(404, f"no queue {name!r}")
        if not node.security.check(principal, "deleteAddress", q.address):
            raise HttpError(403, f"deleteAddress denied on {q.address!r}")
        if q.subs:
            raise HttpError(409, f"queue {name!r} has consumers")
        core.delete_queue(name)
        return Response(204)
    if name not in core.addresses:
        raise HttpError(404, f"no address {name!r}")
    if not node.security.check(principal, "deleteAddress", name):
        raise HttpError(403, f"deleteAddress denied on {name!r}")
    if any(q.subs for q in core.addresses[name].queues.values()):
        raise HttpError(409, f"address {name!r} has consumers")
    core.delete_address(name)
    cluster = node.cluster
    if cluster is not None and name in cluster.state.entries:
        cluster.declare(name, ["anycast"], None, deleted=True)  # a tombstone in the replicated state
    return Response(204)


def openapi_document() -> dict:
    """OpenAPI 3 description of the management API."""
    def ok(schema, desc="OK"):
        return {"200": {"description": desc, "content": {"application/json": {"schema": schema}}}}

    s_str, s_int, s_bool = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
    broker = {"type": "object", "properties": {
        "node_id": s_str, "name": s_str, "active": s_bool, "version": s_str,
        "connection_count": s_int, "uptime_s": {"type": "number"},
        "journal_error": {"type": "string", "nullable": True}}}
    address = {"type": "object", "properties": {
        "name": s_str, "routing_types": {"type": "array", "items": {"enum": ["anycast", "multicast"]}},
        "queues": {"type": "array", "items": s_str}, "duplicate_ids": s_int, "duplicates_dropped": s_int}}
    queue = {"type": "object", "properties": {
        "name": s_str, "address": s_str, "routing_type": {"enum": ["anycast", "multicast"]},
        "durable": s_bool, "depth": s_int, "consumers": s_int, "enqueued": s_int, "acked": s_int,
        "dead_lettered": s_int, "expired": s_int, "temporary": s_bool,
        "filter": {"type": "string", "nullable": True}}}
    conn = {"type": "object", "properties": {
        "id": s_str, "container_id": {"type": "string", "nullable": True}, "user": {"type": "string", "nullable": True},
        "source": s_str, "tls": s_bool, "opened_at": {"type": "string", "format": "date-time"},
        "internal": {"type": "boolean", "description": "a cluster, mirror or broker connection: never "
                                                       "closed by POST /api/v1/connections/close"}}}
    health = {"type": "object", "properties": {"status": {"enum": ["ok", "starting", "passive"]}, "active": s_bool,
                                               "node_id": s_str}}
    close_request = {
        "type": "object", "additionalProperties": False,
        "description": "exactly one selector: container-id, user, id (GET /api/v1/connections) or all",
        "properties": {"container-id": s_str, "user": s_str, "id": s_str, "all": {"type": "boolean", "enum": [True]},
                       "redirect": {"type": "string", "description": "host:port ([v6]:port) of the node "
                                                                      "redirect-capable clients go to"},
                       "rate-per-second": {"type": "number", "minimum": 0.01, "maximum": 100000},
                       "unmodified": {"type": "string", "enum": ["end-of-stream", "amqp:connection:forced"],
                                      "description": "what clients that do not follow redirects get (default "
                                                     "end-of-stream: no Close, the socket is closed)"}}}
    close_plan = {"type": "object", "properties": {
        "selected": s_int, "redirected": s_int, "forced": s_int, "ended": s_int, "redirect": {"type": "string", "nullable": True},
        "rate_per_second": {"type": "number", "nullable": True}, "duration_s": {"type": "number"},
        "connections": {"type": "array", "items": {"type": "object", "properties": {
            "id": s_str, "condition": {"enum": ["amqp:connection:redirect", "amqp:connection:forced", "end-of-stream"]}}}}}}
    secured = [{"basic": []}]
    # a templated path must declare its parameter (OpenAPI 3.0 §4.7.12, "Path Templating")
    name_param = {"name": "name", "in": "path", "required": True, "schema": s_str}
    no_content = {"204": {"description": "deleted"}, "404": {"description": "not found"},
                  "409": {"description": "in use (has consumers)"}, "403": {"description": "deleteAddress denied"}}
    doc = {
        "openapi": "3.0.3",
        "info": {"title": "Lodestone broker management API", "version": "1"},
        "components": {"securitySchemes": {"basic": {"type": "http", "scheme": "basic"}}},
        "paths": {
            "/health": {"get": {"summary": "liveness (open)", "responses": {
                **ok(health), "503": {"description": "starting",
                                      "content": {"application/json": {"schema": health}}}}}},
            "/api/v1/broker": {"get": {"summary": "node identity and load", "security": secured,
                                       "responses": ok(broker)}},
            "/api/v1/addresses": {"get": {"summary": "addresses", "security": secured,
                                          "responses": ok({"type": "array", "items": address})},
                                  "post": {"summary": "declare an address (replicated to the cluster)",
                                           "security": secured,
                                           "requestBody": {"content": {"application/json": {"schema": {
                                               "type": "object", "required": ["name"],
                                               "properties": {"name": {"type": "string"},
                                                              "routing_types": {"type": "array",
                                                                                "items": {"type": "string"}},
                                                              "filter": {"type": "string"},
                                                              "shared": {"type": "boolean"}}}}}},
                                           "responses": {"201": {"description": "declared", "content": {
                                               "application/json": {"schema": address}}},
                                               "400": {"description": "bad request"},
                                               "403": {"description": "createAddress denied"},
                                               "507": {"description": "cluster state full"}}}},
            "/api/v1/addresses/{name}": {"parameters": [name_param], "delete": {"summary": "delete an address without consumers",
                                                    "security": secured, "responses": no_content}},
            "/api/v1/queues": {"get": {"summary": "queues", "security": secured,
                                       "responses": ok({"type": "array", "items": queue})}},
            "/api/v1/queues/{name}": {"parameters": [name_param], "delete": {"summary": "delete a queue without consumers",
                                                 "security": secured, "responses": no_content}},
            "/api/v1/cluster": {"get": {"summary": "this node's cluster: members and bridges", "security": secured,
                                        "responses": {**ok({"type": "object"}),
                                                      "404": {"description": "not part of a cluster"}}}},
            "/api/v1/ha": {"get": {"summary": "HA policy, role and state of this process (docs/ha.md)",
                                   "security": secured, "responses": ok({"type": "object", "properties": {
                                       "policy": s_str, "role": s_str, "active": s_bool,
                                       "node_id": {"type": "string", "nullable": True}, "phase": s_str,
                                       "pair": {"type": "object", "nullable": True},
                                       "replication": {"type": "object", "nullable": True}}})}},
            "/api/v1/broker-connections": {"get": {"summary": "the connections this broker dials "
                                                              "(docs/broker-connections.md)",
                                                   "security": secured,
                                                   "responses": {"200": {"description": "one entry per "
                                                                                        "[broker-connections.<name>]"}}}},
            "/api/v1/broker-connections/{name}/start": {"parameters": [name_param], "post": {"summary": "start a broker connection",
                                                                 "security": secured,
                                                                 "responses": {"200": {"description": "its state"},
                                                                               "404": {"description": "no such connection"}}}},
            "/api/v1/broker-connections/{name}/stop": {"parameters": [name_param], "post": {"summary": "stop a broker connection",
                                                                "security": secured,
                                                                "responses": {"200": {"description": "its state"},
                                                                              "404": {"description": "no such connection"}}}},
            "/api/v1/ha/colocated": {"post": {"summary": "ask this node to host a colocated backup (cluster user)",
                                              "security": secured,
                                              "responses": {"202": {"description": "hosting it"},
                                                            "200": {"description": "already hosting it"},
                                                            "409": {"description": "full, or its own id"},
                                                            "404": {"description": "hosts no colocated backups"}}}},
            "/api/v1/connections": {"get": {"summary": "open AMQP connections", "security": secured,
                                            "responses": ok({"type": "array", "items": conn})}},
            CLOSE_PATH: {"post": {
                "summary": "close client connections: amqp:connection:redirect to `redirect` for clients whose "
                           "Open desired lodestone:follows-redirect; the rest ended without a Close "
                           "(`unmodified` end-of-stream, the default) or with amqp:connection:forced; "
                           "spread at rate-per-second (answers at once; the closes run in the background)",
                "security": secured,
                "requestBody": {"required": True, "content": {"application/json": {"schema": close_request}}},
                "responses": {"202": {"description": "the selected connections; closing has begun",
                                      "content": {"application/json": {"schema": close_plan}}},
                              "400": {"description": "bad body (the message names the field)"},
                              "403": {"description": "lacks the manage permission"},
                              "503": {"description": "this node is not active"}}}},
            "/metrics": {"get": {"summary": "Prometheus text exposition (Basic auth with manage unless "
                                            "[management] metrics-auth = false)", "security": secured,
                                 "responses": {
                "200": {"description": "OK", "content": {"text/plain": {"schema": s_str}}}}}},
            "/openapi.json": {"get": {"summary": "this document", "responses": ok({"type": "object"})}},
        },
    }
    # a node with routed acceptors serves the router's own resources (broker.routing)
    doc["paths"].update(routers_openapi_paths())
    return doc
