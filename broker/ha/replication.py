"""Replication: a primary streams its journal to its backup, and acknowledges a durable send only
once the backup holds it (seed 001 "Data Replication", seed 003's reliable-persistent sequence;
docs/ha.md "Replication").

Theory of operation
-------------------
**The primary** (:class:`ReplicationSource`, ``node.replication``) accepts one backup. The
backup dials it as the cluster user and attaches ``$lodestone.replication.acks`` (its
:data:`~broker.ha.protocol.HELLO`, then :data:`~broker.ha.protocol.SYNCED` seqs) and
``$lodestone.replication.records`` (what the primary sends, ``broker.ha.protocol``). On the
hello the primary takes a snapshot of its journal and, under the same journal lock, installs a
*tap* that captures every record appended afterwards (``Journal.snapshot(tap=...)``): the
snapshot (initial sync) goes first, then the tapped records, in seq order, without a gap or a
duplicate, whatever clients do meanwhile. Batches are cut at about 1 MiB.

The pipeline is keyed by journal seq. A durable send is answered by the node's group commit
(``Node.committer``) once the primary's own fsync covered its records; while a backup is
*in sync* (it confirmed the snapshot's seq), the committer instead hands the batch of waiting
sends to :meth:`ReplicationSource.hold` with the seq its fsync reached, and they are answered
when the backup's SYNCED covers that seq — so an acknowledged durable message is stored on both
nodes, and one fsync on each side serves a whole batch. While the backup is still syncing,
sends are answered after the local fsync only (the backup is not yet a copy).

The backup is **lost** when its connection closes, when it falls more than
``MAX_TAP_BYTES`` behind (the tap's queue), or when a held batch waits longer than the
cluster's ``call-timeout-ms``: held sends are then answered (the primary goes on alone, as
Artemis's live does), and with ``vote-on-replication-failure`` the primary asks the cluster
whether it is still in the majority and stops if it is not (``broker.ha.vote``).

**The backup** (:class:`ReplicationSink`, run by ``broker.ha.replicated``) keeps its own data
directory. Every (re)connection starts a fresh copy: the previous journal is moved aside
(``journal.old-<n>``, at most ``max-saved-replicated-journals-size`` kept), the snapshot is
installed (``Journal.install_snapshot``) and every record applied with ``Journal.apply`` — the
code recovery uses — then flushed (fsync unless ``[ha] backup-fsync = false``) before its seq is
confirmed. The primary's node id is written to the backup's ``node.id``, so the backup serves
with it once it activates.
"""

from __future__ import annotations

import collections
import logging
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import trio

from broker.amqp.engine import to_proton
from broker.amqp.links import Incoming, OwnedLink
from broker.store.journal.replication import SnapshotOrderError, iter_snapshot
from broker.wire.io.trioutil import Wakeup
from broker.ha.protocol import (ACKS_ADDRESS, FAILBACK, HANDOVER, HELLO, LOGINS, RECORDS, RECORDS_ADDRESS,
                                SNAPSHOT, SNAPSHOT_END, START, SYNCED, TOPOLOGY, Hello, ProtocolError, Start,
                                Topology, batches, decode, encode, logins_batches)
from broker.cluster.bridge import CLUSTER_ROLE
from broker.wire.frames import failover_server_entries
from broker.store.journal import Journal
from broker.store.journal.replication import Snapshot

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.engine import AmqpEngine
    from broker.node import Node

log = logging.getLogger("lodestone.broker.ha")

#: the condition a primary closes a backup's link with when it drops that backup and goes on
#: alone (too slow, too far behind, or it has one): the backup knows its primary is alive
DROPPED = "amqp:resource-limit-exceeded"

__all__ = ["ReplicationSource", "ReplicationSink", "MAX_TAP_BYTES"]

MAX_TAP_BYTES = 256 * 1024 * 1024   # records tapped and not yet sent: beyond, the backup is dropped
ACK_CREDIT = 100
#: the initial sync's SNAPSHOT batches: small, so that encoding one (about 1 ms) between the
#: node's other work keeps its clients' latency low while a large journal is copied
SNAPSHOT_BATCH_BYTES = 256 * 1024


class _RecordsOut:
    """The backup's records link, on the primary (a sending link): a backlog of encoded
    transfers, sent as credit allows."""

    def __init__(self, session: "_Session") -> None:
        self.session = session
        self.link = None
        self.backlog: collections.deque = collections.deque()

    def on_attached(self, link: OwnedLink) -> None:
        self.link = link
        self.session.attached()

    def on_credit(self, link: OwnedLink) -> None:
        self.session.pump()

    def on_detached(self, link: OwnedLink, condition) -> None:
        self.link = None
        self.session.lost("the backup detached its records link")

    def send_some(self) -> bool:
        link = self.link
        moved = False
        while link is not None and self.backlog and link.credit > 0:
            link.send(self.backlog.popleft())   # pre-settled
            moved = True
        return moved


class _AcksIn:
    """The backup's acks link, on the primary (a receiving link)."""

    def __init__(self, session: "_Session") -> None:
        self.session = session
        self.link = None

    def on_attached(self, link: OwnedLink) -> None:
        self.link = link
        link.credit_window = ACK_CREDIT
        link.flow(ACK_CREDIT)

    def on_detached(self, link: OwnedLink, condition) -> None:
        self.link = None
        self.session.lost("the backup detached its acks link")

    def on_message(self, link: OwnedLink, data: bytes, delivery: Incoming) -> None:
        delivery.accept()
        try:
            kind, payload = decode(data)
        except ProtocolError as exc:
            self.session.bad_input(str(exc))
            return
        self.session.received(kind, payload)


class _Session:
    """One backup connection, on the primary."""

    def __init__(self, source: "ReplicationSource", engine: "AmqpEngine") -> None:
        self.source = source
        self.engine = engine
        self.out = _RecordsOut(self)
        self.acks = _AcksIn(self)
        self.hello: Hello | None = None
        self.started = False
        self.through_seq = 0        # the snapshot's seq: SYNCED at or past it = in sync
        self.confirmed_seq = 0
        self.tapped: collections.deque = collections.deque()   # (seq, record) after the snapshot
        self.tapped_bytes = 0
        self.sent_seq = 0
        self.closed = False
        self.connected_at = time.time()
        self.started_mono = time.monotonic()
        #: the initial sync's snapshot: encoded and cut into SNAPSHOT batches as the link takes
        #: them (``_cut_snapshot``), never the whole encoded journal at once
        self.snap_batches = None
        self.snap_records = self.snap_bytes = 0
        self.snap_encode_s = 0.0
        self.snap_done = False
        self.logins_mark = 0        # the last verified login sent (``send_logins``)
        self.logins_sent = 0

    # -- lifecycle -------------------------------------------------------------------------------
    def attached(self) -> None:
        self.maybe_start()

    def received(self, kind: int, payload: Any) -> None:
        if kind == HELLO:
            if self.hello is not None:
                self.bad_input("a second hello")
                return
            self.hello = payload
            refusal = self.source.accept(self, payload)
            if refusal is not None:
                self.close(*refusal)
                return
            self.maybe_start()
        elif kind == SYNCED:
            if self.hello is None:
                self.bad_input("synced before hello")
                return
            if payload > self.sent_seq:
                self.bad_input(f"synced seq {payload} beyond what was sent ({self.sent_seq})")
                return
            if payload > self.confirmed_seq or (payload >= self.through_seq and self.source.state == "syncing"):
                self.confirmed_seq = max(self.confirmed_seq, payload)
                self.source.confirmed(self, payload)   # (an empty journal's snapshot is seq 0)
        elif kind == FAILBACK:
            if self.hello is None:
                self.bad_input("failback before hello")
                return
            self.source.failback_requested(self)
        else:
            self.bad_input(f"kind {kind} is not for the primary")

    def maybe_start(self) -> None:
        if self.started or self.hello is None or self.out.link is None or self.closed:
            return
        self.started = True
        self.started_mono = time.monotonic()
        j = self.source.node.journal
        # the capture (and the tap) under the journal's lock; the encoding, proportional to the
        # live bytes, a few batches at a time as the link takes them: a large journal neither
        # stalls the node's clients nor is held twice in memory
        through, items = j.snapshot_items(tap=self.tap)
        self.through_seq = self.sent_seq = through
        self.snap_batches = batches(iter_snapshot(items), SNAPSHOT_BATCH_BYTES)
        self.out.backlog.append(encode(START, Start(self.source.node.node_id, through, self.source.node.cfg.name,
                                                    self.source.activation_sequence)))
        self.source.node.counters["replication_syncs"] += 1
        self.pump()

    def _cut_snapshot(self) -> None:
        """Encode and queue SNAPSHOT batches while the link's backlog is short (two batches of
        ``SNAPSHOT_BATCH_BYTES`` per pump); then SNAPSHOT_END and the topology."""
        out = self.out.backlog
        t0 = time.perf_counter()
        try:
            while len(out) < 2:
                batch = next(self.snap_batches, None)
                if batch is None:
                    out.append(encode(SNAPSHOT_END, self.through_seq))
                    out.append(encode(TOPOLOGY, self.source.topology()))
                    self.snap_batches = None
                    self.snap_done = True
                    self.send_logins(pump=False)
                    break
                self.snap_records += len(batch)
                self.snap_bytes += sum(len(r) for r in batch)
                out.append(encode(SNAPSHOT, batch))
        except SnapshotOrderError as exc:   # an invariant broke: this copy is void, the backup starts over
            log.error("replication: cannot snapshot the journal for backup %s: %s", self.hello.name, exc)
            self.close("amqp:internal-error", f"snapshot failed: {exc}")
            return
        finally:
            self.snap_encode_s += time.perf_counter() - t0
        if self.snap_done:
            self.source.last_snapshot = {"through_seq": self.through_seq, "records": self.snap_records,
                                         "bytes": self.snap_bytes, "encode_ms": round(self.snap_encode_s * 1000, 1)}
            log.info("replication: initial sync to backup %s: %d records (%d bytes) through seq %d",
                     self.hello.name, self.snap_records, self.snap_bytes, self.through_seq)

    def tap(self, seq: int, rec: bytes) -> None:
        """The journal's tap (called under its lock by whoever appends: the trio thread). Only
        queues: the source's pump task sends (``ReplicationSource.run``)."""
        self.tapped.append((seq, rec))
        self.tapped_bytes += len(rec)
        self.source.kick()

    def pump(self) -> None:
        if self.closed or not self.started:
            return
        if self.tapped_bytes > MAX_TAP_BYTES:
            self.close(DROPPED, f"the backup fell {self.tapped_bytes} bytes behind")
            return
        out = self.out
        if not self.snap_done:
            if self.snap_batches is not None:
                self._cut_snapshot()
                if self.closed:
                    return
            if not self.snap_done:      # still cutting: the tapped records wait
                if out.send_some():
                    self.engine.wake()
                if self.snap_batches is not None and out.link is not None and out.link.credit > 0:
                    self.source.kick()
                return
        if self.tapped and len(out.backlog) < 4:
            # held records (Journal.hold: a change whose mirror batch is not written yet) wait,
            # so the backup never has the change without its mirror event; the batch's own
            # append kicks this pump again once the hold is over
            hold = self.source.node.journal.held_from
            tapped = self.tapped
            batch, size = [], 0
            while tapped and size < 1024 * 1024 and (hold is None or tapped[0][0] < hold):
                seq, rec = tapped.popleft()
                batch.append(rec)
                size += len(rec)
                self.sent_seq = seq
            self.tapped_bytes -= size
            if batch:
                out.backlog.append(encode(RECORDS, batch))
            if tapped and hold is not None and tapped[0][0] >= hold:
                if out.send_some():
                    self.engine.wake()
                return           # the rest waits for the hold's end (its append kicks us)
        if out.send_some():
            self.engine.wake()
        if self.tapped and out.link is not None and out.link.credit > 0:
            self.source.kick()   # more to cut: come back (bounded work per pump)

    def send_logins(self, *, pump: bool = True) -> None:
        """The password logins verified here since the last call, to a backup that adopts them
        (its hello said so): the clients that fail over to it are known there at once."""
        security = self.source.node.security
        if (security is None or self.hello is None or not self.hello.logins or not self.snap_done
                or self.closed):
            return
        self.logins_mark, entries = security.verified_logins(self.logins_mark)
        for batch in logins_batches(entries):
            self.out.backlog.append(encode(LOGINS, batch))
            self.logins_sent += len(batch)
        if entries and pump:
            self.pump()

    def send_topology(self) -> None:
        if self.started and not self.closed and self.snap_done:     # (the snapshot's end sends one)
            self.out.backlog.append(encode(TOPOLOGY, self.source.topology()))
            self.pump()

    def bad_input(self, why: str) -> None:
        self.source.node.counters["replication_bad_input"] += 1
        log.warning("replication: bad input from the backup: %s; closing its connection", why)
        self.close("amqp:decode-error", why)

    def close(self, condition: str, description: str) -> None:
        if not self.closed:
            self.engine.close_with(condition, description)
            self.engine.wake()
        self.lost(description)

    def lost(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        j = self.source.node.journal
        if j is not None and j.tap == self.tap:
            j.tap = None
        self.tapped.clear()
        self.source.session_lost(self, why)


class ReplicationSource:
    """The primary's side (see the module doc): ``node.replication``."""

    def __init__(self, node: "Node", *, vote: Callable[[], Any] | None = None) -> None:
        self.node = node
        self.cfg = node.cfg.ha
        self.session: _Session | None = None
        #: each backup connection's session, by its engine (both of its links join it); a
        #: session leaves when it is lost (``session_lost``)
        self._sessions: dict["AmqpEngine", _Session] = {}
        self.held: collections.deque = collections.deque()   # (seq, waiters, since)
        self.state = "no-backup"      # no-backup | syncing | in-sync
        self.backup_name: str | None = None
        self.backup_connector: str | None = None
        self.backup_management_url: str | None = None
        self.lost_count = 0
        self.synced_at: float | None = None
        self._kicked = Wakeup()
        #: vote-on-replication-failure: ``await quorum_check()`` after losing an in-sync backup
        #: says whether this primary is still in the majority; if not, ``on_isolated()``
        self.quorum_check = None
        self.on_isolated: Callable[[], None] | None = None
        self._check_due = False
        #: the quorum check is under way: durable sends stay held (neither replicated nor known to
        #: be on the majority side, they are not acknowledged; docs/ha.md)
        self.checking = False
        self.max_cluster_size = 1
        #: the node id's original primary, as our backup, asks for it back: ``on_failback()``
        #: (set only where handing over is allowed: an activated backup with allow-failback)
        self.on_failback: Callable[[], None] | None = None
        self.failback_session: _Session | None = None
        self._confirmed_ev = Wakeup()
        self.last_snapshot: dict | None = None   # the latest initial sync's snapshot (GET /api/v1/ha)
        #: [ha.manager]: this primary's activation sequence, told to each backup (START)
        self.activation_sequence: int | None = None

    # -- links (the node's internal service for $lodestone.replication.*) ---------------------------
    def attach(self, engine: "AmqpEngine", link: OwnedLink):
        """A backup's replication link (a ``broker.amqp.links.LinkService``)."""
        address = link.address

        principal = engine.principal
        if principal is None or CLUSTER_ROLE not in getattr(principal, "roles", ()):
            return ("amqp:unauthorized-access", f"address {address!r} is for a backup logged in as the cluster user")
        if self.node.journal is None:
            return ("amqp:not-implemented", "this node keeps no journal ([node] persistent = false): nothing to replicate")
        s = self._sessions.get(engine)
        if s is None:
            s = self._sessions[engine] = _Session(self, engine)
        if address == RECORDS_ADDRESS and link.is_sender:
            return s.out
        if address == ACKS_ADDRESS and link.is_receiver:
            return s.acks
        return ("amqp:not-found", f"no replication link {address!r} in that direction")

    def accept(self, session: _Session, hello: Hello) -> tuple[str, str] | None:
        """A backup said hello: refuse it (condition, description) or make it ours."""
        want = self.cfg.group_name
        if want is not None and hello.group != want:
            return ("amqp:precondition-failed", f"this primary's group-name is {want!r}, not {hello.group!r}")
        cur = self.session
        if cur is not None and not cur.closed:
            return (DROPPED, f"this primary already has a backup ({cur.hello.name})")
        if self.checking:   # its activation sequence is about to move: a copy started now would be stale
            return (DROPPED, "this primary is settling the loss of its previous backup; try again")
        self.session = session
        self.state = "syncing"
        self.backup_name = hello.name
        self.backup_connector = hello.connector
        self.backup_management_url = hello.management_url
        log.warning("ha: a backup connected: %s (%s); initial sync", hello.name, hello.connector or "no connector")
        self._backups_changed()
        return None

    def _backups_changed(self) -> None:
        """The cluster's members are told this node's backups (ClusterNode.backups_changed)."""
        cluster = self.node.cluster
        if cluster is not None:
            cluster.backups_changed()

    # -- the pipeline ------------------------------------------------------------------------------
    @property
    def gating(self) -> bool:
        """Are durable sends answered only once the backup holds them?"""
        return self.state == "in-sync" or self.checking

    def kick(self) -> None:
        """Records were tapped (or credit came back): the pump task sends them."""
        self._kicked.set()

    def wake(self) -> None:
        s = self.session
        if s is not None and not s.closed:
            s.pump()

    async def run(self, call_timeout_s: float) -> None:
        """The pump: send what the tap queued (and the initial sync's snapshot); drop a backup
        that stopped confirming; run the quorum check after losing an in-sync backup
        (vote-on-replication-failure)."""
        while True:
            with trio.move_on_after(1.0):
                await self._kicked.wait()
            # a kick that came during the last round makes wait() return at once, without
            # yielding: let the node's other tasks run between rounds (each cuts ≤ 512 KiB)
            await trio.lowlevel.checkpoint()
            await self._round(call_timeout_s)

    async def _round(self, call_timeout_s: float) -> None:
        s = self.session
        if s is not None and not s.closed:
            s.send_logins(pump=False)
        self.wake()
        self.check_timeouts(call_timeout_s)
        if not self._check_due:
            return
        self._check_due = False
        if self.quorum_check is None or await self.quorum_check():
            self.checking = False
            self.release_unreplicated()
            return
        log.error("ha: this primary lost its backup and the cluster's majority: it stops serving "
                  "(vote-on-replication-failure); %d held sends are not acknowledged", self.held_count())
        self.node.counters["ha_isolated"] += 1
        if self.on_isolated is not None:
            self.on_isolated()          # the held sends stay unanswered: the process stops

    def hold(self, seq: int, waiters: dict) -> None:
        """The committer's batch, durable here through ``seq``: answer it once the backup has it."""
        s = self.session
        if s is not None and s.confirmed_seq >= seq:
            _release(waiters)
            return
        self.held.append((seq, waiters, time.monotonic()))

    def held_count(self) -> int:
        return sum(len(ds) for _s, waiters, _t in self.held for ds in waiters.values())

    def release_unreplicated(self) -> None:
        """The quorum check was won: this primary is on the majority side (no backup can win a
        vote for its node id), so the held sends are answered and it goes on alone."""
        while self.held:
            _release(self.held.popleft()[1])

    def confirmed(self, session: _Session, seq: int) -> None:
        if self.state == "syncing" and seq >= session.through_seq:
            self.state = "in-sync"
            self.synced_at = time.time()
            log.warning("ha: backup %s is in sync (seq %d); durable sends now wait for it", session.hello.name, seq)
            self._backups_changed()
        held = self.held
        while held and held[0][0] <= seq:
            _release(held.popleft()[1])
        self._confirmed_ev.set()

    def failback_requested(self, session: _Session) -> None:
        if self.on_failback is None or self.state != "in-sync":
            log.warning("ha: backup %s asked for failback: %s", session.hello.name,
                        "not in sync yet" if self.on_failback is not None else
                        "this node does not hand over (allow-failback = false, or it is the primary)")
            return
        if self.failback_session is None:
            self.failback_session = session
            log.warning("ha: the node id's primary (%s) asks for it back: handing over", session.hello.name)
            self.on_failback()

    async def hand_over(self, timeout_s: float) -> bool:
        """Failback, once clients are gone: flush, send every record and HANDOVER with the last
        seq, wait (``timeout_s``) until the failing-back primary holds it all, then close."""
        s = self.failback_session
        j = self.node.journal
        if s is None or s.closed or j is None:
            return False
        await trio.to_thread.run_sync(j.flush)
        last = j.last_seq
        with trio.move_on_after(timeout_s):
            while True:
                self.wake()
                if not s.tapped and s.sent_seq >= last:
                    break
                await trio.sleep(0.01)
            s.out.backlog.append(encode(HANDOVER, last))
            s.pump()
            while s.confirmed_seq < last and not s.closed:
                await self._confirmed_ev.wait()
        ok = s.confirmed_seq >= last
        log.warning("ha: handed over through seq %d to %s: %s", last, s.hello.name,
                    "confirmed" if ok else f"NOT confirmed within {timeout_s:g} s")
        s.close("amqp:connection:forced", "handed over to the primary")
        return ok

    def session_lost(self, session: _Session, why: str) -> None:
        if self._sessions.get(session.engine) is session:
            del self._sessions[session.engine]
        if session is not self.session:
            return
        was = self.state
        self.session = None
        self.state = "no-backup"
        self.lost_count += 1
        self._backups_changed()
        self.node.counters["replication_lost"] += 1
        name = session.hello.name if session.hello else "?"
        if (was == "in-sync" or self.checking) and self.quorum_check is not None:
            # vote-on-replication-failure: the sends the backup did not confirm wait for the quorum
            # check; answered if this primary is still in the majority, never if it is isolated
            self.checking = True
            self._check_due = True
            log.warning("ha: replication to backup %s lost (%s); %d held sends wait for the quorum check",
                        name, why, self.held_count())
            self.kick()
            return
        while self.held:
            _release(self.held.popleft()[1])
        log.warning("ha: replication to backup %s lost (%s); serving alone", name, why)

    def check_timeouts(self, timeout_s: float) -> None:
        """A held batch older than ``timeout_s``: the backup is not answering, drop it. An
        initial sync not done within ``initial-replication-sync-timeout-ms``: drop it too (it
        starts over)."""
        s = self.session
        if s is None:
            return
        if self.held and time.monotonic() - self.held[0][2] > timeout_s:
            s.close(DROPPED, f"the backup did not confirm within {timeout_s:g} s")
            return
        limit = self.cfg.initial_replication_sync_timeout_ms / 1000.0
        if self.state == "syncing" and s.started and time.monotonic() - s.started_mono > limit:
            s.close(DROPPED, f"the initial sync did not complete within {limit:g} s")

    def backups(self) -> tuple[tuple[str, str, bool], ...]:
        """The backup connected to this primary as ``(connector, management URL, in sync)``
        (in sync once it holds the initial copy; ``Node.backups``), if it said where it would serve."""
        if self.session is None or not self.backup_connector:
            return ()
        return ((self.backup_connector, self.backup_management_url or "", self.state == "in-sync"),)

    def topology(self) -> Topology:
        cluster = self.node.cluster
        members = []
        if cluster is not None:
            for node_id, _connector, mgmt in cluster.live_members():
                if mgmt:
                    members.append((node_id, mgmt))
        mgmt_self = cluster.management_url if cluster is not None else ""
        return Topology(tuple(members + [(self.node.node_id, mgmt_self)]), len(members) + 1)

    def describe(self) -> dict:
        s = self.session
        j = self.node.journal
        return {"state": self.state, "backup": None if s is None else {
                    "name": self.backup_name, "connector": self.backup_connector,
                    "management_url": self.backup_management_url, "confirmed_seq": s.confirmed_seq,
                    "sent_seq": s.sent_seq, "since": s.connected_at},
                "lag_records": (j.last_seq - s.confirmed_seq) if (s is not None and j is not None) else None,
                "held_batches": len(self.held), "quorum_check_pending": self.checking, "lost": self.lost_count,
                "synced_at": self.synced_at, "last_snapshot": self.last_snapshot}


def failover_server_list(connectors) -> list:
    """Artemis's ``failover-server-list`` entries for backup connectors, as proton values
    (``frames.failover_server_entries``: ``amqp[s]://host:port`` only)."""
    return to_proton(failover_server_entries(connectors))


def _release(waiters: dict) -> None:
    for engine, ds in waiters.items():
        engine.synced(ds)


# -- the backup's side ------------------------------------------------------------------------------

def move_aside(journal_dir: Path, keep: int) -> Path | None:
    """Move a previous replica aside as ``journal.old-<n>`` (``n`` grows), keeping at most
    ``keep`` of them (the oldest deleted first); returns where it went (None: nothing there)."""
    parent = journal_dir.parent
    if not journal_dir.exists() or not any(journal_dir.iterdir()):
        return None
    olds = sorted((p for p in parent.glob("journal.old-*") if p.name[12:].isdigit()),
                  key=lambda p: int(p.name[12:]))
    n = int(olds[-1].name[12:]) + 1 if olds else 1
    dest = parent / f"journal.old-{n}"
    journal_dir.rename(dest)
    olds.append(dest)
    while len(olds) > keep:
        victim = olds.pop(0)
        shutil.rmtree(victim, ignore_errors=True)
    if keep == 0 and dest.exists():
        shutil.rmtree(dest, ignore_errors=True)
        return None
    return dest


class ReplicationSink:
    """The backup's side of one connection to a primary (driven by ``broker.ha.replicated``):
    ``on_message(body)`` for each records-link transfer; ``send`` (set by the owner) sends an
    acks-link body. Raises nothing: bad input sets ``error`` and the owner closes."""

    def __init__(self, datadir, journal_config, *, keep_saved: int, fsync: bool,
                 on_node_id: Callable[[str], None], on_logins: Callable[[list], None] | None = None,
                 on_sequence: Callable[[int | None], None] | None = None) -> None:
        self.datadir = datadir
        self.journal_config = journal_config
        self.keep_saved = keep_saved
        self.fsync = fsync
        self.on_node_id = on_node_id
        self.journal = None
        self.start: Start | None = None
        self.snapshot: list[bytes] = []
        self.in_sync = False
        self.synced_seq = 0
        self.applied_seq = 0
        self.topology: Topology | None = None
        self.max_cluster_size = 1
        self.error: str | None = None
        self.pending_flush = False
        self.records_received = 0
        self.handover_seq: int | None = None   # the primary handed its node id over through this seq
        self.on_logins = on_logins             # LOGINS: cache the primary's verified logins here
        #: the copy's activation sequence ([ha.manager]): None at START (a copy in progress is
        #: never current), the primary's once in sync — before the snapshot is confirmed
        self.on_sequence = on_sequence
        self.logins_received = 0

    def open_fresh(self) -> None:
        import dataclasses

        if self.journal is not None:
            self.journal.close()
            self.journal = None
        moved = move_aside(self.datadir.journal_dir, self.keep_saved)
        if moved is not None:
            log.info("replication: previous replica kept as %s", moved)
        config = self.journal_config
        if not self.fsync:   # backup-fsync = false: confirm once written to the OS, fsync later
            config = dataclasses.replace(config, sync="never")
        self.journal = Journal.open(self.datadir.journal_dir, config)

    def on_message(self, body: bytes) -> str:
        if self.error is not None:
            return "accepted"
        try:
            kind, payload = decode(body)
            self._handle(kind, payload)
        except ProtocolError as exc:
            self.error = str(exc)
        except Exception as exc:   # BadRecord, JournalGap: the copy cannot be trusted
            self.error = f"{type(exc).__name__}: {exc}"
        return "accepted"

    def _handle(self, kind: int, payload: Any) -> None:
        if kind == START:
            if self.start is not None:
                raise ProtocolError("a second start")
            self.start = payload
            if self.on_sequence is not None:
                self.on_sequence(None)
            self.open_fresh()
            self.on_node_id(payload.node_id)
        elif kind == SNAPSHOT:
            if self.start is None or self.in_sync:
                raise ProtocolError("snapshot outside the initial sync")
            self.snapshot.extend(payload)
        elif kind == SNAPSHOT_END:
            if self.start is None or self.in_sync or payload != self.start.through_seq:
                raise ProtocolError("snapshot end does not match the start")
            self.journal.install_snapshot(Snapshot(payload, self.snapshot))
            self.snapshot = []
            if self.on_sequence is not None:
                self.on_sequence(self.start.activation_sequence)
            self.in_sync = True
            self.applied_seq = self.synced_seq = payload
            self.pending_flush = True     # confirm the snapshot at once (it is durable on install)
        elif kind == RECORDS:
            if not self.in_sync:
                raise ProtocolError("records before the snapshot ended")
            for rec in payload:
                self.applied_seq = self.journal.apply(rec)
            self.records_received += len(payload)
            self.pending_flush = True
        elif kind == HANDOVER:
            if not self.in_sync:
                raise ProtocolError("handover before the snapshot ended")
            self.handover_seq = payload
            self.pending_flush = True
        elif kind == TOPOLOGY:
            self.topology = payload
            self.max_cluster_size = max(self.max_cluster_size, payload.cluster_size)
        elif kind == LOGINS:
            self.logins_received += len(payload)
            if self.on_logins is not None:
                self.on_logins(payload)
        else:
            raise ProtocolError(f"kind {kind} is not for the backup")

    def flush(self) -> int:
        """Make what was applied durable (in a worker thread); returns the seq to confirm."""
        j = self.journal
        if j is None:
            return self.synced_seq
        self.synced_seq = max(self.synced_seq, j.flush())
        return self.synced_seq

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None
