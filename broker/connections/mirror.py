"""The mirror at run time: a source copies every change of its queues to another broker, which
applies them (``[broker-connections.<name>.mirror]``; docs/broker-connections.md "Mirror").

Theory of operation
-------------------
**The source** (:class:`MirrorSource`, one per connection with a mirror) is installed on the
node whenever it serves (an activation), whether the connection is started or not, so nothing a
client does while the target is away or the connection is stopped goes unmirrored. It hooks
the queues it mirrors — not temporary ones, not the broker's own (``$``…), only addresses the
``address-filter`` lets through — through ``Queue.mirror``: a message stored in one of them
(``added``) and one leaving it (``removed``: acknowledged, dead-lettered, expired, moved away)
each become an **event**. The events of one scheduling round (until :meth:`MirrorSource.run`
runs, the node's committer asks, or 256 are waiting) become one message — a batch — of the
mirror's store-and-forward queue ``$lodestone.mirror.<name>`` (journaled when ``durable``). A
durable event holds the journal (``Journal.hold``) from its cause's record on until the batch is
written, so the change and its event reach the disk in one write; the committer writes the batch
before it answers clients, so nobody waits for it. Queue creation and removal become events too (``queue-creation``,
``queue-removal``), and when the mirror is installed, every queue it mirrors is announced
(``createQueue``), as Artemis catches the topology up at start. Messages that were there before
the mirror started are not copied (as Artemis).

The wire format is :mod:`broker.connections.mirror_wire`. A send is mirrored per queue: the event
names the queue it was stored in (``x-opt-amq-mr-trg-q``) and the id of that queue's copy
(``x-opt-amq-mr-id``), which is the id its ``postAck`` names.

**The link** (:class:`MirrorSender`, a ``broker.connections.feed.QueueFeed``, while the
connection's session runs) consumes the store-and-forward queue in order and sends its events on
one link to ``$ACTIVEMQ_ARTEMIS_MIRROR_<name>``, each batch only once its record (and so the
record of every change it describes) is durable here and, when a backup gates sends, held by the
backup (``Node.await_written``): the target never applies a change that a crash could take from
this node, which would leave the two sites different for good. What was handed out since the connection last
wrote as one batch transfer when the target offers ``x-opt-lodestone-mirror-batch``, else one
event per transfer (Artemis's format). An event leaves the queue when the target accepted it,
which it does only once the event is applied and durable. A lost connection sends the unsettled events
again, in order; the target's duplicate cache drops the sends it already applied.

**The target** (:class:`MirrorTarget`, a component of every node) owns the links whose target
address starts with ``$ACTIVEMQ_ARTEMIS_MIRROR``: the user must have the ``mirror`` permission on
that address (``amqp:unauthorized-access`` otherwise), the attach must say it is a mirror
(``amq.mirror`` and the source's node id). A send is stored in the named queue — routed on this
node only, never forwarded to a cluster neighbour — with its origin and id
(``broker.core.deliveries.Mirrored``, journaled with it), after the journal's fsync it is
accepted; a ``postAck`` acknowledges that copy if it is waiting here (one a consumer here holds,
or already gone, is counted as ``acks_not_found``: the seed's and Artemis's caveat — part 2
holds such acks). A transfer that is not the format closes that connection with its AMQP
condition, counted; the node goes on serving everyone else.
"""

from __future__ import annotations

import collections
import json
import logging
from typing import TYPE_CHECKING, Callable, NamedTuple

import trio

from broker.connections.feed import QueueFeed
from broker.connections.mirror_wire import (ACK_REASONS, BATCH_CAPABILITY, BATCH_EVENTS, BROKER_ID, MIRROR_CAPABILITY,
                                            MirrorFormatError, decode_event, encode_batch, encode_control, encode_send,
                                            mirror_address, split_batch, batch_count)
from broker.connections.settings import BrokerConnectionConfig
from broker.core.addresses import ANYCAST, MULTICAST
from broker.core.deliveries import Message, Mirrored, Outcome
from broker.role import Component
from broker.amqp.message import message_meta
from broker.wire.frames import INTERNAL_PREFIX, MIRROR_PREFIX
from broker.wire.io.trioutil import Wakeup

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.engine import AmqpEngine
    from broker.amqp.links import Incoming, OwnedLink
    from broker.amqp.peer import PeerConnection
    from broker.node import Node

log = logging.getLogger("lodestone.broker.mirror")

__all__ = ["MirrorSource", "MirrorSender", "MirrorTarget", "SNF_PREFIX", "MIRROR_CREDIT"]

SNF_PREFIX = INTERNAL_PREFIX + "mirror."
_REASON_NAMES = {v: k for k, v in ACK_REASONS.items()}   # a postAck's reason, as the queues' hooks name it
HELD_RECORDS = "$lodestone.records.mirror-held-acks"      # the target's held acknowledgements, journaled
MAX_HELD_ACKS = 10_000    # held at once at most (Artemis's mirrorMaxPendingAcks); beyond: not held
MIRROR_CREDIT = 1000          # events in flight on the mirror link (Artemis's default credit)
_ORIGIN_CACHE = "mirror:"     # the target's duplicate cache of a source: core.duplicates.origin(prefix + id)


def _queue_definition(q) -> dict:
    """A queue as Artemis's ``createQueue`` event describes it."""
    d = {"name": q.name, "address": q.address, "routing-type": q.routing_type.upper(), "durable": q.durable}
    if q.filter_text is not None:
        d["filter-string"] = q.filter_text
    return d


class MirrorSource:
    """The source side of one mirror (see the module doc)."""

    def __init__(self, cfg: BrokerConnectionConfig) -> None:
        assert cfg.mirror is not None
        self.cfg = cfg
        self.settings = cfg.mirror
        self.snf_name = SNF_PREFIX + cfg.name
        self.node: "Node | None" = None
        self.snf = None
        self.counters: collections.Counter = collections.Counter()
        self._watched: list = []
        self._events: list[bytes] = []     # this round's events, not yet in the queue (flush_events)
        self._durable = False              # one of them is durable
        self._held = False                 # the journal is held for them (Journal.hold)
        self._wake = Wakeup()
        self.pending_events = 0            # events in the store-and-forward queue, not yet accepted
        self.target_id: str | None = None  # the target's node id, once it answered an attach
        self.seq = 0                       # events written to the queue so far (this activation)
        self._outstanding: dict[int, int] = {}   # queue message id -> seq of its first event, in order
        self._applier: "MirrorTarget | None" = None   # this node's target side (echo avoidance)
        #: queue messages whose records are not yet durable here (and on a gating backup): the
        #: sender holds them back, so the target never applies a change this node could lose
        self.unwritten: set[int] = set()
        self.sender: "MirrorSender | None" = None

    # -- installed while the node serves ---------------------------------------------------------
    def install(self, node: "Node") -> None:
        self.node = node
        self._applier = node.component(MirrorTarget.name)
        core = node.core
        snf = core.queues.get(self.snf_name)
        initial = snf is None and self.settings.initial_sync   # this mirror's first start here
        if initial and node.journal is not None:
            node.journal.hold()        # the queue's creation and the copies reach the disk together
        if snf is None:
            core.declare_address(self.snf_name, [ANYCAST])
            snf = core.queues[self.snf_name]
        snf.max_delivery_count = 0     # a link that reconnects is not a failed delivery
        self.snf = snf
        self.pending_events = 0
        self.seq = 0
        self._outstanding.clear()
        self.unwritten.clear()
        for m in list(snf.messages):     # recovered: waiting for the target since before the restart
            self._outstanding[m.mid] = self.seq + 1
            n = batch_count(m.body)
            self.seq += n
            self.pending_events += n
        node.before_commit.append(self.flush_events)
        if self.settings.sync:
            node.sync_mirrors.append(self)
        for q in list(core.queues.values()):
            if self._watch(q) and self.settings.queue_creation:
                self._event(encode_control("createQueue", origin=node.node_id, address=q.address, queue=q.name,
                                           definition=_queue_definition(q)), True)
        if initial:
            self._copy_existing()
            if node.journal is not None:
                node.journal.release()
        core.add_queue_listener(self._queue_changed)

    def _copy_existing(self) -> None:
        """``initial-sync`` (beyond Artemis): at the mirror's first start, every message already in
        a mirrored queue — waiting, or with a consumer — is sent once, in order, before any event
        that follows; the store-and-forward queue's creation is written in the same journal write,
        so a restart neither copies them again nor skips them."""
        n = 0
        for q in self._watched:
            present = list(q.messages)
            for sub in q.subs:
                present.extend(sub.unacked.values())
            for msg in sorted(present, key=lambda m: m.mid):
                self.added(q, msg)
                n += 1
        self.flush_events()
        self.counters["initial_copies"] = n
        log.info("mirror %s: initial sync: %d messages already here are copied to the target", self.cfg.name, n)

    def uninstall(self) -> None:
        node = self.node
        if node is None:
            return
        self.flush_events()
        node.before_commit.remove(self.flush_events)
        if self in node.sync_mirrors:
            node.sync_mirrors.remove(self)
        node.core.remove_queue_listener(self._queue_changed)
        for q in self._watched:
            q.mirror = tuple(m for m in q.mirror if m is not self)
        self._watched.clear()
        self.node = None
        if self.settings.sync:
            node.mirror_confirmed()      # what it held is answered: this node no longer serves

    def mirrors(self, q) -> bool:
        return (not q.name.startswith("$") and not q.temporary and not q.deleted
                and self.settings.address_filter.allows(q.address))

    def _watch(self, q) -> bool:
        if not self.mirrors(q) or self in q.mirror:
            return False
        q.mirror = q.mirror + (self,)
        self._watched.append(q)
        return True

    def _from_target(self) -> bool:
        """The change being made was applied from our own target's mirror (a dual mirror): it is
        not sent back there (Artemis: acks and create/delete are skipped toward the same remote)."""
        t = self._applier
        return t is not None and t.applying is not None and t.applying == self.target_id

    def _queue_changed(self, q, created: bool) -> None:
        if self._from_target():
            if created:
                self._watch(q)
            elif q in self._watched:
                self._watched.remove(q)
            return
        if created:
            if self._watch(q) and self.settings.queue_creation:
                self._event(encode_control("createQueue", origin=self.node.node_id, address=q.address, queue=q.name,
                                           definition=_queue_definition(q)), True)
            return
        if q in self._watched:
            self._watched.remove(q)
            if self.settings.queue_removal:
                self._event(encode_control("deleteQueue", origin=self.node.node_id, address=q.address, queue=q.name),
                            True)

    # -- the queues' hooks (broker.core.queues.Queue.mirror) ------------------------------------
    def added(self, queue, msg: Message) -> None:
        origin = msg.origin
        if type(origin) is Mirrored:
            # a copy applied from another mirror keeps its origin's id; it goes on (a ring) except
            # to its origin, which has it (a target also drops a send of its own: an echo)
            if origin.node == self.target_id:
                return
            self.counters["sends"] += 1
            self._event(encode_send(msg.body, origin.id, trg_queue=queue.name, address=msg.address,
                                    origin=origin.node), msg.durable)
            return
        self.counters["sends"] += 1
        self._event(encode_send(msg.body, msg.mid, trg_queue=queue.name, address=msg.address), msg.durable)

    def removed(self, queue, msg: Message, reason: str) -> None:
        if not self.settings.message_acknowledgements or self._from_target():
            return
        origin = msg.origin
        node_id, mid = (origin.node, origin.id) if type(origin) is Mirrored else (self.node.node_id, msg.mid)
        self.counters["acks"] += 1
        self._event(encode_control("postAck", origin=node_id, address=queue.address, queue=queue.name,
                                   message_id=mid, reason=ACK_REASONS[reason]), msg.durable)

    def _event(self, data: bytes, durable: bool) -> None:
        """An event joins this round's batch. A durable one holds the journal from the record of
        its cause (just appended) on, so cause and batch reach the disk in one write."""
        if self.settings.sync:
            self.node.core.sync_events += 1   # the send or commit that caused it waits for the target
        if durable and self.settings.durable:
            if not self._held and self.node.journal is not None:
                self.node.journal.hold()
                self._held = True
            self._durable = True
        events = self._events
        events.append(data)
        if len(events) == 1:
            self._wake.set()
        elif len(events) >= BATCH_EVENTS:
            self.flush_events()

    def flush_events(self) -> None:
        """This round's events become one message of the store-and-forward queue (a batch when
        there are several); the journal's hold ends. Run by :meth:`run` once the round's other
        tasks ran, by the node's committer before it answers anyone, and when full."""
        events = self._events
        if events and self.node is not None:
            self._events = []
            core = self.node.core
            body = events[0] if len(events) == 1 else encode_batch(events)
            self.pending_events += len(events)
            msg = Message(core.next_mid(), body, self._durable, self.snf_name)
            self._outstanding[msg.mid] = self.seq + 1
            self.seq += len(events)
            if self._durable and self.node.journal is not None:
                self.unwritten.add(msg.mid)            # before enqueue: the sender may take it at once
                self.node.await_written(self, msg.mid)
            self.snf.enqueue(msg)
            self._durable = False
        if self._held:
            self._held = False
            self.node.journal.release()

    def synced(self, mids: list[int]) -> None:
        """These batches are durable (the node's committer, ``Node.await_written``): they may go."""
        self.unwritten.difference_update(mids)
        if self.sender is not None:
            self.sender.written()

    def confirmed(self, seq: int) -> bool:
        """Whether the target accepted every event up to ``seq`` (or this mirror stopped running
        here: the node no longer serves, so there is nobody left to answer)."""
        out = self._outstanding
        return self.node is None or not out or next(iter(out.values())) > seq

    def accepted(self, mids) -> None:
        """The target settled these messages of the queue (MirrorSender)."""
        out = self._outstanding
        for mid in mids:
            out.pop(mid, None)
        if self.settings.sync and self.node is not None:
            self.node.mirror_confirmed()

    async def run(self) -> None:
        """For one activation: write each round's events once the tasks that made them ran."""
        while True:
            await self._wake.wait()
            self.flush_events()

    def describe(self, sender: "MirrorSender | None") -> dict:
        return {"queue": self.snf_name, "pending": self.pending_events + len(self._events), "sync": self.settings.sync,
                "held": self.node.mirror_held_count if self.settings.sync and self.node is not None else 0,
                "sends": self.counters["sends"], "acks": self.counters["acks"],
                "sent": sender.events_sent if sender is not None else 0,
                "acknowledged": sender.events_acknowledged if sender is not None else 0,
                "transfers": sender.transfers if sender is not None else 0,
                "batching": bool(sender is not None and sender.batching),
                "attached": bool(sender is not None and sender.sender.attached),
                "target_node_id": sender.target_id if sender is not None else None}


class MirrorSender(QueueFeed):
    """For one session of the connection: consumes the store-and-forward queue in order and
    sends its events on the mirror link, several per transfer when the target offers batches
    (see the module doc and ``broker.connections.feed``)."""

    on_reject = Outcome.ACCEPTED      # an event the target cannot apply is dropped (it said why)

    def __init__(self, source: MirrorSource, peer: "PeerConnection", restart: Callable[[], None]) -> None:
        node = source.node
        self.source = source
        self.node_id = node.node_id
        self.target_id: str | None = None
        self._restart = restart
        sender = peer.sender(mirror_address(source.cfg.name), self.outcome, name=f"{peer.name}-mirror",
                             capabilities=(MIRROR_CAPABILITY, BATCH_CAPABILITY), properties={BROKER_ID: node.node_id},
                             on_attached=self._check)
        # the window opens at the first attach, once the target said whether it takes batches
        super().__init__(source.snf, sender, MIRROR_CREDIT, started=False, batch=encode_batch,
                         batch_max=BATCH_EVENTS)
        self._mode: bool | None = None
        self._parts: dict[int, int] = {}     # a batch sent event by event: its events not yet settled
        self._parked: collections.deque[Message] = collections.deque()   # handed out, not yet durable
        self.events_sent = self.events_acknowledged = 0
        peer.before_output = self.flush
        source.sender = self

    def _check(self, link: "OwnedLink") -> str | None:
        """The target's answer must be a mirror's: ``amq.mirror`` and an id that is not ours."""
        if MIRROR_CAPABILITY not in link.remote_capabilities:
            return f"the peer does not offer {MIRROR_CAPABILITY}: not a mirror target"
        theirs = link.remote_properties.get(BROKER_ID)
        if not isinstance(theirs, str) or not theirs:
            return f"the peer's mirror attach has no {BROKER_ID}"
        if theirs == self.node_id:
            return "the mirror's target is this node itself"
        if theirs != self.target_id:
            log.info("mirror %s: attached to node %s", self.source.cfg.name, theirs)
        self.target_id = self.source.target_id = theirs
        batching = BATCH_CAPABILITY in link.remote_capabilities
        if self._mode is None:
            self._mode = self.batching = batching
            self.start()
        elif batching != self._mode:
            # an alternate host of another kind: what is in flight was built for the other one
            log.warning("mirror %s: the target %s batches; starting the mirror's session again",
                        self.source.cfg.name, "now" if batching else "no longer")
            self._restart()
        return None

    def rejected_by_peer(self, n: int) -> None:
        log.error("mirror %s: the target rejected %d event(s); dropped", self.source.cfg.name, n)

    # a message of the store-and-forward queue holds one event or a batch (MirrorSource.flush_events)
    def _sink(self, sub, msg: Message) -> None:
        if self._parked or msg.mid in self.source.unwritten:
            self._parked.append(msg)     # in order: what follows waits behind it
            return
        self._hand(sub, msg)

    def written(self) -> None:
        """The source's batches became durable: send the parked ones, in order."""
        parked, unwritten = self._parked, self.source.unwritten
        while parked and parked[0].mid not in unwritten:
            msg = parked.popleft()
            if msg.mid in self.sub.unacked:      # not put back meanwhile (closed)
                self._hand(self.sub, msg)

    def _hand(self, sub, msg: Message) -> None:
        if self.batching:
            super()._sink(sub, msg)
            return
        self.sent += 1        # a target without batches: one event per transfer
        events = split_batch(msg.body)
        if events is None:
            self.transfers += 1
            self.events_sent += 1
            self.sender.send(msg.body, msg.mid)
            return
        self._parts[msg.mid] = len(events)
        for i, ev in enumerate(events):
            self.transfers += 1
            self.events_sent += 1
            self.sender.send(ev, _Part(msg.mid, i))

    def send_batch(self, batch: list[Message]) -> None:
        """What the queue handed out goes as one batch of all their events."""
        if len(batch) == 1:
            body = batch[0].body
            self.events_sent += batch_count(body)
            self.sender.send(body, batch[0].mid)
            return
        events: list[bytes] = []
        for m in batch:
            evs = split_batch(m.body)
            if evs is None:
                events.append(m.body)
            else:
                events.extend(evs)
        self.events_sent += len(events)
        self.sender.send(encode_batch(events), tuple(m.mid for m in batch))

    def outcome(self, token, state: str) -> None:
        settled = state in ("accepted", "rejected") and not self.sub.closed
        if type(token) is _Part:
            if not settled:
                return
            if state == "rejected":
                self.rejected_by_peer(1)
            self.events_acknowledged += 1
            self.source.pending_events -= 1
            left = self._parts.get(token.mid, 1) - 1
            if left > 0:
                self._parts[token.mid] = left
                return
            self._parts.pop(token.mid, None)
            super().outcome(token.mid, "accepted")     # every event of the message is settled
            self.source.accepted((token.mid,))
            return
        if settled:
            unacked = self.sub.unacked
            mids = self.mids(token)
            n = sum(batch_count(unacked[m].body) for m in mids if m in unacked)
            self.events_acknowledged += n
            self.source.pending_events -= n
            super().outcome(token, state)
            self.source.accepted(mids)
            return
        super().outcome(token, state)

    def close(self) -> None:
        self._parts.clear()
        self._parked.clear()
        if self.source.sender is self:
            self.source.sender = None
        super().close()


class _Part(NamedTuple):
    """The token of one event of a batch sent on its own (a target without batches)."""
    mid: int
    index: int


class _MirrorIn:
    """One mirror link at the target (a ``broker.amqp.links`` handler)."""

    def __init__(self, target: "MirrorTarget", engine: "AmqpEngine", origin: str, batches: bool) -> None:
        self.target = target
        self.engine = engine
        self.origin = origin
        self.batches = batches    # both sides named BATCH_CAPABILITY: a transfer may hold several events

    def on_attached(self, link: "OwnedLink") -> None:
        link.credit_window = MIRROR_CREDIT     # the engine keeps it topped up
        link.flow(MIRROR_CREDIT)
        log.info("mirror: a mirror from node %s attached (%s)", self.origin, link.address)

    def on_detached(self, link: "OwnedLink", condition) -> None:
        pass

    def on_message(self, link: "OwnedLink", data: bytes, delivery: "Incoming") -> None:
        target = self.target
        synced = False
        target.applying = self.origin      # what this changes is not mirrored back to it (dual mirrors)
        try:
            events = split_batch(data) if self.batches else None
            for one in (data,) if events is None else events:
                if target.apply(self.origin, decode_event(one)):
                    synced = True
        except MirrorFormatError as exc:
            target.applying = None
            self.target.counters["bad_events"] += 1
            log.warning("mirror: a malformed event from node %s; closing its connection",
                        self.origin, extra={"fields": {"condition": exc.condition, "description": exc.description,
                                                       "source": self.engine.source}})
            delivery.reject(exc.condition, exc.description)
            self.engine.close_with(exc.condition, exc.description)
            return
        finally:
            target.applying = None
        if synced:
            delivery.accept_when_synced()
        else:
            delivery.accept()


class MirrorTarget(Component):
    """The target side on every node: the mirror links' service (see the module doc)."""

    name = "mirror-target"

    def __init__(self) -> None:
        self.node: "Node | None" = None
        self.counters: collections.Counter = collections.Counter()
        #: (origin node, its id of the message) -> (queue, our message id), for its postAck
        self.index: dict[tuple[str, int], tuple[str, int]] = {}
        self.indexed = False
        #: while an event is applied: the node id of the mirror it came from (MirrorSource._from_target)
        self.applying: str | None = None
        self.held: dict[int, int] = {}     # acknowledgements waiting for a consumer: our mid -> record id

    def activated(self, node: "Node", nursery: trio.Nursery) -> None:
        self.node = node
        self.indexed = False     # built at the first mirror attach of this activation (_build_index)
        self.index.clear()
        self.held.clear()
        if node.journal is not None:
            self._recover_held()
        node.services.register(MIRROR_PREFIX, self)

    def _build_index(self) -> None:
        """The mirrored copies this node holds (recovered from the journal, or kept from an
        earlier activation), so the postAcks that follow find them; read once, at the first
        mirror that attaches — a node that is nobody's target never reads its queues for it."""
        self.indexed = True
        index = self.index
        index.clear()
        for q in self.node.core.queues.values():
            for m in q.messages:
                if type(m.origin) is Mirrored:
                    index[(m.origin.node, m.origin.id)] = (q.name, m.mid)

    async def deactivating(self, node: "Node", reason: str, close_listeners: Callable[[], None]) -> None:
        node.services.unregister(MIRROR_PREFIX)

    # -- the link service -----------------------------------------------------------------------
    def attach(self, engine: "AmqpEngine", link: "OwnedLink"):
        node = self.node
        if not link.is_receiver:
            return ("amqp:not-allowed", f"{link.address!r}: a mirror link carries events to this node, not from it")
        principal = engine.principal
        if principal is None or not node.security.check(principal, "mirror", link.address):
            self.counters["refused"] += 1
            who = getattr(principal, "user", None)
            log.warning("mirror: user %r may not mirror into %r (the users file's mirror permission)", who,
                        link.address, extra={"fields": {"source": engine.source}})
            return ("amqp:unauthorized-access", f"user {who!r} lacks the mirror permission on {link.address!r}")
        if MIRROR_CAPABILITY not in link.remote_capabilities:
            return ("amqp:precondition-failed", f"a mirror link must ask for {MIRROR_CAPABILITY}")
        origin = link.remote_properties.get(BROKER_ID)
        if not isinstance(origin, str) or not origin or len(origin) > 256:
            return ("amqp:invalid-field", f"a mirror link's attach needs {BROKER_ID} (the source's node id)")
        if origin == node.node_id:
            return ("amqp:precondition-failed", "a node cannot mirror to itself")
        if not self.indexed:
            self._build_index()
        batches = BATCH_CAPABILITY in link.remote_capabilities
        link.capabilities = (MIRROR_CAPABILITY, BATCH_CAPABILITY) if batches else (MIRROR_CAPABILITY,)
        link.properties = {BROKER_ID: node.node_id}
        self.counters["links"] += 1
        return _MirrorIn(self, engine, origin, batches)

    # -- applying events ------------------------------------------------------------------------
    def apply(self, link_origin: str, ev) -> bool:
        """Apply one event; True when the journal was written (accept after its fsync)."""
        node = self.node
        core = node.core
        origin = ev.origin or link_origin
        if ev.kind == "send":
            return self._send(origin, ev)
        if ev.kind == "postAck":
            self.counters["acks"] += 1
            reason = _REASON_NAMES.get(ev.reason, "normal")
            if origin == node.node_id:    # a message of ours, taken at another site (a dual mirror)
                q, mid = core.queues.get(ev.queue), ev.message_id
            else:                         # our copy of another site's message
                found = self.index.pop((origin, ev.message_id), None)
                q, mid = (core.queues.get(found[0]), found[1]) if found is not None else (None, None)
            if q is not None and (q.deleted or mid is None):
                q = None
            gone = q.remove_waiting(mid, reason) if q is not None else None
            if gone is None:
                if q is not None:     # not waiting: a consumer here holds it (or it is gone)
                    return self._hold(q, origin, mid)
                self.counters["acks_not_found"] += 1
                return False
            return gone.durable and q.durable     # the removal was journaled: accept after its fsync
        if ev.kind == "createQueue":
            self.counters["queues_created"] += 1
            return self._create_queue(ev)
        if ev.kind == "deleteQueue":
            q = core.queues.get(ev.queue)
            if q is not None and not q.name.startswith("$"):
                self.counters["queues_deleted"] += 1
                core.delete_queue(q.name)
                return True
            return False
        if ev.kind == "addAddress":
            if ev.address not in core.addresses and not ev.address.startswith("$"):
                types = [t.lower() for t in (ev.definition or {}).get("routing-types", []) if isinstance(t, str)]
                core.declare_address(ev.address, [t for t in types if t in (ANYCAST, MULTICAST)] or [MULTICAST])
                return True
            return False
        if ev.kind == "deleteAddress":
            return False    # an address goes with its last queue here (deleteQueue); nothing to do
        return False

    # -- held acknowledgements (beyond Artemis, which retries a few times, then drops them) ------
    def _hold(self, q, origin: str, mid: int) -> bool:
        """A postAck for a message a consumer here holds: it waits, journaled, until the consumer
        settles (then it is moot) or gives the message back (then it is applied, and the message
        is not delivered again). True when a record was journaled (accept after its fsync)."""
        if mid in self.held:
            return False     # the same acknowledgement again (a resend): it waits already
        if len(self.held) >= MAX_HELD_ACKS:
            self.counters["acks_dropped"] += 1
            if self.counters["acks_dropped"] == 1 or self.counters["acks_dropped"] % 1000 == 0:
                log.warning("mirror: %d acknowledgements held already; one for a message a consumer holds here "
                            "is dropped (that message may be delivered here again)", MAX_HELD_ACKS)
            return False
        if not q.hold_ack(mid, lambda msg, returned: self._held_done(q, origin, mid, msg, returned)):
            self.counters["acks_not_found"] += 1
            return False
        core = self.node.core
        rec = core.next_mid()
        self.held[mid] = rec
        self.counters["acks_held"] += 1
        if self.node.journal is None:
            return False
        core.store.add_record(HELD_RECORDS, rec, json.dumps([q.name, mid, origin]).encode())
        return True

    def _held_done(self, q, origin: str, mid: int, msg: Message, returned: bool) -> None:
        rec = self.held.pop(mid, None)
        if returned:
            before, self.applying = self.applying, origin    # not mirrored back to where it came from
            try:
                q.acknowledge(msg)
            finally:
                self.applying = before
            self.counters["held_acks_applied"] += 1
        else:
            self.counters["held_acks_moot"] += 1
        if rec is not None and self.node.journal is not None:
            self.node.core.store.remove_record(HELD_RECORDS, rec)

    def _recover_held(self) -> None:
        """Acknowledgements held when the node stopped: their messages came back to their queues
        at the restart, so they are applied now, before anyone consumes."""
        node = self.node
        records = node.internal_records.pop(HELD_RECORDS, ())
        core = node.core
        for rec, body in records:
            try:
                qname, mid, origin = json.loads(body)
            except ValueError:
                qname = None
            q = core.queues.get(qname) if isinstance(qname, str) else None
            if q is not None and isinstance(mid, int):
                before, self.applying = self.applying, origin
                try:
                    if q.remove_waiting(mid) is not None:
                        self.counters["held_acks_applied"] += 1
                finally:
                    self.applying = before
            core.store.remove_record(HELD_RECORDS, rec)

    def _create_queue(self, ev) -> bool:
        core = self.node.core
        d = ev.definition or {}
        name, address = ev.queue, ev.address
        if name.startswith("$") or address.startswith("$") or name in core.queues:
            return False
        ftext = d.get("filter-string")
        try:
            q = core.create_queue_as(name, address, str(d.get("routing-type", "ANYCAST")).lower(),
                                     ftext if isinstance(ftext, str) else None)
        except (ValueError, KeyError) as exc:
            log.warning("mirror: cannot create queue %r: %s", name, exc)
            return False
        if q is None:
            self.counters["queues_unsupported"] += 1
            log.warning("mirror: queue %r on %r (%s) has no equivalent here; its messages are not applied",
                        name, address, d.get("routing-type"))
            return False
        return True

    def _send(self, origin: str, ev) -> bool:
        core = self.node.core
        if origin == self.node.node_id:
            self.counters["echoes"] += 1     # our own message come back round (a ring whose source
            return False                     # did not know its target yet): we have it
        key = ev.message_id.to_bytes(8, "big")
        cache = _ORIGIN_CACHE + origin
        dups = core.duplicates
        if dups.seen_from(cache, key):
            self.counters["duplicates"] += 1
            return True      # its first copy may still wait for its fsync
        qname = ev.queue or ev.address
        q = core.queues.get(qname)
        if q is None and ev.queue == ev.address and ev.address and not ev.address.startswith("$"):
            core.declare_address(ev.address, [ANYCAST])     # its createQueue did not come (queue-creation off)
            q = core.queues.get(qname)
        if q is None or q.deleted or q.name.startswith("$"):
            self.counters["sends_unroutable"] += 1
            return False
        durable, priority, expires = message_meta(ev.message)
        store = core.store
        store.begin_group()
        try:
            msg = Message(core.next_mid(), ev.message, durable, ev.address or q.address, 0, priority, expires,
                          Mirrored(origin, ev.message_id))
            stored = q.enqueue(msg)
            dups.remember_from(cache, key, persist=stored)
        finally:
            wrote = store.end_group()
        self.index[(origin, ev.message_id)] = (q.name, msg.mid)
        self.counters["sends"] += 1
        self.node.count("messages_in")
        return wrote

    def describe(self) -> dict:
        return {"links": self.counters["links"], "sends": self.counters["sends"], "acks": self.counters["acks"],
                "acks_not_found": self.counters["acks_not_found"], "duplicates": self.counters["duplicates"],
                "bad_events": self.counters["bad_events"], "refused": self.counters["refused"],
                "queues_created": self.counters["queues_created"], "queues_deleted": self.counters["queues_deleted"],
                "sends_unroutable": self.counters["sends_unroutable"], "echoes": self.counters["echoes"],
                "acks_held": self.counters["acks_held"], "held_acks_applied": self.counters["held_acks_applied"],
                "held_acks_moot": self.counters["held_acks_moot"], "acks_dropped": self.counters["acks_dropped"],
                "pending_acks": len(self.held), "tracked": len(self.index)}
