"""OpenAMQ's shared queues: one queue for the whole cluster, active on the root (the shell).

Theory of operation
-------------------
An address declared with ``shared = true`` (``[addresses.<name>]`` or ``POST
/api/v1/addresses``) is part of the replicated cluster state, so every broker has it and its
anycast queue. Only the root (``broker.cluster.root``) holds its messages; the other brokers
relay to it (OpenAMQ's "Cluster Message Workflow"; docs/cluster.md "Shared queues"):

* **A send on a broker that is not the root** (:meth:`SharedQueues.relay`, called from
  ``AmqpEngine._publish``) is not stored there. It goes to the root as a forwarded message
  (:class:`~broker.wire.cluster.Forwarded`, one target: the root's queue) on the bridge's
  ``$lodestone.cluster.shared`` link, and the producer's transfer is answered only with the
  root's answer: accepted once the root's journal holds it (a durable message), or rejected.
  While there is no root the send is *held*; after ``call-timeout-ms`` without a root it is
  rejected with ``amqp:precondition-failed`` ("… has no root …"): nothing was stored, the
  producer may send it again. When the root changes, what was on its way to the old root goes
  to the new one.
* **On the root** (:meth:`SharedQueues.receive`), a relayed message is published as a producer's
  would be (routed to the queue here or to a broker whose consumers ask for it: the cluster's
  message load balancing), with its forward id remembered per origin, so one resent over a
  reconnected bridge is stored once. A broker that is not (or no longer) the root releases it;
  the sender holds it and tries the root again.
* **One order.** On the root, while the shared queue has messages waiting, new ones join it
  (``local_only``) rather than overtaking them to another broker; :meth:`SharedQueues.move_due`
  then hands the waiting ones, in order, to the brokers whose consumers ask (round robin among
  them) whenever the root has no consumer of its own.
* **Consumers anywhere.** A consumer on another broker is a consumer of that broker's copy of
  the queue; the cluster's binding notifications tell the root, which forwards it messages (store
  and forward: exactly once). A broker that is not the root and holds shared messages with no
  consumer of its own (its consumer left, or it was the root before a restart) moves them to
  the root (:meth:`SharedQueues.move_due`, store and forward): so an old root that comes back
  hands its acknowledged messages to the new root, each once, after the new root's own.
* **Each once across a root change.** A stored relayed message keeps its relay id (the sending
  broker and its id) as its origin (:class:`~broker.core.deliveries.Relayed`, journaled with it)
  and a move carries that id, not a new one. A send in flight to a root that died is sent to the
  new root; if the old root had stored it too, its copy arrives with the same id, and the new
  root's per-broker duplicate cache drops it (``ClusterNode.receive_forward``).
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import TYPE_CHECKING

import trio

from broker.amqp.message import body_duplicate_key
from broker.core.deliveries import Message, Relayed
from broker.core.duplicates import MISSING
from broker.wire.cluster import Forwarded, ProtocolError, decode_forwards, encode_forward

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.links import Incoming
    from broker.cluster.bridge import ClusterNode

log = logging.getLogger("lodestone.broker.cluster")

__all__ = ["SharedQueues", "NO_ROOT"]

NO_ROOT = "amqp:precondition-failed"
TICK_S = 0.1
MOVE_BATCH = 500
MAX_PENDING = 100_000   # relayed sends not answered yet (held without a root included); beyond: refused


class _Relayed:
    __slots__ = ("token", "owner", "address", "message", "durable", "priority", "expires", "dup_id", "since", "via",
                 "sent_to")

    def __init__(self, token, owner, address, message, durable, priority, expires, dup_id):
        self.token = token
        self.owner = owner          # (engine, delivery) to answer, or None (sent pre-settled)
        self.address = address
        self.message = message
        self.durable = durable
        self.priority = priority
        self.expires = expires
        self.dup_id = dup_id
        self.since = time.monotonic()
        self.via: str | None = None  # the root it was sent to (None: held, no root)
        self.sent_to: str | None = None   # the last root it was sent to, even after that root went away


class SharedQueues:
    """This broker's part in the cluster's shared queues (see the module doc)."""

    def __init__(self, cluster: "ClusterNode"):
        self.cluster = cluster
        self.node = cluster.node
        self.core = cluster.core
        self.me = cluster.node.node_id
        self.addresses: set[str] = set()
        self.timeout_s = cluster.cfg.call_timeout_ms / 1000.0
        self.pending: dict[int, _Relayed] = {}
        self._seq = itertools.count(1)
        self._rr = itertools.count()
        self.counters: collections.Counter = collections.Counter()
        self._logged_no_root = False

    # -- which addresses ---------------------------------------------------------------------------
    def set_shared(self, name: str, shared: bool) -> None:
        if shared:
            self.addresses.add(name)
        else:
            self.addresses.discard(name)

    @property
    def is_root(self) -> bool:
        el = self.cluster.election
        return el is not None and el.is_root

    def backlog(self, address: str) -> bool:
        """On the root: the shared queue has messages waiting, so a new one joins it (one order)."""
        q = self.core.queues.get(address)
        return q is not None and bool(q.messages)

    # -- relaying a send to the root ------------------------------------------------------------
    def relay(self, owner, address: str, message: bytes, durable: bool, priority: int, expires: float) -> None:
        """``AmqpEngine._publish`` for a shared address here (not the root): ``owner`` (engine,
        delivery) is answered with the root's answer (``engine.synced`` / ``engine.refused``)."""
        if len(self.pending) >= MAX_PENDING:
            self.counters["refused_pending_limit"] += 1
            if owner is not None:
                engine, d = owner
                engine.refused(d, "amqp:resource-limit-exceeded",
                               f"{MAX_PENDING} sends to shared queues are waiting for the cluster's root here; "
                               "not stored, send it again later")
            return
        token = next(self._seq)
        r = _Relayed(token, owner, address, message, durable, priority, expires, self.cluster._dup_id())
        self.pending[token] = r
        self.counters["relayed"] += 1
        self._dispatch(r)

    def _dispatch(self, r: _Relayed) -> None:
        c = self.cluster
        root = c.root
        if root == self.me:   # this broker became the root while it held the message
            self.pending.pop(r.token, None)
            self._publish_here(r)
            return
        b = c.by_node.get(root) if root is not None else None
        if b is None or not b.connected or b.shared_sender is None:
            r.via = None
            return   # held: the tick sends it once there is a root, or refuses it after the time-out
        env = Forwarded(r.dup_id, self.me, r.address, ((root, r.address),), 0, r.durable, r.priority, r.expires,
                        r.message)
        r.via = root
        r.sent_to = root
        b.shared_sender.send(encode_forward(env), r.token)

    def _withdraw(self, r: _Relayed) -> None:
        if r.via is not None:
            b = self.cluster.by_node.get(r.via)
            if b is not None and b.shared_sender is not None:
                b.shared_sender.withdraw(r.token)
        r.via = None

    def outcome(self, token, state: str) -> None:
        """The root's answer to one relayed message (the bridge's shared sender)."""
        r = self.pending.get(token)
        if r is None:
            return
        if state == "accepted":
            del self.pending[token]
            self.counters["relay_accepted"] += 1
            self._answer(r, None)
        elif state == "rejected":
            del self.pending[token]
            self.counters["relay_rejected"] += 1
            self._answer(r, (NO_ROOT, f"the cluster's root {r.via} rejected the message for shared queue "
                                      f"{r.address!r}"))
        else:   # released: that broker is not the root (any more); try the root again
            self.counters["relay_released"] += 1
            self._withdraw(r)

    def _answer(self, r: _Relayed, refusal: tuple[str, str] | None) -> None:
        if r.owner is None:
            return
        engine, d = r.owner
        if refusal is None:
            engine.synced([d])
        else:
            engine.refused(d, *refusal)

    def _publish_here(self, r: _Relayed) -> None:
        """This broker is the root now: publish a held message as its producer would have, its
        relay id remembered (the old root may hand over a copy it stored: dropped then)."""
        core = self.core
        journal = self.node.journal is not None
        mark = core.sync_events
        if journal:
            core.store.begin_group()
        try:
            sync = self._store(self.me, r.dup_id, r.address, r.message, r.durable, r.priority, r.expires, journal)
        finally:
            if journal and core.store.end_group():
                sync = True
        self.counters["relay_published_here"] += 1
        if r.owner is not None:
            engine, d = r.owner
            if sync or core.sync_events != mark:   # journaled, or a sync mirror's target must have it
                self.node.await_sync(engine, d)
            else:
                engine.synced([d])

    def root_changed(self, old: str | None, new: str | None) -> None:
        """Everything on its way to the old root goes to the new one (or is held). A message the
        old root had already stored but not yet answered is then stored twice: the old root
        hands its copy to the new root when it comes back (counted: ``resent_after_root_change``)."""
        for r in list(self.pending.values()):
            if r.via != new:
                if r.via is not None:
                    self.counters["resent_after_root_change"] += 1
                self._withdraw(r)
                self._dispatch(r)

    def tick(self, now: float) -> None:
        """Send what was held once there is a root; refuse what waited longer than the time-out."""
        root = self.cluster.root
        for r in list(self.pending.values()):
            if r.via is not None:
                continue
            if root is not None:
                self._dispatch(r)
                if r.via is not None or r.token not in self.pending:
                    continue
            if now - r.since >= self.timeout_s:
                del self.pending[r.token]
                self.counters["refused_no_root"] += 1
                if not self._logged_no_root:
                    self._logged_no_root = True
                    log.warning("shared queue sends refused: the cluster has no root (no quorum of primaries)",
                                extra={"fields": {"address": r.address, "waited_s": round(now - r.since, 3)}})
                if r.sent_to is None:
                    why = "not stored, send it again"
                else:   # it reached a root that went away before it answered: that root may hold it
                    self.counters["refused_outcome_unknown"] += 1
                    why = (f"it was sent to the root {r.sent_to}, which went away before answering and may have "
                           "stored it (it hands it to the next root when it comes back)")
                self._answer(r, (NO_ROOT, f"shared queue {r.address!r} has no root: the cluster has no root (no "
                                          f"quorum of primaries) after {self.timeout_s:g} s; {why}"))
        if root is not None:
            self._logged_no_root = False

    # -- on the root --------------------------------------------------------------------------------
    def receive(self, engine, delivery: "Incoming", data: bytes) -> None:
        """A relayed message from another broker (``$lodestone.cluster.shared``)."""
        try:
            fs = decode_forwards(data)
        except ProtocolError as exc:
            self.counters["bad_relays"] += 1
            delivery.reject(exc.condition, exc.description)
            engine.close_with(exc.condition, exc.description)
            return
        if not self.is_root or any(f.targets[0][0] != self.me for f in fs):
            self.counters["relay_not_root"] += 1
            delivery.release()   # the sender tries the root it knows again
            return
        core = self.core
        if any(f.address not in self.addresses for f in fs):
            # not (yet) shared here: the replicated state may not have reached this root yet
            self.counters["relay_not_shared_here"] += 1
            delivery.release()
            return
        missing = next((f.address for f in fs if f.address not in core.addresses), None)
        if missing is not None:
            self.counters["relay_unknown_address"] += 1
            delivery.reject("amqp:not-found", f"the cluster's root has no address {missing!r}")
            return
        dups = core.duplicates
        journal = self.node.journal is not None
        store = core.store
        sync = False
        if journal:
            store.begin_group()
        try:
            for f in fs:
                if dups.seen_from(f.origin, f.dup_id):
                    self.counters["relay_duplicates_dropped"] += 1
                    sync = sync or (f.durable and journal)
                    continue
                if self._store(f.origin, f.dup_id, f.address, f.message, f.durable, f.priority, f.expires, journal):
                    sync = True
                self.counters["relays_in"] += 1
        finally:
            if journal and store.end_group():
                sync = True
        if sync:
            delivery.accept_when_synced()
        else:
            delivery.accept()

    def _store(self, origin: str, dup_id: bytes, address: str, message: bytes, durable: bool, priority: int,
               expires: float, journal: bool) -> bool:
        """Store one relayed send on the root, inside the caller's store group: the producer's
        ``_AMQ_DUPL_ID`` checked here, where the message is stored (as ``Broker.publish_once``),
        and the relay id remembered with it. True when the answer must wait for the fsync."""
        core = self.core
        dups = core.duplicates
        key = body_duplicate_key(message)
        if key is not None:
            token = dups.lookup(address, key)
            if token is not MISSING:
                dups.duplicate(address)
                dups.remember_from(origin, dup_id, persist=durable and journal)
                return token is not None or (durable and journal)
        held: list[str] = []
        stored = core.publish(address, message, durable, priority, expires, Relayed(origin, dup_id), held,
                              local_only=self.backlog(address))
        if key is not None:
            dups.remember(address, key, persist=stored, held=held)
        dups.remember_from(origin, dup_id, persist=durable and journal)
        return stored

    # -- moving waiting messages ---------------------------------------------------------------
    def move_due(self) -> int:
        """Waiting shared messages that should be elsewhere, moved in order by store and forward:
        on a broker that is not the root, to the root when no consumer here takes them; on the
        root without a consumer of its own, to the brokers whose consumers ask for them."""
        c = self.cluster
        root = c.root
        moved = 0
        for name in list(self.addresses):
            q = self.core.queues.get(name)
            if q is None or not q.messages or q.subs:
                continue
            if root is None:
                continue
            if root != self.me:
                b = c.by_node.get(root)
                if b is None or not b.connected:
                    continue
                moved += self._move(q, lambda: (root, root))
            else:
                wanting = [(rb.node_id, rb.next_hop or rb.node_id) for rb in self.core.cluster
                           if rb.address == name and rb.queue == name and rb.consumers > 0 and rb.connected]
                if not wanting:
                    continue
                moved += self._move(q, lambda: wanting[next(self._rr) % len(wanting)])
        return moved

    def _move(self, q, pick) -> int:
        c = self.cluster
        root_here = self.is_root
        core = self.core
        store = core.store
        grouped = self.node.journal is not None
        n = 0
        if grouped:
            store.begin_group()
        try:
            for msg in list(q.messages)[:MOVE_BATCH]:
                node_id, via = pick()
                q.take(msg)
                # a relayed message moving to the root keeps its relay id: that root drops it if it
                # stored the send already (sent again to it when the old root died). Moving away
                # from the root it gets a new id: it may come back, and must not be taken for itself
                rel = msg.origin if type(msg.origin) is Relayed and not root_here else None
                env = Forwarded(rel.id if rel else c._dup_id(), rel.node if rel else self.me, msg.address,
                                ((node_id, q.name),), 0, msg.durable, msg.priority, msg.expires, msg.body, moved=True)
                c._sf_queue(via).enqueue(Message(core.next_mid(), encode_forward(env), msg.durable, msg.address,
                                                 origin=("redistribute", len(msg.body))))
                n += 1
        finally:
            if grouped:
                store.end_group()
        if n:
            self.counters["moved"] += n
            c.redistributed += n
            log.info("shared queue messages moved", extra={"fields": {"queue": q.name, "messages": n}})
        return n

    async def run(self) -> None:
        while True:
            now = time.monotonic()
            self.tick(now)
            if self.move_due():
                await trio.sleep(0)
                continue
            await trio.sleep(TICK_S)

    def describe(self) -> dict:
        return {"addresses": sorted(self.addresses), "relaying": len(self.pending),
                "held_without_root": sum(1 for r in self.pending.values() if r.via is None),
                "counters": dict(self.counters)}
