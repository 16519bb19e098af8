"""The connection router inside a broker (Artemis's acceptor ``router=<name>``: seed 004's
data-gravity setup, issue 11 part 4).

Theory of operation
-------------------
A broker acceptor may name a router (``[acceptors.<a>] router = "<r>"``); ``[routers.<r>]``
tables use the router's own schema (``router.config.parse_router_table`` in embedded mode) and
each becomes a ``router.service.RouterService`` — the same shell and the same pure core
(``router.core``) the router process runs; nothing of the routing logic is copied here.

* **The local target is this broker**: named after ``[node] name``, with this node's id, its
  cluster connector (or first acceptor) as address. It is ready while the node is active
  (``set_active``) and never probed (Artemis's ``LocalTarget.checkReadiness`` is always true).
* **The pool** is static, discovery (the router's sources, health-probed through each target's
  management URL) or ``source = "cluster"``: this broker's own cluster (Artemis's
  ``<cluster-connection>`` pool), :class:`ClusterPoolSource`. A member joins the pool when its
  cluster bridge is up and its hello named its connector, and leaves as soon as the bridge goes
  down (Artemis's ``nodeUP``/``nodeDown``); while in the pool it is probed through the
  management URL it announced (``GET /api/v1/broker``, ``active``, connection count for
  LEAST_CONNECTIONS) with the pool's ``username``/``password`` — by default the cluster's own
  credentials, which a broker's management API accepts for those read-only probes.
* **Routing happens after SASL, on the Open** (``AMQPConnectionContext.onRemoteOpen`` in
  Artemis): the driver (``broker.amqp.driver``) authenticates the client, then
  :meth:`EmbeddedRouting.route_connection` reads the AMQP header and Open
  (``router.sniff.amqp.OpenReader``) and decides. A local decision hands every byte read to the
  engine, which serves the connection as on any acceptor. Any other target gets the native
  redirect (``amqp:connection:redirect``, ``network-host``/``port``) and a refusal gets
  ``amqp:connection:forced`` with Artemis's descriptions (``broker.wire.frames``), each after
  an Open carrying ``amqp:connection-establishment-failed``.
* **The cluster's own connections are never routed** (Artemis exempts the cluster user): a
  principal with the cluster role goes straight to the engine.
* Every decision is a ``route`` line in ``[routing-log]`` (the router's schema; ``action`` is
  ``local``, ``redirected`` or ``refused``, ``mode`` is ``redirect``).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from broker.wire.errors import RemoteProtocolError
from broker.wire.frames import (NEED_DATA, artemis_redirect_description, close_frames, redirect_frames,
                                refuse_frames)
from router.core.decide import Decision, Outcome
from router.core.keys import ConnectionInfo
from router.core.membership import PAIR_HOLD_S, host_port, parse_connector
from router.core.policies.base import Target
from router.core.pool import FollowContext, Pool
from router.embed import (OpenReader, RouteLog, RouterConfig, RouterService, TargetConfig, build_router,
                          refusal_text, route_line)

if TYPE_CHECKING:  # pragma: no cover
    from broker.config import AcceptorConfig, BrokerConfig
    from broker.node import Node

log = logging.getLogger("lodestone.broker.routing")

__all__ = ["EmbeddedRouting", "ClusterPoolSource"]

RECV_BYTES = 65536


def parse_connector_or_none(url: str | None) -> tuple[str, int, bool] | None:
    try:
        return parse_connector(url)
    except ValueError:
        return None


class ClusterPoolSource:
    """``source = "cluster"`` inside a broker: the pool follows this broker's cluster
    (``broker.cluster.bridge.ClusterNode.live_members``), see the module doc."""

    dynamic = True

    def __init__(self, node: "Node") -> None:
        self.node = node
        self._changed = trio.Event()
        self._pool: Pool | None = None
        self.last_sync: float | None = None
        self._listening = False
        self._names: dict[tuple[str, str, int], str] = {}   # (node id, host, port) -> slot name
        self._order: dict[str, int] = {}                    # slot name -> place in the pool
        self._seq = itertools.count()
        self._last: dict[str, Target] = {}                  # what the last targets() gave
        self._departed: dict[str, tuple[Target, float]] = {}  # pair members no longer listed
        self._down_since: dict[str, float] = {}   # node id -> when a member with backups went down

    def start(self, pool: Pool) -> None:
        self._pool = pool

    def close(self) -> None:
        cluster = self.node.cluster
        if self._listening and cluster is not None and self._wake in cluster.membership_listeners:
            cluster.membership_listeners.remove(self._wake)

    def _wake(self) -> None:
        self._changed.set()

    def _members(self, now: float) -> list[tuple[str, str, int, bool, str | None, bool]]:
        """``(node id, host, port, tls, management URL, backup)`` of the pool now: the live
        members, a member with a backup in sync also while its bridge is down (its probe
        fails: not ready) for at most :data:`PAIR_HOLD_S`, and the backups the members told
        this node of (``ClusterNode.member_backups``) — except one that took its node id over (it is the live member at that address)."""
        cluster = self.node.cluster
        if cluster is None:
            return []
        members = cluster.live_members()
        live = {node_id for node_id, _c, _m in members}
        for node_id in list(self._down_since):
            if node_id in live:
                del self._down_since[node_id]
        for node_id in sorted(set(cluster.member_backups) - live - {self.node.node_id}):
            # a member that went down with a backup in sync: its backup may take over, so it
            # stays (not ready) and its pair fails over — for PAIR_HOLD_S at most
            if not any(in_sync for _c, _m, in_sync in cluster.member_backups[node_id]):
                continue
            since = self._down_since.setdefault(node_id, now)
            m = cluster.members.get(node_id)
            if m is not None and m.connector and now - since < PAIR_HOLD_S:
                members.append((node_id, m.connector, m.management_url))
        out = []
        for node_id, connector, mgmt in members:
            c = parse_connector_or_none(connector)
            if c is not None:
                out.append((node_id, *c, mgmt or None, False))
        for node_id in sorted(cluster.member_backups):
            if node_id == self.node.node_id:
                continue
            member = cluster.members.get(node_id)
            at = parse_connector_or_none(member.connector) if member is not None else None
            for connector, mgmt, _in_sync in cluster.member_backups[node_id]:
                c = parse_connector_or_none(connector)
                if c is not None and c != at:
                    out.append((node_id, *c, mgmt or None, True))
        return out

    def targets(self, now: float | None = None) -> list[Target]:
        """The pool's targets (see ``_members``), with a node id's members forming its HA pair,
        so a pair whose primary is gone *fails over* — its keys wait for the backup
        (docs/router.md "HA pairs") — instead of its keys going elsewhere.

        A member keeps its slot name for its address (the node id for the first, ``<node
        id>@<host>:<port>`` for others) and its place in the order, so a backup that takes its
        node id over keeps its slot and state (as the router process's cluster membership does);
        one that comes back after it left joins at the end.
        A member of a pair that is no longer listed while another member of it serves (the dead
        primary, once its backup serves the node id from its own address) stays, not ready, for
        :data:`PAIR_HOLD_S`, so the pair does not shrink to one unready member — which
        would re-place its keys — before the new member's probe says active. Any other member
        leaves at once (Artemis's nodeDown)."""
        now = time.monotonic() if now is None else now
        out: dict[str, Target] = {}
        for node_id, host, port, tls, mgmt, backup in self._members(now):
            name = self._names.get((node_id, host, port))
            if name is None:
                taken = set(out) | set(self._names.values())
                name = node_id if node_id not in taken else f"{node_id}@{host_port(host, port)}"
                self._names[(node_id, host, port)] = name
            if name in out:
                continue   # that node id at that address once already (another scheme): the first
            out[name] = Target(node_id, host, port, tls, mgmt, name, node_id, backup)
        # pairs with a member serving now (a backup that took the node id over, say): the one that
        # served before is held while the new one is probed
        pairs = {t.pair for t in out.values() if not t.backup}
        gone = {n for n, since in self._down_since.items() if now - since >= PAIR_HOLD_S}
        for name, t in self._last.items():
            if name not in out and t.pair in pairs and name not in self._departed and t.node_id not in gone:
                self._departed[name] = (t, now)
        for name, (t, since) in list(self._departed.items()):
            if name in out or t.pair not in pairs or now - since >= PAIR_HOLD_S:
                del self._departed[name]
            else:
                out[name] = t
        for name in [n for n in self._order if n not in out]:
            del self._order[name]   # one that comes back joins at the end (the others keep their state)
        for name in out:
            if name not in self._order:
                self._order[name] = next(self._seq)
        self._last = out
        return [out[n] for n in sorted(out, key=self._order.__getitem__)]

    def next_expiry(self, now: float) -> float | None:
        """Seconds until a departed pair member or a down member leaves (None: none waits)."""
        times = [since + PAIR_HOLD_S for _t, since in self._departed.values()]
        times += [since + PAIR_HOLD_S for since in self._down_since.values() if since + PAIR_HOLD_S > now]
        if not times:
            return None
        return max(0.0, min(times) - now)

    def status(self) -> dict[str, Any]:
        cluster = self.node.cluster
        return {"source": "cluster", "cluster": cluster.cfg.name if cluster is not None else None,
                "members": [t.node_id for t in self._last.values()], "departed": sorted(self._departed),
                "root": getattr(cluster, "root", None),
                "last_sync": self.last_sync}

    async def follow(self, pool: Pool, ctx: FollowContext, task_status=trio.TASK_STATUS_IGNORED) -> None:
        cluster = self.node.cluster
        if cluster is not None:
            cluster.membership_listeners.append(self._wake)
            self._listening = True
        started = False
        while True:
            self._changed = trio.Event()
            changed = pool.sync_members(self.targets())
            root = getattr(cluster, "root", None)
            if root != pool.root:   # OpenAMQ's root election (broker.cluster.root)
                pool.root = root
                changed = True
            if changed and ctx.on_change is not None:
                ctx.on_change()
            self.last_sync = time.time()
            if not started:
                started = True
                task_status.started()
            wait = self.next_expiry(time.monotonic())
            with trio.move_on_after(wait if wait is not None else math.inf):
                await self._changed.wait()


@dataclass(slots=True)
class _Conn:
    """What a ``route`` line says about the client (``router.routelog.route_line``'s ``c``)."""

    id: str
    host: str
    port: int | None
    sni: str | None
    user: str | None
    roles: tuple[str, ...]
    mechanism: str | None
    container_id: str | None
    open_hostname: str | None


class EmbeddedRouting:
    """This broker's ``[routers.*]``: one ``RouterService`` each, the routing log, and the
    per-connection step the driver calls (see the module doc)."""

    def __init__(self, node: "Node", cfg: "BrokerConfig") -> None:
        self.node = node
        self.cfg = cfg
        self.configs: dict[str, RouterConfig] = dict(cfg.routers)
        self.services: dict[str, RouterService] = {}
        rl = cfg.routing_log
        path = rl.path if rl is not None and rl.enabled else None
        self.routelog = RouteLog(path, max_bytes=rl.max_bytes if rl else 10 * 1024 * 1024,
                                 backup_count=rl.backups if rl else 5,
                                 max_field_chars=rl.max_field_chars if rl else 1024)
        self.ready = trio.Event()
        self.counters = {"routed_local": 0, "redirected": 0, "refused": 0, "cluster_exempt": 0,
                         "handshake_errors": 0}

    # -- lifecycle -------------------------------------------------------------------------------
    def build(self, local_url: str, management_url: str) -> None:
        """Make the services once this node's address is known (its acceptors are bound)."""
        host, port, tls = parse_connector(local_url)
        for name, rc in self.configs.items():
            local = TargetConfig(name=self.cfg.name, host=host, port=port, tls=tls,
                                 management_url=management_url or None, node_id=self.node.node_id)
            rc = dataclasses.replace(rc, local_target=local)
            pc = rc.pool
            source = None
            if pc is not None and pc.source == "broker-cluster":
                source = ClusterPoolSource(self.node)
                ccfg = self.cfg.cluster
                if pc.username is None and ccfg is not None:  # probe members as the cluster user
                    rc = dataclasses.replace(rc, pool=dataclasses.replace(
                        pc, username=ccfg.user, password=ccfg.password))
            self.configs[name] = rc
            self.services[name] = build_router(rc, source=source, local_managed=True)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run every service (probes, membership, cache persistence) and the routing log."""
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.routelog.run)
                for svc in self.services.values():
                    await nursery.start(svc.run)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self.routelog.aclose()

    def set_active(self, active: bool) -> None:
        """The node is active (or no longer): its local target is ready (or not)."""
        for svc in self.services.values():
            local = svc.pool.local
            if local is not None:
                svc.pool.set_ready(local.target.slot, active, node_id=self.node.node_id)
        if active:
            self.ready.set()

    # -- one connection ----------------------------------------------------------------------------
    async def route_connection(self, acceptor: "AcceptorConfig", stream, conn_id: str, principal,
                               mechanism: str | None, source: str, sni: str | None,
                               leftover: bytes) -> bytes | None:
        """Route one authenticated client of ``acceptor``. Returns the bytes read so far (AMQP
        header, Open, anything after) when it stays on this broker; None when it was redirected,
        refused or broke the handshake (the reply is written; the caller lingers and closes)."""

        reader = OpenReader(self.cfg.max_frame_bytes)
        reader.receive_data(leftover)
        try:
            while True:
                ev = reader.next_event()
                if ev is not NEED_DATA:
                    break
                data = await stream.receive_some(RECV_BYTES)
                if not data:
                    return None
                reader.receive_data(data)
        except RemoteProtocolError as exc:
            self.counters["handshake_errors"] += 1
            reply = exc.reply or close_frames(exc.condition, exc.description)
            log.info("routed acceptor: bad handshake: %s", exc.description,
                     extra={"fields": {"conn": conn_id, "source": source, "condition": exc.condition}})
            await stream.send_all(reply)
            return None
        open_ = ev
        await self.ready.wait()
        name = acceptor.router
        svc = self.services[name]
        user = getattr(principal, "user", None)
        roles = tuple(getattr(principal, "roles", ()) or ())
        info = ConnectionInfo(source=source, sni_host=sni, container_id=open_.container_id, user=user,
                              roles=roles, acceptor=acceptor.name)
        t0 = time.perf_counter_ns()
        decision = await svc.route(info)
        decision_us = (time.perf_counter_ns() - t0) // 1000
        if decision.outcome is Outcome.OK and decision.local:
            action, reply = "local", None
            self.counters["routed_local"] += 1
        elif decision.outcome is Outcome.OK and decision.target is not None:
            t = decision.target
            action = "redirected"
            reply = redirect_frames(t.host, t.port, artemis_redirect_description(name, t.host, t.port))
            self.counters["redirected"] += 1
        else:
            action = "refused"
            reply = refuse_frames("amqp:connection:forced", refusal_text(name, decision))
            self.counters["refused"] += 1
        self._log(acceptor, conn_id, source, sni, user, roles, mechanism, open_, decision, decision_us, action)
        svc.connection_closed(decision)  # routed: a bounded-load assignment ends here, as on a redirect
        if reply is None:
            return bytes(reader.received)
        await stream.send_all(reply)
        return None

    def _log(self, acceptor, conn_id: str, source: str, sni, user, roles, mechanism, open_,
             decision: Decision, decision_us: int, action: str) -> None:
        host, _, port = source.rpartition(":")
        t = decision.target
        log.debug("route %s to %s" % (conn_id, f"{t.host}:{t.port}" if t is not None else "nothing"),
                 extra={"fields": {"router": acceptor.router, "outcome": decision.outcome.value,
                                   "action": action, "key": decision.explanation.key,
                                   "reason": decision.explanation.reason}})
        rl = self.routelog
        if rl.path is None:
            return
        c = _Conn(conn_id, host.strip("[]"), int(port) if port.isdigit() else None, sni, user, roles,
                  mechanism, open_.container_id, open_.hostname)
        rl.write_line(route_line(time.time(), 0, acceptor.router, acceptor.name, "redirect", c, decision,
                                 decision_us, action, rl.max_field_chars))

    def describe(self) -> dict:
        return {"routers": list(self.services), "counters": dict(self.counters),
                "routing_log": {"path": str(self.routelog.path) if self.routelog.path else None,
                                "lines_written": self.routelog.lines_written,
                                "lines_dropped": self.routelog.lines_dropped}}
