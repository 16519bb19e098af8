"""The broker node: what the engines and the management API talk to (it holds no sockets).

Theory of operation
-------------------
:class:`Node` owns the message core (:class:`broker.core.addresses.Broker`) over the journal
(:class:`JournalStore` adapts one to the other), the node-wide counters, the engines of every
open connection and the group-commit waiters. It is the :class:`broker.amqp.host.EngineHost`
of every engine the node runs — accepted connections (:mod:`broker.amqp.driver`) and the
connections it dials to peers (:mod:`broker.amqp.peer`) — and the state the management API
and ``/metrics`` read. :meth:`broker.lifecycle.NodeProcess.serve` builds one and runs its background tasks
(:meth:`Node.committer`, :meth:`Node.expiry_scanner`, :meth:`Node.activity_flusher`).

Group commit: the core writes journal records (in memory) as it goes; the committer task runs
``Journal.flush`` (write + one fsync) in a worker thread whenever records are pending and, when
it returns, accepts every durable send that waited for it. Appends made while a flush runs go
into the next one, so one fsync covers a whole batch of producers.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import json
import logging
import time
from typing import TYPE_CHECKING, Callable

import trio

from broker.activity import ActivityLog, iso_utc
from broker.amqp.host import EngineSettings
from broker.amqp.links import InternalServices, OwnedLink
from broker.amqp.message import body_duplicate_key
from broker.wire.frames import INTERNAL_PREFIX
from broker.wire.io.login import LoginGate
from broker.core.addresses import Broker
from broker.core.departures import (
    ALL,
    END_OF_STREAM,
    ConnectionFacts,
    Departure,
    Selector,
    Target,
    close_offsets,
    plan_departures,
)
from broker.core.deliveries import DEFAULT_PRIORITY, Message, Mirrored, Relayed
from broker.core.duplicates import DuplicateIds
from broker.core.filters import compile_queue_filter
from broker.wire.limits import OncePer, SourceLimiter
from broker.store.journal import GroupOp
from broker.wire.io.trioutil import Wakeup
from broker.cluster.bridge import CLUSTER_ROLE
from broker.ha.replication import failover_server_list
from broker.routing import EmbeddedRouting

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.engine import AmqpEngine
    from broker.config import BrokerConfig
    from broker.role import Role

log = logging.getLogger("lodestone.broker")

__all__ = ["Node", "JournalStore", "QUEUES_NS"]

QUEUES_NS = "queues"
#: journal pseudo-queues holding broker-internal records (not queues of the core)
INTERNAL_RECORDS_PREFIX = "$lodestone.records."


def _wall_ms() -> float:
    """The core's clock for message expiry: milliseconds since the epoch (AMQP timestamps)."""
    return time.time() * 1000.0


def _stored_properties(queue: str, msg: Message) -> dict | None:
    """What recovery needs beside the body: the address when it is not the queue's name, and
    the expiry and priority the broker computed on arrival (a ttl cannot be read back later)."""
    props = {"address": msg.address} if msg.address != queue else None
    if type(msg.origin) is Mirrored:     # a mirror's copy: the source's acknowledgement names it
        props = props or {}
        props["mirror"] = [msg.origin.node, msg.origin.id]
    elif type(msg.origin) is Relayed:    # a shared queue's message: its relay id moves with it
        props = props or {}
        props["relay"] = [msg.origin.node, msg.origin.id.hex()]
    if msg.expires or msg.priority != DEFAULT_PRIORITY:
        props = props or {}
        if msg.expires:
            props["expires"] = msg.expires
        if msg.priority != DEFAULT_PRIORITY:
            props["priority"] = msg.priority
    return props


class JournalStore:
    """Adapts the journal to the core's ``Store`` protocol and tells the committer about writes."""

    def __init__(self, journal, on_write):
        self.journal = journal
        self.on_write = on_write

    def add(self, queue: str, msg: Message) -> None:
        self.journal.add_message(queue, msg.mid, msg.body, _stored_properties(queue, msg), msg.delivery_count)
        self.on_write()

    def remove(self, queue: str, msg: Message) -> None:
        self.journal.ack(queue, msg.mid)
        self.on_write()

    def delivery_count_changed(self, queue: str, msg: Message) -> None:
        # a failed attempt came back to the queue: keep the count so max-delivery-count holds
        # across a restart (recovery hands it to Broker.restore_message)
        self.journal.update_delivery_count(queue, msg.mid, msg.delivery_count)
        self.on_write()

    def queue_created(self, definition: dict) -> None:
        self.journal.put_kv(QUEUES_NS, definition["name"], json.dumps(definition).encode())
        self.on_write()

    def queue_deleted(self, name: str) -> None:
        self.journal.delete_kv(QUEUES_NS, name)
        self.on_write()

    def add_record(self, queue: str, message_id: int, body: bytes) -> None:
        """A broker-internal record kept as a message of a pseudo-queue (the duplicate ids of
        ``broker.core.duplicates``); inside a group it joins the group (atomic with the messages
        it vouches for)."""
        group = self.__dict__.get("_group")
        if group is not None:
            group.append(GroupOp.add(queue, message_id, body))
            return
        self.journal.add_message(queue, message_id, body)
        self.on_write()

    def remove_record(self, queue: str, message_id: int) -> None:
        group = self.__dict__.get("_group")
        if group is not None:
            group.append(GroupOp.ack(queue, message_id))
            return
        self.journal.ack(queue, message_id)
        self.on_write()

    # -- transactions: a commit's message operations become one GROUP record -----------------
    def begin_group(self) -> None:
        """Collect add/remove/count changes until :meth:`end_group` (a transaction's commit).

        The collecting methods shadow the class's as instance attributes, so the writes of
        non-transactional traffic pay nothing for this."""
        ops: list[GroupOp] = []
        self._group = ops
        self.add = lambda queue, msg: ops.append(GroupOp.add(
            queue, msg.mid, msg.body, _stored_properties(queue, msg), msg.delivery_count))
        self.remove = lambda queue, msg: ops.append(GroupOp.ack(queue, msg.mid))
        self.delivery_count_changed = lambda queue, msg: ops.append(GroupOp.count(queue, msg.mid,
                                                                                  msg.delivery_count))

    def end_group(self) -> bool:
        """Write the collected operations as one atomic journal record; True if there were any."""
        ops = self.__dict__.pop("_group", None)
        for name in ("add", "remove", "delivery_count_changed"):
            self.__dict__.pop(name, None)
        if not ops:
            return False
        self.journal.append_group(ops)
        self.on_write()
        return True


class Node:
    """One running broker node: an :class:`~broker.amqp.host.EngineHost` (see the module docstring)."""

    def __init__(self, cfg: "BrokerConfig", security, node_id: str, journal=None, *, role: "Role | None" = None,
                 activity: ActivityLog | None = None, routed: bool = False, components: tuple = ()):
        """``role``: the role component that runs this node (``broker.role``; None: a node no
        process runs, as in tests); ``activity``: its activity log; ``routed``: build the
        connection routers of routed acceptors (``broker.routing``) — before any acceptor
        listens, so a routed acceptor never skips its router; ``components``: what runs beside
        the role (``broker.role.Component``), found by name (:meth:`component`)."""
        self.cfg = cfg
        self.settings = EngineSettings.from_config(cfg)  # what every engine of this node runs with
        self.security = security
        self.node_id = node_id
        self.short_id = node_id[:8]
        self.container_id = f"lodestone-{cfg.name}-{self.short_id}"
        self.journal = journal
        self._dirty = Wakeup()
        #: run by the committer before it takes the sends to answer (a mirror writes its batch of
        #: events and releases its journal hold: every answered send's record is then flushed)
        self.before_commit: list[Callable[[], None]] = []
        #: the mirrors with ``sync = true`` (broker.connections.mirror.MirrorSource): the committer
        #: answers a batch only once each of them had its events so far accepted by its target
        self.sync_mirrors: list = []
        self._mirror_held: collections.deque = collections.deque()   # (marks, synced seq, waiters)
        self.role = role
        self._components = {c.name: c for c in components if c.name}
        #: the internal link services (EngineHost.services): $lodestone.replication.* here,
        #: the cluster's for the other $lodestone. addresses once there is one (set_cluster)
        self.services = InternalServices()
        self.services.register(REPLICATION_PREFIX, _ReplicationLinks(self))
        store = JournalStore(journal, self._dirty.set) if journal is not None else None
        cl = cfg.cluster
        dups = DuplicateIds(size=cfg.id_cache_size, persist=cfg.persist_id_cache and journal is not None,
                            max_ids=cfg.id_cache_max_ids, origin_size=cl.id_cache_size if cl else None,
                            origin_persist=(cl.persist_id_cache and journal is not None) if cl else None)
        dups.on_duplicate = self._duplicate_detected
        dups.on_cap_evicted = self._duplicate_id_cap_evicted
        self.core = Broker(cfg.settings, store, clock=_wall_ms, wildcards=cfg.wildcards, duplicates=dups)
        self.core.compile_filter = compile_queue_filter
        self.engines: dict[str, "AmqpEngine"] = {}
        self.opened_at: dict[str, float] = {}
        self.window_start: dict[str, float] = {}
        self.sync_waiters: dict["AmqpEngine", list] = {}
        #: ``fence()`` says why this node must acknowledge nothing now (None: it may): a member
        #: of a pair coordinated by ZooKeeper past its lease (broker.ha.quorum); checked before
        #: any send or commit is answered
        self.fence: Callable[[], str | None] | None = None
        #: what waits for records to be durable without answering a client (a mirror's batches
        #: of events are sent only then): answered as sends are, after fsync and the backup
        self.write_gates: dict = {}
        self.counters: collections.Counter = collections.Counter()
        self.user_connections: collections.Counter = collections.Counter()  # per user ([resource-limits])
        self.messages_in = 0
        self.links_opened = 0
        self.active = False
        self.started_at = time.time()
        self.started_mono = time.monotonic()
        self._connections: trio.Nursery | None = None   # open while serving: connections_open()
        self.activity = activity
        self.recovery: dict = {}
        self.internal_records: dict[str, list[tuple[int, bytes]]] = {}  # recovered, see recover()
        self.cluster = None  # broker.cluster.bridge.ClusterNode when [cluster] is configured
        self.shared_queues = None  # broker.cluster.shared.SharedQueues: the engines relay shared sends through it
        #: broker.routing.EmbeddedRouting when [routers.*] are configured
        self.routing = EmbeddedRouting(self, cfg) if routed else None
        self.broadcast_counters: dict[str, dict] = {}  # broadcast group -> sent / send_failed
        # authentication and per-source admission (broker.wire.io.login, broker.wire.limits)
        self.login_gate = LoginGate(security, name=cfg.name) if security is not None else None
        self.source_limiters = {a.name: SourceLimiter(a.limits) for a in cfg.acceptors}
        self.acceptor_active: collections.Counter = collections.Counter()
        self.log_once = OncePer(security.login.log_interval_s if security is not None else 60.0)

    # -- recovery --------------------------------------------------------------------------
    def recover(self) -> dict:
        """Rebuild queues and messages from the journal (call before serving)."""
        j = self.journal
        if j is None:
            return {}
        core = self.core
        for name, raw in sorted(j.kv(QUEUES_NS).items()):
            try:
                core.restore_queue(json.loads(raw))
            except (ValueError, KeyError) as exc:
                log.error("unreadable queue definition %r in the journal: %s", name, exc)
        restored = orphans = 0
        self.internal_records = {}
        for qname, msgs in j.live_messages().items():
            if qname.startswith(INTERNAL_RECORDS_PREFIX):  # broker-internal records, read below
                self.internal_records[qname] = [(m.message_id, m.body) for m in msgs]
                for m in msgs:
                    core.bump_mid(m.message_id)
                continue
            q = core.queues.get(qname)
            for m in msgs:
                props = m.properties or {}
                address = props.get("address") or (q.address if q else qname)
                priority = props.get("priority", DEFAULT_PRIORITY)
                expires = props.get("expires", 0)
                if not isinstance(priority, int) or not isinstance(expires, (int, float)):
                    priority, expires = DEFAULT_PRIORITY, 0
                mirrored = props.get("mirror")
                origin = (Mirrored(mirrored[0], mirrored[1]) if isinstance(mirrored, list) and len(mirrored) == 2
                          and isinstance(mirrored[0], str) and isinstance(mirrored[1], int) else None)
                relayed = props.get("relay")
                if origin is None and isinstance(relayed, list) and len(relayed) == 2 \
                        and isinstance(relayed[0], str) and isinstance(relayed[1], str):
                    try:
                        origin = Relayed(relayed[0], bytes.fromhex(relayed[1]))
                    except ValueError:
                        origin = None
                if core.restore_message(qname, m.message_id, m.body, address, m.delivery_count, priority, expires,
                                        origin):
                    restored += 1
                else:
                    orphans += 1
                    j.ack(qname, m.message_id)
        duplicate_ids = core.duplicates.restore(self.internal_records)  # ids with their messages
        if duplicate_ids:
            self._hold_recovered_ids()
        rep = j.report
        self.recovery = {"messages": restored, "orphans_dropped": orphans, "queues": len(core.queues),
                         "duplicate_ids": duplicate_ids,
                         "torn_bytes_truncated": rep.torn_bytes_truncated, "problems": list(rep.problems)}
        for p in rep.problems:
            log.warning("journal recovery: %s", p)
        log.info("recovered from journal", extra={"fields": {
            "messages": restored, "queues": len(core.queues), "duplicate_ids": duplicate_ids,
            "torn_bytes": rep.torn_bytes_truncated, "records": rep.records_read}})
        return self.recovery

    def _hold_recovered_ids(self) -> None:
        """Which recovered queue holds a copy of which remembered id (``DuplicateIds.hold``: a
        copy of the same message moved here later is dropped)."""
        dups = self.core.duplicates
        for q in self.core.queues.values():
            if q.name.startswith(INTERNAL_PREFIX):
                continue
            for msg in q.messages:
                key = body_duplicate_key(msg.body)
                if key is not None:
                    dups.hold(msg.address, key, (q.name,))

    def declare_configured_addresses(self) -> None:
        for decl in self.cfg.addresses:
            self.core.declare_address(decl.name, decl.routing_types)
            if decl.filter is not None:
                self.core.set_queue_filter(decl.name, compile_queue_filter(decl.filter), decl.filter)

    # -- the engines' host (broker.amqp.host.EngineHost) ---------------------------------------
    def count(self, event: str, n: int = 1) -> None:
        """Count an engine's outcome. ``messages_in`` and ``links_opened`` are the node's own
        series (``/metrics`` ``messages_in_total``, the management API); the rest are events."""
        if event == "messages_in":
            self.messages_in += n
        elif event == "links_opened":
            self.links_opened += n
        else:
            self.counters[event] += n

    def authorize(self, principal, permission: str, address: str) -> bool:
        ok = self.security.check(principal, permission, address)
        if not ok:
            self.counters[f"denied_{permission}"] += 1
        return ok

    # -- the role and the lifecycle (broker.role, broker.lifecycle) --------------------------
    @property
    def replication(self):
        """The replication stream of an active replication primary
        (``broker.ha.replication.ReplicationSource``, the role's), else None."""
        return self.role.replication if self.role is not None else None

    def component(self, name: str):
        """The component of that name running beside this node's role, or None."""
        return self._components.get(name)

    def backups(self) -> tuple[tuple[str, str, bool], ...]:
        """This node's HA backups, ``(connector, management URL, in sync)``: a replication
        backup connected to it, or the shared-store backup waiting on its data directory."""
        return self.role.backups() if self.role is not None else ()

    def set_active(self, active: bool) -> None:
        """Serving clients (``/health``, the embedded routers' own target) or not."""
        self.active = active
        if self.routing is not None:
            self.routing.set_active(active)

    @contextlib.asynccontextmanager
    async def connections_open(self):
        """The nursery every accepted connection runs in (``connection_nursery``), open while
        the node serves (``broker.lifecycle.NodeProcess.serve``)."""
        async with trio.open_nursery() as nursery:
            self._connections = nursery
            try:
                yield nursery
            finally:
                self._connections = None

    @property
    def connection_nursery(self) -> trio.Nursery | None:
        return self._connections

    async def close_connections(self, grace_s: float) -> None:
        """Close every client connection (``amqp:connection:forced``) and wait up to
        ``grace_s`` for them to end."""
        self.shutdown_connections()
        with trio.move_on_after(grace_s):
            while self.engines:
                await trio.sleep(0.02)

    def close_activity(self) -> None:
        """Write the last activity records and close the activity log."""
        self.flush_all_activity()
        if self.activity is not None:
            self.activity.close()

    def set_cluster(self, cluster) -> None:
        """This node's cluster (``broker.cluster.bridge.ClusterNode``): it serves the
        ``$lodestone.`` addresses (but replication's) from now on."""
        self.cluster = cluster
        self.services.register(INTERNAL_PREFIX, cluster)
        self.shared_queues = cluster.shared   # OpenAMQ's shared queues (None without a root election)

    @property
    def open_properties(self) -> dict:
        """Extra Open properties of the connections this node dials (the OpenAMQ cluster key)."""
        c = self.cfg.cluster
        props = {}
        if c is not None and c.key is not None:
            props["cluster-key"] = c.key
        if self.cluster is not None:
            props["cluster-connector"] = self.cluster.connector
            props["started-ms"] = self.cluster.started_ms
        return props

    @property
    def server_open_properties(self) -> dict:
        """Extra Open properties of accepted connections, for a cluster node: its start time, so
        two nodes with one node id can tell which one is the newcomer (broker.cluster.bridge),
        and the cluster's live members, for clients (``lodestone:cluster-members``,
        docs/cluster.md "Topology to clients"); for a replication primary with a backup in sync,
        or a shared-store node with a backup waiting on its files, Artemis's
        ``failover-server-list`` (docs/ha.md)."""
        props = self.cluster.open_properties() if self.cluster is not None else {}
        fsl = failover_server_list([connector for connector, _mgmt, in_sync in self.backups() if in_sync])
        if fsl:
            props = {**props, "failover-server-list": fsl}
        return props

    def _duplicate_detected(self, address: str, transactional: bool) -> None:
        """A message whose ``_AMQ_DUPL_ID`` its address remembers (``broker.core.duplicates``).
        Artemis logs AMQ222059 at WARN for every one; a producer that resends a batch would fill
        the log, so we log once per address per interval and count them all."""
        self.counters["duplicate_id_in_transaction" if transactional else "duplicate_id_dropped"] += 1
        if self.log_once(f"duplicate-id {address}", time.monotonic()):
            log.warning("duplicate message detected, not routed (Artemis AMQ222059); logged once per address "
                        "per interval, all counted in GET /api/v1/addresses duplicates_dropped",
                        extra={"fields": {"address": address, "transactional": transactional,
                                          "duplicates_dropped": self.core.duplicates.dropped[address]}})

    def _duplicate_id_cap_evicted(self, address: str) -> None:
        """``[node] id-cache-max-ids`` took an id of ``address`` before its ring would have."""
        self.counters["duplicate_id_cap_evicted"] += 1
        if self.log_once("duplicate-id cap", time.monotonic()):
            log.warning("duplicate ids: the node remembers id-cache-max-ids ids; the least recently used "
                        "addresses forget their oldest ids early", extra={"fields": {
                            "id_cache_max_ids": self.cfg.id_cache_max_ids, "address": address}})

    def address_created(self, address: str) -> None:
        self.counters["addresses_auto_created"] += 1

    def await_sync(self, engine: "AmqpEngine", delivery) -> None:
        """Accept ``delivery`` once the journal records written so far are durable, and the
        events so far of every sync mirror reached its target."""
        if self.journal is None and not self.sync_mirrors:  # [node] persistent = false: nothing to wait for
            engine.synced([delivery])
            return
        lst = self.sync_waiters.get(engine)
        if lst is None:
            self.sync_waiters[engine] = [delivery]
        else:
            lst.append(delivery)
        self._dirty.set()

    def await_written(self, gate, token) -> None:
        """Call ``gate.synced([token, ...])`` once the journal records written so far are durable
        here and, when a backup gates sends, held by the backup too (never waits for a sync
        mirror's target: a mirror gates its own events this way)."""
        lst = self.write_gates.get(gate)
        if lst is None:
            self.write_gates[gate] = [token]
        else:
            lst.append(token)
        self._dirty.set()

    def engine_started(self, engine: "AmqpEngine") -> None:
        self.engines[engine.conn_id] = engine
        self.opened_at[engine.conn_id] = time.time()
        self.window_start[engine.conn_id] = time.time()
        self.counters["connections_accepted"] += 1
        limit = engine.limits.max_connections
        have = self.user_connections[engine.user]
        if 0 <= limit <= have:
            # the client's Open gets a failed Open + Close (the close line logs it)
            engine.fail_before_open("amqp:resource-limit-exceeded", engine.limit_exceeded(
                "max-connections", limit, f"user {engine.user or '<anonymous>'} has {have} connections open",
                log_line=False))
            return
        self.user_connections[engine.user] += 1
        engine.user_counted = True

    def engine_finished(self, engine: "AmqpEngine") -> None:
        if engine.user_counted:
            engine.user_counted = False
            left = self.user_connections[engine.user] - 1
            if left > 0:
                self.user_connections[engine.user] = left
            else:
                del self.user_connections[engine.user]
        self.engines.pop(engine.conn_id, None)
        self.opened_at.pop(engine.conn_id, None)
        self.window_start.pop(engine.conn_id, None)
        waiting = self.sync_waiters.pop(engine, None)
        if waiting:
            engine.synced(waiting)  # closed: only releases the deliveries

    def connection_opened(self, engine: "AmqpEngine") -> None:
        c = self.cfg.cluster
        if c is not None and c.require_client_key and not engine.client:
            props = engine.connection.remote_properties or {}
            key = props.get("cluster-key") if isinstance(props, dict) else None
            if not isinstance(key, str) or not hmac.compare_digest(key.encode(), c.key.encode()):
                self.counters["client_key_refused"] += 1
                if self.log_once(f"client-key {engine.source.rsplit(':', 1)[0]}", time.monotonic()):
                    log.warning("connection refused: no or wrong cluster key in its Open properties "
                                "(require-client-key)", extra={"fields": {
                                    "conn": engine.conn_id, "container_id": engine.container_id,
                                    "user": engine.user, "source": engine.source}})
                engine.close_with("amqp:unauthorized-access",
                                  "this cluster requires its key in the Open property cluster-key")
                return
        log.info("connection open", extra={"fields": {
            "conn": engine.conn_id, "container_id": engine.container_id, "user": engine.user,
            "source": engine.source, "tls": engine.tls}})

    def connection_closed(self, engine: "AmqpEngine") -> None:
        self._flush_activity(engine, final=True)
        err = engine.error
        fields = {"conn": engine.conn_id, "container_id": engine.container_id, "user": engine.user,
                  "source": engine.source}
        if err is not None:
            fields["condition"] = err.name
            fields["description"] = err.description
            self.counters["connection_errors"] += 1
        if engine.opened:
            log.info("connection close", extra={"fields": fields})
        elif err is not None:
            log.info("connection failed before open", extra={"fields": fields})

    # -- activity log ------------------------------------------------------------------------
    def _flush_activity(self, engine: "AmqpEngine", *, final: bool = False) -> None:
        if self.activity is None:
            return
        now = time.time()
        start = self.window_start.get(engine.conn_id, now)
        counters = engine.take_activity()
        self.activity.write(engine.describe(), start, now, counters, final=final)
        self.window_start[engine.conn_id] = now

    def flush_all_activity(self) -> None:
        for engine in list(self.engines.values()):
            if not engine.closed:
                self._flush_activity(engine)
        if self.cluster is not None and self.activity is not None:
            now = time.time()
            start = self.window_start.get("cluster", self.started_at)
            for peer, counters in self.cluster.take_activity().items():
                self.activity.write({"id": f"cluster:{peer[:8]}", "container_id": None, "user": None,
                                     "source": None}, start, now, counters, peer_node_id=peer)
            self.window_start["cluster"] = now

    # -- management views ------------------------------------------------------------------
    def connections(self) -> list[dict]:
        out = []
        for e in self.engines.values():
            if not e.opened or e.closed:
                continue
            d = e.describe()
            d["opened_at"] = iso_utc(self.opened_at.get(e.conn_id, self.started_at))
            d["internal"] = self._internal(e)
            out.append(d)
        return out

    @property
    def connection_count(self) -> int:
        return sum(1 for e in self.engines.values() if e.opened and not e.closed)

    # -- background tasks --------------------------------------------------------------------
    async def committer(self) -> None:
        """Group commit: flush+fsync whatever is pending, then accept the sends that waited."""
        j = self.journal
        while True:
            await self._dirty.wait()
            for hook in self.before_commit:
                hook()
            waiters, self.sync_waiters = self.sync_waiters, {}
            gates, self.write_gates = self.write_gates, {}
            marks = tuple((m, m.seq) for m in self.sync_mirrors)
            synced = 0
            if j is not None:
                try:
                    synced = await trio.to_thread.run_sync(j.flush)
                except Exception as exc:  # disk full, I/O error: refuse the sends, keep serving
                    log.error("journal flush failed: %s", exc)
                    self.counters["journal_flush_failed"] += 1
                    for engine, ds in waiters.items():
                        engine.sync_failed(ds, f"journal write failed: {exc}")
                    continue
                self.counters["journal_flushes"] += 1
            if gates:
                self._answer(synced, gates)
            if not waiters:
                continue
            if self._mirror_held or not all(m.confirmed(seq) for m, seq in marks):
                self._mirror_held.append((marks, synced, waiters))   # answered once the targets have it
                continue
            self._answer(synced, waiters)

    def set_fence(self, fence: "Callable[[], str | None] | None") -> None:
        """Install ``fence`` (see the attribute): the role of a pair coordinated by ZooKeeper."""
        self.fence = fence

    def _answer(self, synced: int, waiters: dict) -> None:
        fence = self.fence
        if fence is not None and fence() is not None:
            return   # never answered: the role stops serving (the producers see the connection end)
        repl = self.replication
        if repl is not None and repl.gating:
            repl.hold(synced, waiters)   # answered once the backup holds them too
            return
        for engine, ds in waiters.items():
            engine.synced(ds)

    def mirror_confirmed(self) -> None:
        """A sync mirror's target accepted events: answer the batches it was holding, in order."""
        held = self._mirror_held
        while held and all(m.confirmed(seq) for m, seq in held[0][0]):
            _marks, synced, waiters = held.popleft()
            self._answer(synced, waiters)

    @property
    def mirror_held_count(self) -> int:
        """Sends and commits waiting for a sync mirror's target."""
        return sum(len(ds) for _m, _s, waiters in self._mirror_held for ds in waiters.values())

    async def expiry_scanner(self) -> None:
        """Artemis's ``message-expiry-scan-period``: expired messages leave queues nobody reads.

        Dispatch never hands out an expired message anyway; the scan makes queue depths (and
        the expiry address) true without consumers. It walks the queues in slices so producers
        and consumers keep being served during a scan of many queues.
        """
        period = self.cfg.expiry_scan_period_ms / 1000.0
        while True:
            await trio.sleep(period)
            names = list(self.core.queues)
            for i in range(0, len(names), 500):
                now = _wall_ms()
                for name in names[i:i + 500]:
                    q = self.core.queues.get(name)
                    if q is not None and q.messages:
                        n = q.expire_scan(now)
                        if n:
                            self.counters["messages_expired"] += n
                            self._dirty.set()
                await trio.sleep(0)

    async def activity_flusher(self) -> None:
        while True:
            await trio.sleep(self.cfg.activity.flush_interval_s)
            self.flush_all_activity()

    def shutdown_connections(self) -> None:
        for e in list(self.engines.values()):
            e.abort("amqp:connection:forced", "broker shutting down")
            e.wake()

    # -- telling clients where to go (broker.core.departures) ---------------------------------
    def plan_departures(self, selector: Selector, target: Target | None, why: str,
                        unmodified: str = END_OF_STREAM) -> list[Departure]:
        """Which open client connections ``selector`` picks and what each gets:
        ``amqp:connection:redirect`` to ``target`` for those that follow redirects, else
        ``unmodified`` (an end of stream without a Close, by default; broker.core.departures).
        The cluster user's connections and other brokers' broker connections (a mirror into
        this node) are never picked."""

        facts = []
        for e in self.engines.values():
            if not e.opened or e.closed:
                continue
            facts.append(ConnectionFacts(e.conn_id, e.container_id, e.user, e.follows_redirect, self._internal(e)))
        return plan_departures(facts, selector, target, why, unmodified)

    @staticmethod
    def _internal(e) -> bool:
        """Dialled by this node, another broker's broker connection, or the cluster user's:
        never a client to move (``plan_departures``; ``GET /api/v1/connections`` ``internal``)."""
        return bool(e.client or e.peer_broker or CLUSTER_ROLE in getattr(e.principal, "roles", ()))

    async def depart_all(self, target: Target | None, why: str, wait_s: float) -> None:
        """Move every client connection (failback, scale-down: the listeners are closed): plan,
        close and wait up to ``wait_s``, then again for any connection that finished its
        handshake meanwhile (at most three rounds), so that no client is left serving."""
        for _ in range(3):
            plan = self.plan_departures(ALL, target, why)
            if not plan:
                return
            await self.depart(plan, wait_s=wait_s)

    async def depart(self, departures: list[Departure], *, rate_per_second: float | None = None,
                     wait_s: float = 0.0) -> int:
        """Close each connection of ``departures`` as planned, spread at ``rate_per_second``
        (all at once without), then wait up to ``wait_s`` until they are gone; returns how many
        were still open when their turn came. A closed connection's socket is closed right
        after our Close (the driver's half-close, a short linger and a reset), an ended one's
        without a Close, so that every client sees it gone at once (broker.core.departures)."""
        closed = 0
        start = trio.current_time()
        for d, offset in zip(departures, close_offsets(len(departures), rate_per_second)):
            if offset:
                await trio.sleep_until(start + offset)
            e = self.engines.get(d.conn_id)
            if e is None or e.closed:
                continue
            closed += 1
            self.counters["connections_redirected" if d.info is not None else
                          "connections_ended" if d.condition == END_OF_STREAM else "connections_forced"] += 1
            log.info("connection closed to move its client", extra={"fields": {
                "conn": e.conn_id, "container_id": e.container_id, "user": e.user,
                "condition": d.condition, "description": d.description}})
            e.departing = True
            try:
                if d.condition == END_OF_STREAM:
                    e.drop()
                else:
                    e.abort(d.condition, d.description, d.info)
                e.wake()
            except Exception:   # one connection's trouble must not stop the others' departure
                log.exception("closing connection %s to move its client failed", e.conn_id)
        if wait_s > 0:
            ids = {d.conn_id for d in departures}
            with trio.move_on_after(wait_s):
                while any(i in self.engines for i in ids):
                    await trio.sleep(0.02)
        return closed


#: the addresses of a backup's replication links (broker.ha.protocol RECORDS_ADDRESS, ACKS_ADDRESS)
REPLICATION_PREFIX = INTERNAL_PREFIX + "replication."


class _ReplicationLinks:
    """``$lodestone.replication.*``: a backup's links, served by ``node.replication``
    (``broker.ha.replication.ReplicationSource``) while this node is a replicating primary."""

    def __init__(self, node: Node) -> None:
        self.node = node

    def attach(self, engine: "AmqpEngine", link: OwnedLink):
        if self.node.replication is None:
            return ("amqp:not-found", "this node takes no backup ([ha] policy is not replication)")
        return self.node.replication.attach(engine, link)
