"""Queues, subscriptions and credit-based dispatch: the heart of the broker's pure core.

Theory of operation
-------------------
A :class:`Queue` holds messages in FIFO order and a list of :class:`Subscription` objects (one
per consumer link). The driver tells a subscription how much credit its link has
(``sub.credit``, AMQP 1.0 §2.6.7 link credit) and the queue hands out messages round-robin to
subscriptions that have credit — competing consumers on one queue. Handing out is a call to the
subscription's ``sink(sub, msg)``, which the driver implements (it writes the transfer); the
core never touches a socket.

A subscription is either *at-least-once* (the message stays in ``sub.unacked`` until the
consumer settles it, see :meth:`Queue.settle`) or *at-most-once* (``auto_ack``: the consumer's
link is pre-settled, so the message is acknowledged as soon as it is handed out).

Unsettled messages of a subscription that goes away return to the head of the queue in their
original order with one more failed delivery attempt; past the queue's ``max_delivery_count``
they go to the dead-letter address instead (via the owning :class:`~broker.core.addresses.Broker`).

Durable messages in durable queues are written to the store: ``store.add`` on enqueue,
``store.delivery_count_changed`` when a failed attempt comes back to the queue (a consumer
went away, or settled ``modified`` with delivery-failed/undeliverable-here) so that
``max_delivery_count`` still holds after a restart, and ``store.remove`` when acknowledged or
moved elsewhere. The store is an injected object (the journal adapter in the shell, a list in
tests); the queue only says *what* changed.

Nothing here reads a clock or does I/O.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable, Iterable

from broker.core.deliveries import Message, Outcome

if TYPE_CHECKING:  # pragma: no cover
    from broker.core.addresses import Broker

__all__ = ["Queue", "Subscription", "ANYCAST", "MULTICAST"]

ANYCAST = "anycast"
MULTICAST = "multicast"


class Subscription:
    """One consumer attached to one queue.

    ``credit`` is maintained by the driver (the link's current credit); the queue decrements it
    for every message handed out. ``sink(sub, msg)`` delivers one message. ``owner`` is free for
    the driver (e.g. its link wrapper).
    """

    __slots__ = ("queue", "sink", "credit", "auto_ack", "unacked", "owner", "delivered", "closed")

    def __init__(self, sink: Callable[["Subscription", Message], None], *, auto_ack: bool = False,
                 owner: object = None):
        self.queue: Queue | None = None
        self.sink = sink
        self.credit = 0
        self.auto_ack = auto_ack
        self.unacked: dict[int, Message] = {}
        self.owner = owner
        self.delivered = 0
        self.closed = False


class Queue:
    """A FIFO of messages with competing subscriptions. Created by ``Broker``, not directly."""

    def __init__(self, broker: "Broker", name: str, address: str, routing_type: str, *,
                 durable: bool, max_delivery_count: int, dead_letter_address: str | None,
                 subscription: bool = False, temporary: bool = False):
        self.broker = broker
        self.name = name
        self.address = address
        self.routing_type = routing_type
        self.durable = durable
        self.max_delivery_count = max_delivery_count
        self.dead_letter_address = dead_letter_address
        self.subscription = subscription  # a multicast subscriber queue
        self.temporary = temporary  # deleted when its last consumer leaves
        self.messages: deque[Message] = deque()
        self.subs: list[Subscription] = []
        self._rr = 0
        # counters, per outcome
        self.enqueued = 0
        self.acked = 0
        self.dead_lettered = 0
        self.released = 0
        self.deleted = False
        self.owner: str | None = None  # the user whose link created it (resource limits)
        self.held = 0  # settled inside a transaction not yet discharged (broker.core.transactions)

    # -- state -------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Messages waiting plus messages delivered and not yet settled."""
        return len(self.messages) + sum(len(s.unacked) for s in self.subs) + self.held

    @property
    def consumer_count(self) -> int:
        return len(self.subs)

    def definition(self) -> dict:
        """What the store keeps about a durable queue (a KV record)."""
        d = {"name": self.name, "address": self.address, "routing_type": self.routing_type,
             "subscription": self.subscription}
        if self.owner is not None:
            d["owner"] = self.owner
        return d

    # -- producing ---------------------------------------------------------------------------
    def enqueue(self, msg: Message) -> bool:
        """Append a message and dispatch. Returns True when the store was written."""
        stored = False
        if msg.durable and self.durable:
            self.broker.store.add(self.name, msg)
            stored = True
        self.messages.append(msg)
        self.enqueued += 1
        if self.subs:
            self.dispatch()
        return stored

    def restore(self, msg: Message) -> None:
        """Put back a message recovered from the store (no store write, no dispatch)."""
        self.messages.append(msg)

    # -- consuming ---------------------------------------------------------------------------
    def add_subscription(self, sub: Subscription) -> None:
        sub.queue = self
        self.subs.append(sub)
        self.dispatch()

    def remove_subscription(self, sub: Subscription) -> None:
        """Detach a consumer: its unsettled messages count one failed attempt and come back."""
        if sub.closed:
            return
        sub.closed = True
        try:
            self.subs.remove(sub)
        except ValueError:
            pass
        if sub.unacked:
            returned = sorted(sub.unacked.values(), key=lambda m: m.mid)
            sub.unacked.clear()
            back = []
            for msg in returned:
                msg.delivery_count += 1
                if self._exhausted(msg):
                    self._dead_letter(msg)
                else:
                    self._count_changed(msg)
                    back.append(msg)
            self.messages.extendleft(reversed(back))
        if self.temporary and not self.subs:
            self.broker.delete_queue(self.name)
        elif self.subs:
            self.dispatch()

    def dispatch(self) -> int:
        """Hand out waiting messages to subscriptions with credit, round-robin. Returns the count."""
        msgs = self.messages
        subs = self.subs
        n = 0
        while msgs and subs:
            sub = self._next_with_credit()
            if sub is None:
                break
            msg = msgs.popleft()
            sub.credit -= 1
            sub.delivered += 1
            n += 1
            if sub.auto_ack:
                self._ack(msg)
            else:
                sub.unacked[msg.mid] = msg
            sub.sink(sub, msg)
        return n

    def _next_with_credit(self) -> Subscription | None:
        subs = self.subs
        count = len(subs)
        if count == 1:
            s = subs[0]
            return s if s.credit > 0 else None
        start = self._rr
        for i in range(count):
            s = subs[(start + i) % count]
            if s.credit > 0:
                self._rr = (start + i + 1) % count
                return s
        return None

    def settle(self, sub: Subscription, mid: int, outcome: Outcome, *, delivery_failed: bool = False,
               undeliverable_here: bool = False) -> None:
        """Apply a consumer's outcome for one delivered message (see ``deliveries`` module doc)."""
        msg = sub.unacked.pop(mid, None)
        if msg is None:
            return  # already settled, or returned when the consumer went away
        if outcome is Outcome.ACCEPTED:
            self._ack(msg)
            return
        if outcome is Outcome.REJECTED:
            self._dead_letter(msg)
            return
        failed = outcome is Outcome.MODIFIED and (delivery_failed or undeliverable_here)
        if failed:
            msg.delivery_count += 1
        if self._exhausted(msg):
            self._dead_letter(msg)
            return
        if failed:
            self._count_changed(msg)
        self.released += 1
        self.messages.appendleft(msg)
        self.dispatch()

    def _exhausted(self, msg: Message) -> bool:
        return self.max_delivery_count > 0 and msg.delivery_count >= self.max_delivery_count

    def _count_changed(self, msg: Message) -> None:
        if msg.durable and self.durable:
            self.broker.store.delivery_count_changed(self.name, msg)

    def _ack(self, msg: Message) -> None:
        self.acked += 1
        if msg.durable and self.durable:
            self.broker.store.remove(self.name, msg)

    def _dead_letter(self, msg: Message) -> None:
        self.dead_lettered += 1
        if msg.durable and self.durable:
            self.broker.store.remove(self.name, msg)
        self.broker.dead_letter(self, msg)

    # -- transactions (broker.core.transactions) ----------------------------------------------
    def hold(self, sub: Subscription, mid: int) -> Message | None:
        """A consumer settled ``mid`` inside a transaction: the message leaves the consumer (which
        may go away meanwhile) and stays acquired until the discharge. None if not held by it."""
        msg = sub.unacked.pop(mid, None)
        if msg is not None:
            self.held += 1
        return msg

    def settle_held(self, msg: Message, outcome: Outcome, *, delivery_failed: bool = False,
                    undeliverable_here: bool = False) -> None:
        """Commit: apply the outcome of a held message, as :meth:`settle` does."""
        self.held -= 1
        if self.deleted:
            if msg.durable and self.durable:
                self.broker.store.remove(self.name, msg)
            return
        if outcome is Outcome.ACCEPTED:
            self._ack(msg)
            return
        if outcome is Outcome.REJECTED:
            self._dead_letter(msg)
            return
        self._return_held([msg], failed=outcome is Outcome.MODIFIED and (delivery_failed or undeliverable_here))

    def return_held(self, msgs: list[Message], *, failed: bool = True) -> None:
        """Rollback: held messages return to the head of the queue in their original order,
        ``failed`` counting one more failed delivery attempt (dead-lettered once exhausted)."""
        self.held -= len(msgs)
        if self.deleted:
            for msg in msgs:
                if msg.durable and self.durable:
                    self.broker.store.remove(self.name, msg)
            return
        self._return_held(msgs, failed=failed)

    def _return_held(self, msgs: list[Message], *, failed: bool) -> None:
        back = []
        for msg in sorted(msgs, key=lambda m: m.mid):
            if failed:
                msg.delivery_count += 1
            if self._exhausted(msg):
                self._dead_letter(msg)
                continue
            if failed:
                self._count_changed(msg)
            back.append(msg)
        if not failed:
            self.released += len(back)
        self.messages.extendleft(reversed(back))
        if self.subs:
            self.dispatch()

    # -- teardown ----------------------------------------------------------------------------
    def drain_all(self) -> list[Message]:
        """Remove every message (queue deletion). Store records are removed too."""
        out = list(self.messages)
        for s in self.subs:
            out.extend(s.unacked.values())
            s.unacked.clear()
        self.messages.clear()
        if self.durable:
            for m in out:
                if m.durable:
                    self.broker.store.remove(self.name, m)
        return out

    def __repr__(self) -> str:
        return (f"Queue({self.name!r}, address={self.address!r}, {self.routing_type}, "
                f"durable={self.durable}, depth={self.depth}, consumers={len(self.subs)})")


def total_depth(queues: Iterable[Queue]) -> int:
    return sum(q.depth for q in queues)
