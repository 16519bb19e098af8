"""The router inside a broker acceptor: the one router module the broker imports besides
``router.core``.

A broker acceptor with ``router = "<name>"`` routes its clients with the router's own code: its
``[routers.<name>]`` tables use the router's schema (``parse_router_table`` in embedded mode),
each becomes a ``RouterService`` (the same shell and pure core the router process runs), the
Open is read with the router's sniffer (``OpenReader``), decisions are logged as ``route`` lines
(``RouteLog``, ``route_line``) and refused with the router's wording (``refusal_text``), and the
broker's management API serves the router's ``/api/v1/routers`` resources (``RouterResources``,
``routers_openapi_paths``). ``broker.routing`` and ``broker.management`` use this module;
docs/architecture.md shows where it sits.
"""

from __future__ import annotations

from router.config import (RouterConfig, RoutingLogConfig, TargetConfig, parse_router_table,
                           parse_routing_log_table)
from router.management import RouterResources, openapi_document
from router.net.edge.route import refusal_text
from router.routelog import RouteLog, route_line
from router.service import RouterService, build_router
from router.sniff.amqp import OpenReader

__all__ = [
    "RouterConfig", "RoutingLogConfig", "TargetConfig", "parse_router_table", "parse_routing_log_table",
    "RouterResources", "routers_openapi_paths", "refusal_text", "RouteLog", "route_line",
    "RouterService", "build_router", "OpenReader",
]


def routers_openapi_paths() -> dict:
    """The router's ``/api/v1/routers`` paths of its OpenAPI document, for a broker that embeds it."""
    return {k: v for k, v in openapi_document()["paths"].items() if k.startswith("/api/v1/routers")}
