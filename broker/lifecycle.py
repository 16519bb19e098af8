"""The node process: one owner of a broker node's life (signals, management, nurseries, activations).

Theory of operation
-------------------
:class:`NodeProcess` runs one role (:mod:`broker.role`) and owns what lives as long as the
process: the signal handler (SIGTERM/SIGINT stop the role), the management HTTP server
(:class:`ManagementSlot`: one server for the whole life, with the passive or active
:class:`~broker.node.Node` of the moment behind it) and the nursery both run in.

:meth:`NodeProcess.serve` is one **activation** on a data directory the role opened and locked:
open the journal and rebuild the core from it (queue definitions, then every live message);
hand the node to the role (``Role.activated``: its tasks for this activation); listen on every
acceptor and print ``listening amqp amqp://host:port`` (``amqps`` for TLS) once each socket is
bound; put the node behind the management API (``listening management http://…`` the first
time); start the node's tasks (group commit, the cluster, broadcast groups, embedded routers, the
activity log, the expiry scan); mark the node active. It serves until the role stops or asks to
hand over (``deactivate``); then the role winds down (``Role.deactivating``: a failback's
hand-over, a scale-down), every client connection is closed with ``amqp:connection:forced``, the
journal and the activity log are flushed and closed. The data directory stays locked: the role
releases it.

:class:`LiveOnly` is the role of a node that is no HA member; :class:`ScaleDown` is the
component that moves a node's messages to another node (``[ha] scale-down``): on a live-only
node's stop, or instead of serving for a backup that took over.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from typing import TYPE_CHECKING, Sequence
from urllib.parse import urlsplit

import trio

from broker.activity import ActivityLog
from broker.amqp.driver import serve_amqp
from broker.cluster.bridge import ClusterNode
from broker.core.departures import Target, target_from_connector
from broker.management import make_handler
from broker.node import Node
from broker.role import Component, Role
from broker.store.datadir import open_data_dir
from broker.wire.discovery import Announcement
from broker.wire.io.http import HttpError, serve_http
from broker.wire.io.logsetup import print_listening
from broker.wire.io.udp import broadcast

if TYPE_CHECKING:  # pragma: no cover
    from broker.config import BrokerConfig

log = logging.getLogger("lodestone.broker")

__all__ = ["NodeProcess", "ManagementSlot", "LiveOnly", "ScaleDown", "SHUTDOWN_GRACE_S", "hostport"]

SHUTDOWN_GRACE_S = 2.0


class ManagementSlot:
    """The management API's handler, swappable: one HTTP server for the process's whole life
    (passive, active, passive again) while the Node behind it changes."""

    def __init__(self) -> None:
        self.handler = None
        self.url = ""

    async def __call__(self, request):
        if self.handler is None:
            raise HttpError(503, "starting")
        return await self.handler(request)

    def serve(self, node: Node) -> None:
        self.handler = make_handler(node)


class NodeProcess:
    """One broker node's process (see the module doc). ``label``: a colocated backup hosted in
    another node's process prints its listeners as ``<label>-<what>``; ``signals``: whether
    SIGTERM/SIGINT stop it (the process's own node: yes; a hosted one: its host stops it)."""

    def __init__(self, cfg: "BrokerConfig", security, *, components: Sequence[Component] = (),
                 label: str | None = None, signals: bool = True) -> None:
        self.cfg = cfg
        self.security = security
        #: what runs while the node serves, whatever its role (broker.role.Component)
        self.components = tuple(components)
        self.label = label
        self.signals = signals
        self.management = ManagementSlot()
        self._nursery: trio.Nursery | None = None
        self._task_status = trio.TASK_STATUS_IGNORED
        self._started = False

    def _what(self, what: str) -> str:
        return f"{self.label}-{what}" if self.label else what

    async def run(self, role: Role, *, task_status=trio.TASK_STATUS_IGNORED) -> int:
        """Run ``role`` until it returns (stopped by a signal, ``role.stop()`` or its own end);
        returns its exit status. ``task_status`` is started with the first active Node (None if
        the role ends before it ever served)."""

        self._task_status = task_status
        with (trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) if self.signals
              else contextlib.nullcontext(None)) as signals:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                if signals is not None:
                    nursery.start_soon(self._stop_on_signal, signals, role)
                try:
                    code = await role.run(self)
                finally:
                    self._nursery = None
                    nursery.cancel_scope.cancel()
        self._report_started(None)
        return code

    async def _stop_on_signal(self, signals, role: Role) -> None:
        async for sig in signals:
            if sig == signal.SIGHUP:   # not a stop: a service manager's "reload" must not end a broker
                log.warning("signal SIGHUP ignored: a broker does not reload its configuration; "
                            "restart it to apply a change")
                continue
            log.info("signal %s: shutting down", signal.Signals(sig).name)
            self.stop(role)
            return

    def stop(self, role: Role) -> None:
        """Stop ``role`` and every component: ``run`` returns soon."""
        role.stop()
        for c in self.components:
            c.stop()

    def _report_started(self, node: Node | None) -> None:
        if not self._started:
            self._started = True
            self._task_status.started(node)

    def passive(self, role: Role, node_id: str | None) -> Node:
        """Put a passive node (no journal, no listener: ``active: false``) behind the
        management API, for a role waiting to serve."""
        node = Node(self.cfg, self.security, node_id or "", None, role=role, components=self.components)
        self.management.serve(node)
        return node

    async def open_management(self) -> str:
        """Open the management server (once per process; ``[management] enabled``); its URL."""
        m = self.cfg.management
        if m.enabled and not self.management.url:
            host, port = await self._nursery.start(serve_http, self.management, m.host, m.port)
            self.management.url = f"http://{hostport(host, port)}"
            print_listening(self._what("management"), self.management.url)
        return self.management.url

    def spawn(self, fn, *args) -> None:
        """Run ``fn(*args)`` for the rest of the process's life (a role's component)."""
        self._nursery.start_soon(fn, *args)

    # -- one activation ----------------------------------------------------------------------
    async def serve(self, role: Role, datadir, *, deactivate: trio.Event | None = None,
                    scale_down: "ScaleDown | None" = None) -> str:
        """Serve as the active node on ``datadir`` (opened and locked by ``role``) until the role
        stops (returns ``"stop"``) or ``deactivate`` is set (``"deactivate"``). ``scale_down``:
        a backup that took over with ``[ha] scale-down`` — no acceptor listens; the node joins
        the cluster, moves every message to another node and returns ``"scaled-down"``."""

        cfg = self.cfg
        journal = datadir.open_journal(cfg.journal) if cfg.persistent else None
        try:
            activity = (ActivityLog(cfg.activity.path or (cfg.data_dir / "activity.jsonl"), datadir.node_id, cfg.name)
                        if cfg.activity.enabled else None)
            node = Node(cfg, self.security, datadir.node_id, journal, role=role, activity=activity,
                        routed=bool(cfg.routers), components=self.components)
            node.recover()
            node.declare_configured_addresses()
            log.info("node starting", extra={"fields": {"node_id": node.node_id, "name": cfg.name,
                                                         "data_dir": str(cfg.data_dir)}})
            async with node.connections_open() as connections:
                async with trio.open_nursery() as tasks:
                    for part in (role, *self.components):
                        part.activated(node, tasks)
                    listeners, urls = await self._listen(node, tasks, none=scale_down is not None)
                    mgmt_url = await self.open_management()
                    self.management.serve(node)
                    await self._start_node_tasks(node, tasks, urls, mgmt_url)
                    node.set_active(scale_down is None)   # a scaling-down backup serves no client
                    log.info("node active", extra={"fields": {"node_id": node.node_id}})
                    self._report_started(node)
                    if scale_down is not None:
                        reason = await scale_down.instead_of_serving(node)
                    else:
                        reason = await _first(("stop", role.stopping), ("deactivate", deactivate))
                    node.set_active(False)

                    def close_listeners() -> None:
                        for scope in listeners:
                            scope.cancel()
                    for part in (role, *self.components):
                        await part.deactivating(node, reason, close_listeners)
                    tasks.cancel_scope.cancel()
                await node.close_connections(SHUTDOWN_GRACE_S)
                connections.cancel_scope.cancel()   # what did not end within the grace
            node.close_activity()
        finally:
            if journal is not None:
                journal.close()
        return reason

    async def _listen(self, node: Node, nursery: trio.Nursery, *, none: bool) -> tuple[list, list[str]]:
        """One listener per acceptor, each in its own cancel scope; their URLs as bound."""
        scopes: list[trio.CancelScope] = []
        urls: list[str] = []
        for acc in (() if none else self.cfg.acceptors):
            scopes.append(trio.CancelScope())
            host, port = await nursery.start(_in_scope, scopes[-1], serve_amqp, node, acc)
            url = f"{acc.scheme}://{hostport(host, port)}"
            print_listening(self._what(acc.scheme), url)
            urls.append(url)
        return scopes, urls

    async def _start_node_tasks(self, node: Node, nursery: trio.Nursery, urls: list[str], mgmt_url: str) -> None:
        cfg = self.cfg
        nursery.start_soon(node.committer)    # without a journal it answers what sync mirrors hold
        if cfg.cluster is not None:
            await nursery.start(_run_cluster, node, cfg.cluster, urls, mgmt_url)
        for bg in cfg.broadcast_groups:
            nursery.start_soon(_run_broadcast, node, bg, urls, mgmt_url)
        if node.routing is not None:
            await nursery.start(_run_routing, node, urls, mgmt_url)
        if node.activity is not None:
            nursery.start_soon(node.activity_flusher)
        if cfg.expiry_scan_period_ms > 0:
            nursery.start_soon(node.expiry_scanner)


async def _first(*events: tuple[str, trio.Event | None]) -> str:
    """Wait for the first of the (name, event) pairs to be set; its name."""
    first = ""
    async with trio.open_nursery() as waiter:
        async def wait_for(name: str, ev: trio.Event) -> None:
            nonlocal first
            await ev.wait()
            first = first or name
            waiter.cancel_scope.cancel()
        for name, ev in events:
            if ev is not None:
                waiter.start_soon(wait_for, name, ev)
    return first


class LiveOnly(Role):
    """A node that is no HA member (``[ha] policy = "live-only"``, the default): it locks its
    data directory and serves until stopped; with ``[ha] scale-down`` it moves its messages to
    another node of the cluster first (:class:`ScaleDown`)."""

    async def run(self, proc: NodeProcess) -> int:
        datadir = open_data_dir(self.cfg.data_dir)
        try:
            await proc.serve(self, datadir)
        finally:
            datadir.close()
        return 0

    async def deactivating(self, node: Node, reason: str, close_listeners) -> None:
        if reason == "stop" and self.cfg.ha.scale_down and node.cluster is not None:
            await ScaleDown(self.cfg).on_stop(node, close_listeners)


class ScaleDown:
    """``[ha] scale-down`` (Artemis's ``<scale-down>``): move every message of this node id to
    another node of the cluster over its bridges (``ClusterNode.scale_down``)."""

    def __init__(self, cfg: "BrokerConfig") -> None:
        self.timeout_s = cfg.cluster.call_timeout_ms / 1000.0

    async def on_stop(self, node: Node, close_listeners) -> None:
        """A live-only node stopping: stop taking clients, let them go (those that follow
        redirects to the node the messages go to, the others' ended without a Close:
        docs/ha.md, "Telling clients where to go"), move every message, then stop."""
        close_listeners()
        await node.depart_all(scale_down_redirect(node), "scaling down", SHUTDOWN_GRACE_S)
        await node.close_connections(SHUTDOWN_GRACE_S)
        await node.cluster.scale_down(self.timeout_s)

    async def instead_of_serving(self, node: Node) -> str:
        """A backup that took over with scale-down: move the messages instead of serving them."""
        result = await node.cluster.scale_down(self.timeout_s)
        log.warning("ha: this backup scaled down instead of serving: %s", result)
        return "scaled-down"


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


_ANY_ADDRESS = {"0.0.0.0", "::"}


def reachable_management_url(mgmt_url: str, connector: str) -> str:
    """The management URL to tell other nodes and routers: a management API bound to every
    address (``0.0.0.0``, ``::``) is reached at the host of the node's connector, the address
    the others already use for this node."""
    parts = urlsplit(mgmt_url)
    if parts.hostname not in _ANY_ADDRESS:
        return mgmt_url
    host = urlsplit(connector).hostname
    if not host or host in _ANY_ADDRESS:
        log.warning("the management API listens on every address and the connector %s names none: "
                    "other nodes and routers are told %s, which they cannot reach; set [cluster] "
                    "connector to this node's address", connector, mgmt_url)
        return mgmt_url
    return f"{parts.scheme}://{f'[{host}]' if ':' in host else host}:{parts.port}"


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
    mgmt_url = reachable_management_url(mgmt_url, connectors[0]) if connectors else mgmt_url
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
    cluster = ClusterNode(node, ccfg, connector=connector, management_url=reachable_management_url(mgmt_url, connector))
    node.set_cluster(cluster)
    log.info("cluster starting", extra={"fields": {"cluster": ccfg.name, "connector": connector,
                                                    "static_connectors": list(ccfg.static_connectors),
                                                    "message_load_balancing": ccfg.message_load_balancing}})
    try:
        await cluster.run(task_status=task_status)
    finally:
        cluster.stop()


async def _run_routing(node: Node, amqp_urls: list[str], mgmt_url: str, *,
                       task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The connection routers of routed acceptors (broker.routing); this node is their local
    target, at its cluster connector (or first acceptor)."""
    routing = node.routing
    routing.build(node.cluster.connector if node.cluster is not None else amqp_urls[0], mgmt_url)
    log.info("connection routers starting", extra={"fields": {
        "routers": list(routing.services),
        "acceptors": {a.name: a.router for a in node.cfg.acceptors if a.router is not None}}})
    await routing.run(task_status=task_status)


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
