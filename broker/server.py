"""A broker node: the shell that ties config, store, core, AMQP listeners and management together.

Theory of operation
-------------------
:func:`run_node` opens (and locks) the data directory, opens the journal and rebuilds the core
from it (queue definitions from KV records, then every live message), then starts, in one
nursery: one listener per acceptor, the management HTTP server, the group-commit task and the
activity-log flusher. It prints ``listening amqp amqp://host:port`` (``amqps`` for TLS) and
``listening management http://host:port`` once each socket is bound, then marks the node active.
SIGTERM/SIGINT close every client connection with ``amqp:connection:forced``, flush the journal
and the activity log, release the data-directory lock and return.

Group commit: the core writes journal records (in memory) as it goes; the committer task runs
``Journal.flush`` (write + one fsync) in a worker thread whenever records are pending and, when
it returns, accepts every durable send that waited for it. Appends made while a flush runs go
into the next one, so one fsync covers a whole batch of producers.

:class:`Node` is the object the engine and the management API talk to; it holds no sockets.
"""

from __future__ import annotations

import collections
import json
import logging
import signal
import time
from typing import TYPE_CHECKING

import trio

from broker.activity import ActivityLog, iso_utc
from broker.auth import LoginGate
from broker.core.addresses import Broker
from broker.core.deliveries import DEFAULT_PRIORITY, Message
from broker.core.filters import compile_queue_filter
from broker.core.limits import OncePer, SourceLimiter
from broker.logsetup import print_listening
from broker.store.journal import GroupOp
from broker.trioutil import Wakeup

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.engine import AmqpEngine
    from broker.config import BrokerConfig

log = logging.getLogger("lodestone.broker")

__all__ = ["Node", "JournalStore", "run_node", "VERSION"]

VERSION = "0.1.0"
QUEUES_NS = "queues"
SHUTDOWN_GRACE_S = 2.0


def _wall_ms() -> float:
    """The core's clock for message expiry: milliseconds since the epoch (AMQP timestamps)."""
    return time.time() * 1000.0


class JournalStore:
    """Adapts the journal to the core's ``Store`` protocol and tells the committer about writes."""

    def __init__(self, journal, on_write):
        self.journal = journal
        self.on_write = on_write

    def add(self, queue: str, msg: Message) -> None:
        props = {"address": msg.address} if msg.address != queue else None
        if msg.expires or msg.priority != DEFAULT_PRIORITY:  # what recovery cannot read from the body
            props = props or {}
            if msg.expires:
                props["expires"] = msg.expires
            if msg.priority != DEFAULT_PRIORITY:
                props["priority"] = msg.priority
        self.journal.add_message(queue, msg.mid, msg.body, props, msg.delivery_count)
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

    # -- transactions: a commit's message operations become one GROUP record -----------------
    def begin_group(self) -> None:
        """Collect add/remove/count changes until :meth:`end_group` (a transaction's commit).

        The collecting methods shadow the class's as instance attributes, so the writes of
        non-transactional traffic pay nothing for this."""
        ops: list[GroupOp] = []
        self._group = ops
        self.add = lambda queue, msg: ops.append(GroupOp.add(
            queue, msg.mid, msg.body, {"address": msg.address} if msg.address != queue else None,
            msg.delivery_count))
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
    """One running broker node (see the module docstring)."""

    def __init__(self, cfg: "BrokerConfig", security, node_id: str, journal=None):
        self.cfg = cfg
        self.security = security
        self.node_id = node_id
        self.short_id = node_id[:8]
        self.container_id = f"lodestone-{cfg.name}-{self.short_id}"
        self.journal = journal
        self._dirty = Wakeup()
        store = JournalStore(journal, self._dirty.set) if journal is not None else None
        self.core = Broker(cfg.settings, store, clock=_wall_ms, wildcards=cfg.wildcards)
        self.core.compile_filter = compile_queue_filter
        self.engines: dict[str, "AmqpEngine"] = {}
        self.opened_at: dict[str, float] = {}
        self.window_start: dict[str, float] = {}
        self.sync_waiters: dict["AmqpEngine", list] = {}
        self.counters: collections.Counter = collections.Counter()
        self.user_connections: collections.Counter = collections.Counter()  # per user ([resource-limits])
        self.messages_in = 0
        self.links_opened = 0
        self.active = False
        self.started_at = time.time()
        self.started_mono = time.monotonic()
        self.connection_nursery: trio.Nursery | None = None
        self.activity: ActivityLog | None = None
        self.recovery: dict = {}
        # authentication and per-source admission (broker.auth, broker.core.limits)
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
        for qname, msgs in j.live_messages().items():
            q = core.queues.get(qname)
            for m in msgs:
                props = m.properties or {}
                address = props.get("address") or (q.address if q else qname)
                priority = props.get("priority", DEFAULT_PRIORITY)
                expires = props.get("expires", 0)
                if not isinstance(priority, int) or not isinstance(expires, (int, float)):
                    priority, expires = DEFAULT_PRIORITY, 0
                if core.restore_message(qname, m.message_id, m.body, address, m.delivery_count, priority, expires):
                    restored += 1
                else:
                    orphans += 1
                    j.ack(qname, m.message_id)
        rep = j.report
        self.recovery = {"messages": restored, "orphans_dropped": orphans, "queues": len(core.queues),
                         "torn_bytes_truncated": rep.torn_bytes_truncated, "problems": list(rep.problems)}
        for p in rep.problems:
            log.warning("journal recovery: %s", p)
        log.info("recovered from journal", extra={"fields": {
            "messages": restored, "queues": len(core.queues), "torn_bytes": rep.torn_bytes_truncated,
            "records": rep.records_read}})
        return self.recovery

    def declare_configured_addresses(self) -> None:
        for decl in self.cfg.addresses:
            self.core.declare_address(decl.name, decl.routing_types)
            if decl.filter is not None:
                self.core.set_queue_filter(decl.name, compile_queue_filter(decl.filter), decl.filter)

    # -- called by engines -----------------------------------------------------------------
    def authorize(self, principal, permission: str, address: str) -> bool:
        ok = self.security.check(principal, permission, address)
        if not ok:
            self.counters[f"denied_{permission}"] += 1
        return ok

    def address_created(self, address: str) -> None:
        self.counters["addresses_auto_created"] += 1

    def await_sync(self, engine: "AmqpEngine", delivery) -> None:
        """Accept ``delivery`` once the journal records written so far are durable."""
        lst = self.sync_waiters.get(engine)
        if lst is None:
            self.sync_waiters[engine] = [delivery]
        else:
            lst.append(delivery)
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

    # -- management views ------------------------------------------------------------------
    def connections(self) -> list[dict]:
        out = []
        for e in self.engines.values():
            if not e.opened or e.closed:
                continue
            d = e.describe()
            d["opened_at"] = iso_utc(self.opened_at.get(e.conn_id, self.started_at))
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
            waiters, self.sync_waiters = self.sync_waiters, {}
            try:
                await trio.to_thread.run_sync(j.flush)
            except Exception as exc:  # disk full, I/O error: refuse the sends, keep serving
                log.error("journal flush failed: %s", exc)
                self.counters["journal_flush_failed"] += 1
                for engine, ds in waiters.items():
                    engine.sync_failed(ds, f"journal write failed: {exc}")
                continue
            self.counters["journal_flushes"] += 1
            for engine, ds in waiters.items():
                engine.synced(ds)

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


async def run_node(cfg: "BrokerConfig", *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run a broker node until SIGTERM/SIGINT (or cancellation)."""
    from broker.amqp.driver import serve_amqp
    from broker.core import security as security_mod
    from broker.http import serve_http
    from broker.management import make_handler
    from broker.store.datadir import open_data_dir

    from broker.config import check_anonymous

    security = security_mod.load_users(cfg.users_file)
    check_anonymous(cfg, security.anonymous_enabled)
    for w in security.warnings():
        log.warning("security: %s", w)
    datadir = open_data_dir(cfg.data_dir)
    journal = None
    try:
        if cfg.persistent:
            journal = datadir.open_journal(cfg.journal)
        node = Node(cfg, security, datadir.node_id, journal)
        node.recover()
        node.declare_configured_addresses()
        if cfg.activity.enabled:
            node.activity = ActivityLog(cfg.activity.path or (cfg.data_dir / "activity.jsonl"),
                                        node.node_id, cfg.name)
        log.info("node starting", extra={"fields": {"node_id": node.node_id, "name": cfg.name,
                                                     "data_dir": str(cfg.data_dir)}})
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as outer:
                async with trio.open_nursery() as conns:
                    node.connection_nursery = conns
                    async with trio.open_nursery() as services:
                        for acc in cfg.acceptors:
                            host, port = await services.start(serve_amqp, node, acc)
                            print_listening(acc.scheme, f"{acc.scheme}://{_hostport(host, port)}")
                        if cfg.management.enabled:
                            host, port = await services.start(
                                serve_http, make_handler(node), cfg.management.host, cfg.management.port)
                            print_listening("management", f"http://{_hostport(host, port)}")
                        if journal is not None:
                            services.start_soon(node.committer)
                        if node.activity is not None:
                            services.start_soon(node.activity_flusher)
                        if cfg.expiry_scan_period_ms > 0:
                            services.start_soon(node.expiry_scanner)
                        node.active = True
                        log.info("node active", extra={"fields": {"node_id": node.node_id}})
                        task_status.started(node)
                        async for sig in signals:
                            log.info("signal %s: shutting down", signal.Signals(sig).name)
                            break
                        node.active = False
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
        datadir.close()
    log.info("node stopped")


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
