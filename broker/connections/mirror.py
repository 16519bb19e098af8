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
each become an **event**, written to the mirror's store-and-forward queue
``$lodestone.mirror.<name>`` (journaled when ``durable``) at once, in the same journal write as
the change itself (and in the same group when the change is one: a transaction's commit, a
send with a duplicate id). Queue creation and removal become events too (``queue-creation``,
``queue-removal``), and when the mirror is installed, every queue it mirrors is announced
(``createQueue``), as Artemis catches the topology up at start. Messages that were there before
the mirror started are not copied (as Artemis).

The wire format is :mod:`broker.connections.mirror_wire`. A send is mirrored per queue: the event
names the queue it was stored in (``x-opt-amq-mr-trg-q``) and the id of that queue's copy
(``x-opt-amq-mr-id``), which is the id its ``postAck`` names.

**The link** (:class:`MirrorSender`, while the connection's session runs) consumes the
store-and-forward queue in order and sends each event on one link to
``$ACTIVEMQ_ARTEMIS_MIRROR_<name>``; an event leaves the queue when the target accepted it, which
it does only once the event is applied and durable. A lost connection sends the unsettled events
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
import logging
from typing import TYPE_CHECKING, Any, Callable

import trio

from broker.connections.mirror_wire import (ACK_REASONS, BROKER_ID, MIRROR_CAPABILITY, MirrorFormatError,
                                            decode_event, encode_control, encode_send, mirror_address)
from broker.connections.settings import BrokerConnectionConfig
from broker.core.addresses import ANYCAST, MULTICAST
from broker.core.deliveries import Message, Mirrored, Outcome
from broker.core.queues import Subscription
from broker.role import Component
from broker.amqp.message import message_meta
from broker.wire.frames import INTERNAL_PREFIX, MIRROR_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.engine import AmqpEngine
    from broker.amqp.links import Incoming, OwnedLink
    from broker.amqp.peer import PeerConnection
    from broker.node import Node

log = logging.getLogger("lodestone.broker.mirror")

__all__ = ["MirrorSource", "MirrorSender", "MirrorTarget", "SNF_PREFIX", "MIRROR_CREDIT"]

SNF_PREFIX = INTERNAL_PREFIX + "mirror."
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

    # -- installed while the node serves ---------------------------------------------------------
    def install(self, node: "Node") -> None:
        self.node = node
        core = node.core
        snf = core.queues.get(self.snf_name)
        if snf is None:
            core.declare_address(self.snf_name, [ANYCAST])
            snf = core.queues[self.snf_name]
        snf.max_delivery_count = 0     # a link that reconnects is not a failed delivery
        self.snf = snf
        for q in list(core.queues.values()):
            if self._watch(q) and self.settings.queue_creation:
                self._event(encode_control("createQueue", origin=node.node_id, address=q.address, queue=q.name,
                                           definition=_queue_definition(q)), True)
        core.add_queue_listener(self._queue_changed)

    def uninstall(self) -> None:
        node = self.node
        if node is None:
            return
        node.core.remove_queue_listener(self._queue_changed)
        for q in self._watched:
            q.mirror = tuple(m for m in q.mirror if m is not self)
        self._watched.clear()
        self.node = None

    def mirrors(self, q) -> bool:
        return (not q.name.startswith("$") and not q.temporary and not q.deleted
                and self.settings.address_filter.allows(q.address))

    def _watch(self, q) -> bool:
        if not self.mirrors(q) or self in q.mirror:
            return False
        q.mirror = q.mirror + (self,)
        self._watched.append(q)
        return True

    def _queue_changed(self, q, created: bool) -> None:
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
        if type(msg.origin) is Mirrored:
            return     # applied from another mirror (part 2: dual mirrors): not sent back
        self.counters["sends"] += 1
        self._event(encode_send(msg.body, msg.mid, trg_queue=queue.name, address=msg.address), msg.durable)

    def removed(self, queue, msg: Message, reason: str) -> None:
        if not self.settings.message_acknowledgements:
            return
        self.counters["acks"] += 1
        self._event(encode_control("postAck", origin=self.node.node_id, address=queue.address, queue=queue.name,
                                   message_id=msg.mid, reason=ACK_REASONS[reason]), msg.durable)

    def _event(self, data: bytes, durable: bool) -> None:
        core = self.node.core
        self.snf.enqueue(Message(core.next_mid(), data, durable and self.settings.durable, self.snf_name))

    def describe(self, sender: "MirrorSender | None") -> dict:
        snf = self.snf
        return {"queue": self.snf_name, "pending": snf.depth if snf is not None else 0,
                "sends": self.counters["sends"], "acks": self.counters["acks"],
                "sent": sender.sent if sender is not None else 0,
                "acknowledged": sender.acknowledged if sender is not None else 0,
                "attached": bool(sender is not None and sender.sender.attached),
                "target_node_id": sender.target_id if sender is not None else None}


class MirrorSender:
    """For one session of the connection: consumes the store-and-forward queue in order and
    sends its events on the mirror link (see the module doc)."""

    def __init__(self, source: MirrorSource, peer: "PeerConnection") -> None:
        self.source = source
        node = source.node
        self.node_id = node.node_id
        self.queue = source.snf
        self.target_id: str | None = None
        self.sender = peer.sender(mirror_address(source.cfg.name), self._outcome, name=f"{peer.name}-mirror",
                                  capabilities=(MIRROR_CAPABILITY,), properties={BROKER_ID: node.node_id},
                                  on_attached=self._check)
        self.sub = Subscription(self._sink, owner=self)
        self.sub.credit = MIRROR_CREDIT
        self.sent = self.acknowledged = 0
        self.queue.add_subscription(self.sub)

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
        self.target_id = theirs
        return None

    def _sink(self, sub: Subscription, msg: Message) -> None:
        self.sent += 1
        self.sender.send(msg.body, msg.mid)

    def _outcome(self, mid: Any, state: str) -> None:
        if state not in ("accepted", "rejected") or self.sub.closed:
            return   # released/modified: sent again
        if state == "rejected":
            log.error("mirror %s: the target rejected an event; it is dropped", self.source.cfg.name)
        self.acknowledged += 1
        if mid in self.sub.unacked:
            self.queue.settle(self.sub, mid, Outcome.ACCEPTED)
        self.sub.credit += 1
        self.queue.credit_changed(self.sub)

    def close(self) -> None:
        """What the target has not accepted goes back to the queue (sent again next session)."""
        if not self.queue.deleted:
            self.queue.remove_subscription(self.sub)


class _MirrorIn:
    """One mirror link at the target (a ``broker.amqp.links`` handler)."""

    def __init__(self, target: "MirrorTarget", engine: "AmqpEngine", origin: str) -> None:
        self.target = target
        self.engine = engine
        self.origin = origin

    def on_attached(self, link: "OwnedLink") -> None:
        link.credit_window = MIRROR_CREDIT     # the engine keeps it topped up
        link.flow(MIRROR_CREDIT)
        log.info("mirror: a mirror from node %s attached (%s)", self.origin, link.address)

    def on_detached(self, link: "OwnedLink", condition) -> None:
        pass

    def on_message(self, link: "OwnedLink", data: bytes, delivery: "Incoming") -> None:
        try:
            ev = decode_event(data)
        except MirrorFormatError as exc:
            self.target.counters["bad_events"] += 1
            log.warning("mirror: a malformed event from node %s; closing its connection",
                        self.origin, extra={"fields": {"condition": exc.condition, "description": exc.description,
                                                       "source": self.engine.source}})
            delivery.reject(exc.condition, exc.description)
            self.engine.close_with(exc.condition, exc.description)
            return
        synced = self.target.apply(self.origin, ev)
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

    def activated(self, node: "Node", nursery: trio.Nursery) -> None:
        self.node = node
        self.index.clear()
        for q in node.core.queues.values():
            for m in q.messages:
                if type(m.origin) is Mirrored:
                    self.index[(m.origin.node, m.origin.id)] = (q.name, m.mid)
        node.services.register(MIRROR_PREFIX, self)

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
        link.capabilities = (MIRROR_CAPABILITY,)
        link.properties = {BROKER_ID: node.node_id}
        self.counters["links"] += 1
        return _MirrorIn(self, engine, origin)

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
            found = self.index.pop((origin, ev.message_id), None)
            q = core.queues.get(found[0]) if found is not None else None
            gone = q.remove_waiting(found[1]) if q is not None else None
            if gone is None:
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

    def _create_queue(self, ev) -> bool:
        core = self.node.core
        d = ev.definition or {}
        name, address = ev.queue, ev.address
        if name.startswith("$") or address.startswith("$") or name in core.queues:
            return False
        rtype = str(d.get("routing-type", "ANYCAST")).lower()
        try:
            if rtype == ANYCAST and name == address:
                core.declare_address(address, [ANYCAST])
            elif rtype == MULTICAST:
                core.declare_address(address, [MULTICAST])
                core.subscription_queue(address, name, durable=True)
            else:
                self.counters["queues_unsupported"] += 1
                log.warning("mirror: queue %r on %r (%s) has no equivalent here; its messages are not applied",
                            name, address, rtype)
                return False
            ftext = d.get("filter-string")
            if isinstance(ftext, str) and ftext and core.compile_filter is not None:
                core.set_queue_filter(name, core.compile_filter(ftext), ftext)
        except (ValueError, KeyError) as exc:
            log.warning("mirror: cannot create queue %r: %s", name, exc)
            return False
        return True

    def _send(self, origin: str, ev) -> bool:
        core = self.node.core
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
                "sends_unroutable": self.counters["sends_unroutable"], "tracked": len(self.index)}
