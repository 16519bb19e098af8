"""The broker's management HTTP API (routes over :mod:`broker.http`).

Routes and JSON shapes are the contract in ``docs/architecture.md`` (the router's health checks
and LEAST_CONNECTIONS policy read ``/health`` and ``/api/v1/broker``). ``/health``,
``/metrics`` and ``/openapi.json`` are open; every ``/api/...`` route needs HTTP Basic
credentials of a users-file user holding the ``manage`` permission on :data:`MANAGEMENT_ADDRESS`
(deleting needs ``deleteAddress`` on the address concerned as well).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import trio

from broker.core.security import MANAGEMENT_ADDRESS
from broker.http import (
    HttpError,
    Metric,
    Request,
    Response,
    basic_auth,
    json_response,
    metrics_response,
)

if TYPE_CHECKING:  # pragma: no cover
    from broker.server import Node

__all__ = ["make_handler", "MANAGEMENT_ADDRESS", "openapi_document"]

async def _principal(node: "Node", request: Request):
    creds = basic_auth(request)
    challenge = [("WWW-Authenticate", 'Basic realm="lodestone-broker"')]
    if creds is None:
        raise HttpError(401, "authentication required", challenge)
    ip = request.client.rsplit(":", 1)[0].strip("[]")
    result = await node.login_gate.login(creds[0], creds[1], ip)   # throttled like AMQP logins
    principal = result.principal
    if principal is None:
        raise HttpError(401, "bad credentials", challenge)
    if not node.security.check(principal, "manage", MANAGEMENT_ADDRESS):
        raise HttpError(403, f"user {creds[0]!r} lacks the manage permission")
    return principal


def broker_info(node: "Node") -> dict:
    return {"node_id": node.node_id, "name": node.cfg.name, "active": node.active,
            "version": _version(), "connection_count": node.connection_count,
            "uptime_s": round(time.monotonic() - node.started_mono, 3)}


def _version() -> str:
    from broker.server import VERSION
    return VERSION


def addresses_view(node: "Node") -> list[dict]:
    return [{"name": a.name, "routing_types": sorted(a.routing_types), "queues": sorted(a.queues)}
            for a in sorted(node.core.addresses.values(), key=lambda a: a.name)]


def queues_view(node: "Node") -> list[dict]:
    return [{"name": q.name, "address": q.address, "routing_type": q.routing_type, "durable": q.durable,
             "depth": q.depth, "consumers": q.consumer_count, "enqueued": q.enqueued, "acked": q.acked,
             "dead_lettered": q.dead_lettered}
            for q in sorted(node.core.queues.values(), key=lambda q: q.name)]


def metrics(node: "Node") -> list[Metric]:
    qs = sorted(node.core.queues.values(), key=lambda q: q.name)

    def per_queue(attr):
        return tuple(({"queue": q.name, "address": q.address}, getattr(q, attr)) for q in qs)

    out = [
        Metric("lodestone_broker_up", "gauge", "1 while the node is active", (({}, 1 if node.active else 0),)),
        Metric("lodestone_broker_connections", "gauge", "open AMQP connections", (({}, node.connection_count),)),
        Metric("lodestone_broker_messages_in_total", "counter", "messages received from producers",
               (({}, node.messages_in),)),
        Metric("lodestone_broker_queue_depth", "gauge", "messages in a queue (incl. unsettled)", per_queue("depth")),
        Metric("lodestone_broker_queue_consumers", "gauge", "consumers on a queue", per_queue("consumer_count")),
        Metric("lodestone_broker_queue_enqueued_total", "counter", "messages enqueued", per_queue("enqueued")),
        Metric("lodestone_broker_queue_acked_total", "counter", "messages acknowledged", per_queue("acked")),
        Metric("lodestone_broker_queue_dead_lettered_total", "counter", "messages dead-lettered",
               per_queue("dead_lettered")),
        Metric("lodestone_broker_events_total", "counter", "broker events by outcome",
               tuple(({"event": k}, v) for k, v in sorted(node.counters.items()))),
        Metric("lodestone_broker_logins_total", "counter", "password logins by outcome (broker.auth)",
               tuple(({"outcome": k}, v) for k, v in sorted(node.login_gate.counters.items()))),
    ]
    j = node.journal
    if j is not None:
        out.append(Metric("lodestone_broker_journal_bytes", "gauge", "journal record bytes on disk",
                          (({}, j.total_bytes),)))
        out.append(Metric("lodestone_broker_journal_last_seq", "gauge", "newest journal record appended",
                          (({}, j.last_seq),)))
        out.append(Metric("lodestone_broker_journal_synced_seq", "gauge",
                          "newest journal record made durable (group commit)", (({}, j.synced_seq),)))
    return out


def make_handler(node: "Node"):
    """The ``handler(Request) -> Response`` for :func:`broker.http.serve_http`."""

    async def handler(request: Request) -> Response:
        path = request.path.rstrip("/") or "/"
        method = request.method
        if method == "GET" and path == "/health":
            if node.active:
                return json_response({"status": "ok", "active": True, "node_id": node.node_id})
            return json_response({"status": "starting", "active": False, "node_id": node.node_id}, 503)
        if method == "GET" and path == "/metrics":
            return metrics_response(metrics(node))
        if method == "GET" and path == "/openapi.json":
            return json_response(openapi_document())
        if not path.startswith("/api/"):
            raise HttpError(404, f"no route {path}")
        principal = await _principal(node, request)
        if method == "GET":
            if path == "/api/v1/broker":
                return json_response(broker_info(node))
            if path == "/api/v1/addresses":
                return json_response(addresses_view(node))
            if path == "/api/v1/queues":
                return json_response(queues_view(node))
            if path == "/api/v1/connections":
                return json_response(node.connections())
        if method == "DELETE":
            for prefix, kind in (("/api/v1/queues/", "queue"), ("/api/v1/addresses/", "address")):
                if path.startswith(prefix):
                    name = path[len(prefix):]
                    return _delete(node, principal, kind, name)
        raise HttpError(404 if method in ("GET", "DELETE") else 405, f"no route {method} {path}")

    return handler


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
    return Response(204)


def openapi_document() -> dict:
    """OpenAPI 3 description of the management API."""
    def ok(schema, desc="OK"):
        return {"200": {"description": desc, "content": {"application/json": {"schema": schema}}}}

    s_str, s_int, s_bool = {"type": "string"}, {"type": "integer"}, {"type": "boolean"}
    broker = {"type": "object", "properties": {
        "node_id": s_str, "name": s_str, "active": s_bool, "version": s_str,
        "connection_count": s_int, "uptime_s": {"type": "number"}}}
    address = {"type": "object", "properties": {
        "name": s_str, "routing_types": {"type": "array", "items": {"enum": ["anycast", "multicast"]}},
        "queues": {"type": "array", "items": s_str}}}
    queue = {"type": "object", "properties": {
        "name": s_str, "address": s_str, "routing_type": {"enum": ["anycast", "multicast"]},
        "durable": s_bool, "depth": s_int, "consumers": s_int, "enqueued": s_int, "acked": s_int,
        "dead_lettered": s_int}}
    conn = {"type": "object", "properties": {
        "id": s_str, "container_id": s_str, "user": {"type": "string", "nullable": True},
        "source": s_str, "tls": s_bool, "opened_at": {"type": "string", "format": "date-time"}}}
    health = {"type": "object", "properties": {"status": {"enum": ["ok", "starting"]}, "active": s_bool,
                                               "node_id": s_str}}
    secured = [{"basic": []}]
    no_content = {"204": {"description": "deleted"}, "404": {"description": "not found"},
                  "409": {"description": "in use (has consumers)"}, "403": {"description": "deleteAddress denied"}}
    return {
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
                                          "responses": ok({"type": "array", "items": address})}},
            "/api/v1/addresses/{name}": {"delete": {"summary": "delete an address without consumers",
                                                    "security": secured, "responses": no_content}},
            "/api/v1/queues": {"get": {"summary": "queues", "security": secured,
                                       "responses": ok({"type": "array", "items": queue})}},
            "/api/v1/queues/{name}": {"delete": {"summary": "delete a queue without consumers",
                                                 "security": secured, "responses": no_content}},
            "/api/v1/connections": {"get": {"summary": "open AMQP connections", "security": secured,
                                            "responses": ok({"type": "array", "items": conn})}},
            "/metrics": {"get": {"summary": "Prometheus text exposition (open)", "responses": {
                "200": {"description": "OK", "content": {"text/plain": {"schema": s_str}}}}}},
            "/openapi.json": {"get": {"summary": "this document", "responses": ok({"type": "object"})}},
        },
    }
