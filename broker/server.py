"""A broker node: the shell that ties config, store, core, AMQP listeners and management together.

Theory of operation
-------------------
:func:`serve_active` (called by :func:`broker.process.run_node` on a data directory it opened and
locked, or by ``broker.ha`` once a member becomes active) opens the journal and rebuilds the core
from it (queue definitions from KV records, then every live message), then starts, in one
nursery: one listener per acceptor, the management HTTP server, the group-commit task and the
activity-log flusher. It prints ``listening amqp amqp://host:port`` (``amqps`` for TLS) and
``listening management http://host:port`` once each socket is bound, then marks the node active.
SIGTERM/SIGINT close every client connection with ``amqp:connection:forced``, flush the journal
and the activity log, release the data-directory lock and return.

:class:`broker.node.Node` is the object the engines and the management API talk to; it holds
no sockets and lives in :mod:`broker.node`. This module is the shell that runs one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from broker.activity import ActivityLog
from broker.core.departures import Target, target_from_connector
from broker.wire.io.logsetup import print_listening
from broker.node import Node
from broker.wire.io.http import HttpError
from broker.management import make_handler
from broker.amqp.driver import serve_amqp
from broker.wire.io.http import serve_http
from broker.wire.discovery import Announcement
from broker.wire.io.udp import broadcast
from broker.cluster.bridge import ClusterNode
from broker.routing import EmbeddedRouting

if TYPE_CHECKING:  # pragma: no cover
    from broker.config import BrokerConfig

log = logging.getLogger("lodestone.broker")

__all__ = ["serve_active", "ManagementSlot", "SHUTDOWN_GRACE_S", "hostport"]

SHUTDOWN_GRACE_S = 2.0


class ManagementSlot:
    """The management API's handler, swappable: an HA node keeps one HTTP server for its whole
    life (passive, active, passive again) while the Node behind it changes."""

    def __init__(self) -> None:
        self.handler = None
        self.url = ""
        self.status = None   # broker.ha.shared_store.HaStatus of an HA node
        self.store = None
        self.node = None     # the Node behind it

    async def __call__(self, request):

        if self.handler is None:
            raise HttpError(503, "starting")
        return await self.handler(request)

    def serve(self, node: Node) -> None:
        self.node = node
        self.handler = make_handler(node)


async def serve_active(cfg: "BrokerConfig", security, datadir, stop: trio.Event, *,
                       deactivate: trio.Event | None = None, management: ManagementSlot | None = None,
                       on_node=None, on_deactivate=None, scale_down_only: bool = False,
                       label: str | None = None, task_status=trio.TASK_STATUS_IGNORED) -> str:
    """Serve as the active node on a locked data directory until ``stop`` (a signal: returns
    ``"stop"``) or ``deactivate`` (an HA node hands over: returns ``"deactivate"``); then close
    every connection, flush, and return with the journal closed (the data directory stays locked:
    the caller releases it). ``management``: an HA node's HTTP server, already listening (this
    node is put behind it); without it this function serves the management API itself.
    ``on_node(node)`` is called once the node exists (an HA node's observability);
    ``await on_deactivate(node)`` runs on a hand-over once the listeners are closed, before the
    remaining connections are (a failback sends its last records there). ``scale_down_only``: a
    backup that took over with ``[ha] scale-down`` — no acceptor listens; the node joins the
    cluster, moves every message to another node and returns ``"scaled-down"``. ``label``:
    prefixes the ``listening`` lines (a colocated backup: ``colocated-<n>-amqp``)."""

    journal = None
    reason = "stop"
    try:
        if cfg.persistent:
            journal = datadir.open_journal(cfg.journal)
        node = Node(cfg, security, datadir.node_id, journal)
        if on_node is not None:
            on_node(node)
        node.recover()
        node.declare_configured_addresses()
        if cfg.routers:  # before any acceptor listens: a routed acceptor never skips its router
            node.routing = EmbeddedRouting(node, cfg)
        if cfg.activity.enabled:
            node.activity = ActivityLog(cfg.activity.path or (cfg.data_dir / "activity.jsonl"),
                                        node.node_id, cfg.name)
        log.info("node starting", extra={"fields": {"node_id": node.node_id, "name": cfg.name,
                                                     "data_dir": str(cfg.data_dir)}})
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as conns:
                node.connection_nursery = conns
                async with trio.open_nursery() as services:
                    amqp_urls = []
                    mgmt_url = ""
                    listeners: list[trio.CancelScope] = []
                    for acc in (cfg.acceptors if not scale_down_only else ()):
                        listeners.append(trio.CancelScope())
                        host, port = await services.start(_in_scope, listeners[-1], serve_amqp, node, acc)
                        print_listening(f"{label}-{acc.scheme}" if label else acc.scheme,
                                        f"{acc.scheme}://{hostport(host, port)}")
                        amqp_urls.append(f"{acc.scheme}://{hostport(host, port)}")
                    if management is not None:
                        management.serve(node)
                        mgmt_url = management.url
                    elif cfg.management.enabled:
                        host, port = await services.start(
                            serve_http, make_handler(node), cfg.management.host, cfg.management.port)
                        mgmt_url = f"http://{hostport(host, port)}"
                        print_listening(f"{label}-management" if label else "management", mgmt_url)
                    if journal is not None:
                        services.start_soon(node.committer)
                    ccfg = cfg.cluster
                    if node.replication is not None:   # an active replication member: its backup's stream
                        services.start_soon(node.replication.run, (ccfg.call_timeout_ms if ccfg else 30000) / 1000.0)
                    if ccfg is not None:
                        await services.start(_run_cluster, node, ccfg, amqp_urls, mgmt_url)
                    for bg in cfg.broadcast_groups:
                        services.start_soon(_run_broadcast, node, bg, amqp_urls, mgmt_url)
                    if cfg.routers:
                        await services.start(_run_routing, node, cfg, amqp_urls, mgmt_url)
                    if node.activity is not None:
                        services.start_soon(node.activity_flusher)
                    if cfg.expiry_scan_period_ms > 0:
                        services.start_soon(node.expiry_scanner)
                    node.active = not scale_down_only   # a scaling-down backup serves no client
                    if node.routing is not None:
                        node.routing.set_active(True)
                    log.info("node active", extra={"fields": {"node_id": node.node_id}})
                    task_status.started(node)
                    if scale_down_only:
                        result = await node.cluster.scale_down(ccfg.call_timeout_ms / 1000.0)
                        log.warning("ha: this backup scaled down instead of serving: %s", result)
                        reason = "scaled-down"
                    else:
                        async with trio.open_nursery() as waiter:   # until a signal or a hand-over
                            async def wait_for(ev: trio.Event, why: str) -> None:
                                nonlocal reason
                                await ev.wait()
                                reason = why
                                waiter.cancel_scope.cancel()
                            waiter.start_soon(wait_for, stop, "stop")
                            if deactivate is not None:
                                waiter.start_soon(wait_for, deactivate, "deactivate")
                    node.active = False
                    if node.routing is not None:
                        node.routing.set_active(False)
                    if reason == "deactivate" and on_deactivate is not None:
                        for scope in listeners:
                            scope.cancel()
                        await on_deactivate(node)
                    if cfg.ha.scale_down and node.cluster is not None and reason == "stop" and not scale_down_only:
                        # Artemis live-only scale-down: stop taking clients, let them go (those
                        # that follow redirects to the node the messages go to, the others' ended
                        # without a Close: docs/ha.md, "Telling clients where to go"), move every
                        # message to another node, then stop
                        for scope in listeners:
                            scope.cancel()
                        await node.depart_all(scale_down_redirect(node), "scaling down", SHUTDOWN_GRACE_S)
                        node.shutdown_connections()
                        with trio.move_on_after(SHUTDOWN_GRACE_S):
                            while node.engines:
                                await trio.sleep(0.02)
                        await node.cluster.scale_down(ccfg.call_timeout_ms / 1000.0)
                    services.cancel_scope.cancel()
                node.shutdown_connections()
                with trio.move_on_after(SHUTDOWN_GRACE_S):
                    while node.engines:
                        await trio.sleep(0.02)
                conns.cancel_scope.cancel()
            outer.cancel_scope.cancel()
        node.flush_all_activity()
        if node.activity is not None:
            node.activity.close()
    finally:
        if journal is not None:
            journal.close()
    return reason


def scale_down_redirect(node: Node) -> Target | None:
    """Where a live-only node scaling down sends clients that follow redirects: the node its
    messages go to (``ClusterNode.scale_down_target``, as connected now), at the connector its
    hello named, with that member's in-sync backups as the failover list; None if none yet."""
    cluster = node.cluster
    bridge = cluster.scale_down_target() if cluster is not None else None
    if bridge is None:
        return None
    member = cluster.members.get(bridge.node_id)
    connector = member.connector if member is not None and member.connector else bridge.url
    backups = [c for c, _mgmt, in_sync in cluster.member_backups.get(bridge.node_id, ()) if in_sync]
    return target_from_connector(connector, backups)


async def _in_scope(scope: trio.CancelScope, fn, *args, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run ``fn(*args)`` (a ``task_status`` task) inside ``scope``, so it can be stopped alone."""
    with scope:
        await fn(*args, task_status=task_status)


async def _run_broadcast(node: Node, bg, amqp_urls: list[str], mgmt_url: str) -> None:
    """A broadcast group (Artemis ``broadcast-group``): announce this node over UDP multicast,
    with its HA backups (``ClusterNode.own_backups``) as they are at each period."""

    ccfg = node.cfg.cluster
    if bg.connectors:
        connectors = bg.connectors
    elif node.cluster is not None:
        connectors = (node.cluster.connector,)
    else:
        connectors = tuple(amqp_urls[:1])
    name = ccfg.name if ccfg is not None else node.cfg.name
    key = ccfg.key if ccfg is not None else None
    node.broadcast_counters[bg.name] = counters = {}
    log.info("broadcast group starting", extra={"fields": {"group": bg.name, "address": bg.group_address,
                                                            "port": bg.group_port, "connectors": list(connectors)}})
    try:
        await broadcast(bg.group_address, bg.group_port,
                        lambda seq: Announcement(node.node_id, name, mgmt_url, connectors, seq,
                                                 backups=node.cluster.own_backups()
                                                 if node.cluster is not None else ()),
                        period_s=bg.broadcast_period_ms / 1000.0, bind_address=bg.local_bind_address,
                        bind_port=bg.local_bind_port, key=key, counters=counters)
    except OSError as exc:  # the bind address is not this host's, say: the node keeps serving
        counters["bind_failed"] = 1
        log.error("broadcast group %s cannot bind %s:%d: %s; this node is not announced", bg.name,
                  bg.local_bind_address, bg.local_bind_port, exc)


async def _run_cluster(node: Node, ccfg, amqp_urls: list[str], mgmt_url: str, *,
                       task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Join the cluster: bridges to the static connectors, serving the others' cluster links."""

    connector = ccfg.connector or amqp_urls[0]
    if connector.rsplit(":", 1)[-1] == "0" and amqp_urls:  # port 0 in the config: the first acceptor of its scheme, as bound
        scheme = connector.split("://", 1)[0]
        connector = next((u for u in amqp_urls if u.startswith(scheme + "://")), amqp_urls[0])
    if ccfg.weak_password:
        log.warning("cluster password is %s: anyone who knows it can join this cluster, so cluster logins with "
                    "it are accepted from loopback addresses only; set [cluster] password",
                    "a published sample" if ccfg.password_set else "not set (the default)",
                    extra={"fields": {"cluster": ccfg.name, "user": ccfg.user}})
    cluster = ClusterNode(node, ccfg, connector=connector, management_url=mgmt_url)
    node.set_cluster(cluster)
    log.info("cluster starting", extra={"fields": {"cluster": ccfg.name, "connector": connector,
                                                    "static_connectors": list(ccfg.static_connectors),
                                                    "message_load_balancing": ccfg.message_load_balancing}})
    try:
        await cluster.run(task_status=task_status)
    finally:
        cluster.stop()


async def _run_routing(node: Node, cfg: "BrokerConfig", amqp_urls: list[str], mgmt_url: str, *,
                       task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The connection routers of routed acceptors (broker.routing); this node is their local
    target, at its cluster connector (or first acceptor)."""
    routing = node.routing
    routing.build(node.cluster.connector if node.cluster is not None else amqp_urls[0], mgmt_url)
    log.info("connection routers starting", extra={"fields": {
        "routers": list(routing.services),
        "acceptors": {a.name: a.router for a in cfg.acceptors if a.router is not None}}})
    await routing.run(task_status=task_status)


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
