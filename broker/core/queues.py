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
they go to the dead-letter address instead.

A queue does not know the broker that owns it: it is given a :class:`QueueHost` — the store, the
clock, and the few callbacks by which it hands work back (dead-letter, expire, delete a temporary
queue whose last consumer left, a consumer arrived or left). ``Broker`` owns one host shared by
all its queues; a test can give a queue a fake one.

Durable messages in durable queues are written to the store: ``store.add`` on enqueue,
``store.delivery_count_changed`` when a failed attempt comes back to the queue (a consumer
went away, or settled ``modified`` with delivery-failed/undeliverable-here) so that
``max_delivery_count`` still holds after a restart, and ``store.remove`` when acknowledged or
moved elsewhere. The store is an injected object (the journal adapter in the shell, a list in
tests); the queue only says *what* changed.

Beyond plain FIFO (each costs nothing while unused):

* **Priority** (0-9, AMQP 1.0 §3.2.1): the queue keeps a plain deque until a message with a
  priority other than the default 4 arrives; from then on :class:`PriorityMessages` (one FIFO per
  level, the highest level first). Order within a level is arrival order.
* **Order on return**: a released, modified or returned message goes back *to its place* —
  before the first waiting message with a higher id — so however a consumer's dispositions are
  ranged or ordered, the next consumer sees the original order (Artemis does the same).
* **Filters**: a subscription may carry ``accepts(msg)`` (a selector, ``no-local``); a queue may
  carry ``filter`` (a queue filter: non-matching messages never enter it, see
  ``Broker.publish``). With filtered subscriptions, dispatch scans for a message each
  subscription accepts; a message nobody accepts waits (Artemis's semantics).
* **Browsers** (``distribution-mode = copy``) see waiting messages without acquiring them;
  they are not competing consumers, so they are kept apart from ``subs``.
* **Expiry**: a message whose ``expires`` has passed is never handed out: dispatch and
  :meth:`Queue.expire_scan` move it to the expiry address (or drop it, counted). The time comes
  from the host's ``clock`` (milliseconds since the epoch), asked only for messages
  that have an expiry.

Nothing here does I/O.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from broker.core.deliveries import DEFAULT_PRIORITY, Message, Outcome

if TYPE_CHECKING:  # pragma: no cover
    from broker.core.addresses import Store

__all__ = ["Queue", "QueueHost", "Subscription", "PriorityMessages", "ANYCAST", "MULTICAST"]

ANYCAST = "anycast"
MULTICAST = "multicast"


def _nothing(*_args) -> None:
    return None


@dataclass(frozen=True, slots=True)
class QueueHost:
    """What a queue may ask of its owner: the only way out of a :class:`Queue`.

    * ``store`` — durable storage (``add``, ``remove``, ``delivery_count_changed``);
    * ``clock()`` — milliseconds since the epoch, asked only about messages that can expire;
    * ``dead_letter(queue, msg)`` / ``expire(queue, msg)`` — move a message out (the owner knows
      the other addresses);
    * ``delete_queue(name)`` — a temporary queue's last consumer (or browser) left;
    * ``consumers_changed(queue, sub, added)`` — a competing consumer was added or removed
      (browsers are not consumers here, as in Artemis, see ``broker.core.bindings``).

    ``Broker`` builds one and gives it to every queue it creates.
    """

    store: "Store"
    clock: Callable[[], float]
    dead_letter: Callable[["Queue", Message], None]
    expire: Callable[["Queue", Message], None]
    delete_queue: Callable[[str], None]
    consumers_changed: Callable[["Queue", "Subscription", bool], None] = _nothing


class Subscription:
    """One consumer attached to one queue.

    ``credit`` is maintained by the driver (the link's current credit); the queue decrements it
    for every message handed out. ``sink(sub, msg)`` delivers one message. ``owner`` is free for
    the driver (e.g. its link wrapper). ``accepts(msg) -> bool`` (or None: everything) is the
    consumer's filter and ``filter_text`` its selector, if it has one (told to other nodes of a
    cluster, ``broker.core.bindings``). A ``browser`` reads without acquiring: nothing it is sent is
    ever unacknowledged.
    """

    __slots__ = ("queue", "sink", "credit", "auto_ack", "unacked", "owner", "delivered", "closed",
                 "accepts", "browser", "seen", "filter_text")

    def __init__(self, sink: Callable[["Subscription", Message], None], *, auto_ack: bool = False,
                 owner: object = None, accepts: Callable[[Message], bool] | None = None, browser: bool = False,
                 filter_text: str | None = None):
        self.queue: Queue | None = None
        self.sink = sink
        self.credit = 0
        self.auto_ack = auto_ack
        self.unacked: dict[int, Message] = {}
        self.owner = owner
        self.delivered = 0
        self.closed = False
        self.accepts = accepts
        self.browser = browser
        self.seen: set[int] = set()  # a browser: the ids it has been shown
        self.filter_text = filter_text


class PriorityMessages:
    """Waiting messages in ten FIFOs, one per priority; iterates and pops the highest first.

    Offers the part of ``deque``'s interface the queue uses, so a queue switches to it on the
    first non-default priority without touching the code that reads ``queue.messages``.
    """

    __slots__ = ("levels", "count")

    def __init__(self, messages: Iterable[Message] = ()):
        self.levels: list[deque[Message]] = [deque() for _ in range(10)]
        self.count = 0
        for m in messages:
            self.append(m)

    @staticmethod
    def _level(msg: Message) -> int:
        p = msg.priority
        return 0 if p < 0 else 9 if p > 9 else p

    def append(self, msg: Message) -> None:
        self.levels[self._level(msg)].append(msg)
        self.count += 1

    def appendleft(self, msg: Message) -> None:
        self.levels[self._level(msg)].appendleft(msg)
        self.count += 1

    def popleft(self) -> Message:
        for level in reversed(self.levels):
            if level:
                self.count -= 1
                return level.popleft()
        raise IndexError("pop from an empty queue")

    def return_in_order(self, msg: Message) -> None:
        _insert_in_order(self.levels[self._level(msg)], msg)
        self.count += 1

    def remove_ids(self, ids: set[int]) -> None:
        for i, level in enumerate(self.levels):
            if level:
                kept = deque(m for m in level if m.mid not in ids)
                self.count -= len(level) - len(kept)
                self.levels[i] = kept

    def clear(self) -> None:
        for level in self.levels:
            level.clear()
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0

    def __iter__(self) -> Iterator[Message]:
        for level in reversed(self.levels):
            yield from level


def _insert_in_order(dq: deque, msg: Message) -> None:
    """Put ``msg`` back before the first waiting message with a higher id.

    Returned messages come back near the head, so the scan is short: it passes only the
    messages returned before this one that precede it.
    """
    mid = msg.mid
    i = 0
    for m in dq:
        if m.mid > mid:
            break
        i += 1
    if i == 0:
        dq.appendleft(msg)
    else:
        dq.insert(i, msg)


class Queue:
    """A FIFO of messages with competing subscriptions. Created by ``Broker``, not directly.

    A queue is also this node's *local binding* of its routing name (``broker.core.bindings``):
    ``node_id`` None, always ``connected``, ``has_matching_consumer``.
    """

    node_id = None
    connected = True

    def __init__(self, host: QueueHost, name: str, address: str, routing_type: str, *,
                 durable: bool, max_delivery_count: int, dead_letter_address: str | None,
                 subscription: bool = False, temporary: bool = False, expiry_address: str | None = None,
                 filter: Callable[[Message], bool] | None = None, filter_text: str | None = None):
        self.host = host
        self.name = name
        self.address = address
        self.routing_type = routing_type
        self.durable = durable
        self.max_delivery_count = max_delivery_count
        self.dead_letter_address = dead_letter_address
        self.expiry_address = expiry_address
        self.subscription = subscription  # a multicast subscriber queue
        self.temporary = temporary  # deleted when its last consumer leaves
        self.filter = filter  # a queue filter: messages it does not accept never enter
        self.filter_text = filter_text
        self.messages: deque[Message] | PriorityMessages = deque()
        self.subs: list[Subscription] = []
        self.browsers: list[Subscription] = []
        self.filtered = 0  # subscriptions with a filter (dispatch scans when > 0)
        self._rr = 0
        # counters, per outcome
        self.enqueued = 0
        self.acked = 0
        self.dead_lettered = 0
        self.released = 0
        self.expired = 0
        self.deleted = False
        self.owner: str | None = None  # the user whose link created it (resource limits)
        #: settled inside a transaction not yet discharged (broker.core.transactions): their ids
        self.tx_held: set[int] = set()
        #: the mirrors that copy this queue's changes (``broker.connections.mirror``): each gets
        #: ``added(queue, msg)`` and ``removed(queue, msg, reason)``
        self.mirror: tuple = ()
        #: a mirror's acknowledgements of messages a consumer here holds (hold_ack): mid -> done
        self.acks_held: dict[int, Callable[[Message, bool], None]] | None = None

    # -- state -------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        """Messages waiting plus messages delivered and not yet settled."""
        return len(self.messages) + sum(len(s.unacked) for s in self.subs) + len(self.tx_held)

    @property
    def consumer_count(self) -> int:
        """Consumers and browsers (what management shows)."""
        return len(self.subs) + len(self.browsers)

    def has_matching_consumer(self, msg: Message | None) -> bool:
        """A competing consumer that would take ``msg`` (None: any consumer); browsers do not
        count (Artemis ``QueueImpl.hasMatchingConsumer``)."""
        for s in self.subs:
            if s.accepts is None or msg is None or s.accepts(msg):
                return True
        return False

    def definition(self) -> dict:
        """What the store keeps about a durable queue (a KV record)."""
        d = {"name": self.name, "address": self.address, "routing_type": self.routing_type,
             "subscription": self.subscription}
        if self.owner is not None:
            d["owner"] = self.owner
        if self.filter_text is not None:
            d["filter"] = self.filter_text
        return d

    # -- producing ---------------------------------------------------------------------------
    def enqueue(self, msg: Message) -> bool:
        """Append a message and dispatch. Returns True when the store was written."""
        stored = False
        if msg.expires and self.expiry_address == self.address:
            msg.expires = 0  # the expiry address itself: its messages do not expire again
        if msg.durable and self.durable:
            self.host.store.add(self.name, msg)
            stored = True
        if msg.priority != DEFAULT_PRIORITY and type(self.messages) is deque:
            self.messages = PriorityMessages(self.messages)
        self.messages.append(msg)
        self.enqueued += 1
        if self.mirror:   # before any dispatch: a consumer's acknowledgement must follow the send
            for m in self.mirror:
                m.added(self, msg)
        if self.subs:
            if self.filtered:
                self._dispatch_new(msg)
            else:
                self.dispatch()
        if self.browsers:
            self._browse()
        return stored

    def restore(self, msg: Message) -> None:
        """Put back a message recovered from the store (no store write, no dispatch)."""
        if msg.expires and self.expiry_address == self.address:
            msg.expires = 0
        if msg.priority != DEFAULT_PRIORITY and type(self.messages) is deque:
            self.messages = PriorityMessages(self.messages)
        self.messages.append(msg)

    # -- consuming ---------------------------------------------------------------------------
    def add_subscription(self, sub: Subscription) -> None:
        sub.queue = self
        if sub.browser:
            self.browsers.append(sub)
            self._browse()
            return
        self.subs.append(sub)
        if sub.accepts is not None:
            self.filtered += 1
        if not self.deleted:
            self.host.consumers_changed(self, sub, True)
        self.dispatch()

    def remove_subscription(self, sub: Subscription) -> None:
        """Detach a consumer: its unsettled messages count one failed attempt and come back."""
        if sub.closed:
            return
        sub.closed = True
        if sub.browser:
            try:
                self.browsers.remove(sub)
            except ValueError:
                pass
            self._maybe_delete_temporary()
            return
        try:
            self.subs.remove(sub)
        except ValueError:
            pass
        else:
            if sub.accepts is not None:
                self.filtered -= 1
            if not self.deleted:
                self.host.consumers_changed(self, sub, False)
        if sub.unacked:
            returned = list(sub.unacked.values())
            sub.unacked.clear()
            self._put_back(returned, failed=True)
        if not self._maybe_delete_temporary() and self.subs:
            self.dispatch()

    def _maybe_delete_temporary(self) -> bool:
        if self.temporary and not self.subs and not self.browsers and not self.deleted:
            self.host.delete_queue(self.name)
            return True
        return False

    def _return(self, msg: Message) -> None:
        """A message comes back to the queue, in its original place (see the module doc)."""
        if msg.priority != DEFAULT_PRIORITY and type(self.messages) is deque:
            self.messages = PriorityMessages(self.messages)
        msgs = self.messages
        if type(msgs) is deque:
            if not msgs or msgs[0].mid > msg.mid:
                msgs.appendleft(msg)
            else:
                _insert_in_order(msgs, msg)
        else:
            msgs.return_in_order(msg)

    def dispatch(self) -> int:
        """Hand out waiting messages to subscriptions with credit, round-robin. Returns the count."""
        if self.filtered:
            return self._dispatch_scan()
        msgs = self.messages
        subs = self.subs
        n = 0
        while msgs and subs:
            sub = self._next_with_credit()
            if sub is None:
                break
            msg = msgs.popleft()
            if msg.expires and self._expire_if_due(msg):
                continue
            self._hand_out(sub, msg)
            n += 1
        return n

    def _hand_out(self, sub: Subscription, msg: Message) -> None:
        sub.credit -= 1
        sub.delivered += 1
        if sub.auto_ack:
            self._ack(msg)
        else:
            sub.unacked[msg.mid] = msg
        sub.sink(sub, msg)

    def _next_with_credit(self, msg: Message | None = None) -> Subscription | None:
        """The next subscription (round-robin) with credit that accepts ``msg`` (any, if None)."""
        subs = self.subs
        count = len(subs)
        if count == 1 and msg is None:
            s = subs[0]
            return s if s.credit > 0 else None
        start = self._rr
        for i in range(count):
            s = subs[(start + i) % count]
            if s.credit > 0 and (msg is None or s.accepts is None or s.accepts(msg)):
                self._rr = (start + i + 1) % count
                return s
        return None

    def _dispatch_scan(self) -> int:
        """Dispatch with filtered subscriptions: each waiting message, in order, goes to the next
        subscription with credit that accepts it; the rest wait."""
        if not any(s.credit > 0 for s in self.subs):
            return 0
        taken: set[int] = set()
        n = 0
        for msg in list(self.messages):
            if msg.expires and self.host.clock() >= msg.expires:
                taken.add(msg.mid)
                self._expire(msg)
                continue
            sub = self._next_with_credit(msg)
            if sub is None:
                if not any(s.credit > 0 for s in self.subs):
                    break
                continue
            taken.add(msg.mid)
            self._hand_out(sub, msg)
            n += 1
        if taken:
            self._remove_waiting(taken)
        return n

    def _dispatch_new(self, msg: Message) -> None:
        """With filtered subscriptions, only a new message can be newly deliverable: every older
        waiting one was already offered to every subscription with credit."""
        sub = self._next_with_credit(msg)
        if sub is None:
            return
        if msg.expires and self.host.clock() >= msg.expires:
            self._remove_waiting({msg.mid})
            self._expire(msg)
            return
        self._remove_waiting({msg.mid})
        self._hand_out(sub, msg)

    def _remove_waiting(self, ids: set[int]) -> None:
        msgs = self.messages
        if type(msgs) is deque:
            if len(ids) == 1 and msgs:
                (mid,) = ids
                if msgs[-1].mid == mid:
                    msgs.pop()
                    return
                if msgs[0].mid == mid:
                    msgs.popleft()
                    return
            self.messages = deque(m for m in msgs if m.mid not in ids)
        else:
            msgs.remove_ids(ids)

    def take(self, msg: Message) -> None:
        """Remove a waiting message to move it elsewhere (redistribution, scale-down): it leaves
        the store as an acknowledgement does, without counting as one."""
        self._remove_waiting({msg.mid})
        if msg.durable and self.durable:
            self.host.store.remove(self.name, msg)
        self._mirror_removed(msg, "normal")

    def remove_waiting(self, mid: int, reason: str = "normal") -> Message | None:
        """Acknowledge the waiting message ``mid`` on another node's behalf (a mirror's
        ``postAck``; ``reason`` as for the mirror hooks): None when it is not waiting here
        (delivered to a consumer, or gone). This queue's own mirrors hear of it (a ring passes
        it on; the mirror it came from is not told again)."""
        msgs = self.messages
        found = msgs[0] if msgs and msgs[0].mid == mid else next((m for m in msgs if m.mid == mid), None)
        if found is None:
            return None
        self._remove_waiting({mid})
        self.acked += 1
        if found.durable and self.durable:
            self.host.store.remove(self.name, found)
        if self.mirror:
            self._mirror_removed(found, reason)
        return found

    def hold_ack(self, mid: int, done: Callable[[Message, bool], None]) -> bool:
        """A mirror acknowledges ``mid`` while a consumer here holds it: the acknowledgement waits.
        If the message comes back (released, modified, its consumer gone) it is acknowledged
        instead of delivered again, and ``done(msg, True)`` is called to do it; if the consumer
        settles it otherwise, ``done(msg, False)``. A message a consumer settled inside a transaction
        not yet discharged counts as held (a rollback brings it back). False: nobody here holds ``mid``."""
        if mid not in self.tx_held and not any(mid in sub.unacked for sub in self.subs):
            return False
        if self.acks_held is None:
            self.acks_held = {}
        self.acks_held[mid] = done
        return True

    def acknowledge(self, msg: Message) -> None:
        """Acknowledge a message that is neither waiting nor with a consumer (a held
        acknowledgement applied as the message came back: see :meth:`hold_ack`)."""
        self._ack(msg)

    def _held_ended(self, msg: Message) -> None:
        done = self.acks_held.pop(msg.mid, None)
        if done is not None:
            done(msg, False)

    def _mirror_removed(self, msg: Message, reason: str) -> None:
        if self.mirror:
            for m in self.mirror:
                m.removed(self, msg, reason)

    def _browse(self) -> None:
        """Show browsers (with credit) the waiting messages they have not seen yet."""
        clock = None
        for b in list(self.browsers):
            if b.credit <= 0:
                continue
            seen = b.seen
            for msg in list(self.messages):
                if b.credit <= 0:
                    break
                if msg.mid in seen:
                    continue
                if msg.expires:
                    clock = clock if clock is not None else self.host.clock()
                    if clock >= msg.expires:
                        continue  # the next dispatch or scan expires it
                if b.accepts is not None and not b.accepts(msg):
                    continue
                seen.add(msg.mid)
                b.credit -= 1
                b.delivered += 1
                b.sink(b, msg)
            if len(seen) > 2 * len(self.messages) + 64:  # forget ids that have left the queue
                present = {m.mid for m in self.messages}
                b.seen = seen & present

    def credit_changed(self, sub: Subscription) -> None:
        """The driver set ``sub.credit``: hand out what it can take now."""
        if sub.browser:
            self._browse()
        else:
            self.dispatch()

    def settle(self, sub: Subscription, mid: int, outcome: Outcome, *, delivery_failed: bool = False,
               undeliverable_here: bool = False) -> None:
        """Apply a consumer's outcome for one delivered message (see ``deliveries`` module doc)."""
        msg = sub.unacked.pop(mid, None)
        if msg is None:
            return  # already settled, or returned when the consumer went away
        if self._ended(msg, outcome):
            return
        failed = outcome is Outcome.MODIFIED and (delivery_failed or undeliverable_here)
        if not self._put_back((msg,), failed=failed):
            return  # dead-lettered
        self.released += 1
        if self.filtered:
            sub2 = self._next_with_credit(msg)
            if sub2 is not None:
                self._remove_waiting({msg.mid})
                self._hand_out(sub2, msg)
        else:
            self.dispatch()
        if self.browsers:
            self._browse()

    def _ended(self, msg: Message, outcome: Outcome) -> bool:
        """``accepted`` acknowledges, ``rejected`` dead-letters: True when the outcome ended the
        message here; False for ``released``/``modified`` (the caller puts it back)."""
        if outcome is Outcome.ACCEPTED:
            self._ack(msg)
            return True
        if outcome is Outcome.REJECTED:
            self._dead_letter(msg)
            return True
        return False

    def _put_back(self, msgs, *, failed: bool) -> int:
        """Messages coming back to the queue (released, modified, rolled back, or unsettled by a
        consumer that left), each to its original place. ``failed`` counts one more failed
        delivery attempt (journaled; dead-lettered once exhausted). Returns how many came back."""
        back = 0
        held = self.acks_held
        for msg in sorted(msgs, key=lambda m: m.mid) if len(msgs) > 1 else msgs:
            if held and msg.mid in held:
                held.pop(msg.mid)(msg, True)    # acknowledged meanwhile by a mirror: not delivered again
                continue
            if failed:
                msg.delivery_count += 1
            if self._exhausted(msg):
                self._dead_letter(msg)
                continue
            if failed:
                self._count_changed(msg)
            self._return(msg)
            back += 1
        return back

    def _exhausted(self, msg: Message) -> bool:
        return self.max_delivery_count > 0 and msg.delivery_count >= self.max_delivery_count

    def _count_changed(self, msg: Message) -> None:
        if msg.durable and self.durable:
            self.host.store.delivery_count_changed(self.name, msg)

    def _ack(self, msg: Message) -> None:
        self.acked += 1
        if msg.durable and self.durable:
            self.host.store.remove(self.name, msg)
        if self.mirror:
            self._mirror_removed(msg, "normal")
        if self.acks_held:
            self._held_ended(msg)

    def _dead_letter(self, msg: Message) -> None:
        self.dead_lettered += 1
        if self.acks_held:
            self._held_ended(msg)
        if msg.durable and self.durable:
            self.host.store.remove(self.name, msg)
        if self.mirror:
            self._mirror_removed(msg, "killed")
        self.host.dead_letter(self, msg)

    # -- expiry ------------------------------------------------------------------------------
    def _expire_if_due(self, msg: Message) -> bool:
        """``msg`` was just taken from the waiting list: expire it if its time has come."""
        if self.host.clock() < msg.expires:
            return False
        self._expire(msg)
        return True

    def _expire(self, msg: Message) -> None:
        self.expired += 1
        if self.acks_held:
            self._held_ended(msg)
        if msg.durable and self.durable:
            self.host.store.remove(self.name, msg)
        if self.mirror:
            self._mirror_removed(msg, "expired")
        self.host.expire(self, msg)

    def expire_scan(self, now: float) -> int:
        """Move every waiting message that has expired by ``now`` (ms since the epoch) out of the
        queue (Artemis's periodic expiry scan). Returns how many."""
        due = [m for m in self.messages if m.expires and m.expires <= now]
        if due:
            self._remove_waiting({m.mid for m in due})
            for m in due:
                self._expire(m)
        return len(due)

    # -- transactions (broker.core.transactions) ----------------------------------------------
    def hold(self, sub: Subscription, mid: int) -> Message | None:
        """A consumer settled ``mid`` inside a transaction: the message leaves the consumer (which
        may go away meanwhile) and stays acquired until the discharge. None if not held by it."""
        msg = sub.unacked.pop(mid, None)
        if msg is not None:
            self.tx_held.add(mid)
        return msg

    @property
    def held(self) -> int:
        """How many messages transactions hold (see :meth:`hold`)."""
        return len(self.tx_held)

    def settle_held(self, msg: Message, outcome: Outcome, *, delivery_failed: bool = False,
                    undeliverable_here: bool = False) -> None:
        """Commit: apply the outcome of a held message, as :meth:`settle` does."""
        self.tx_held.discard(msg.mid)
        if self.deleted:
            if msg.durable and self.durable:
                self.host.store.remove(self.name, msg)
            return
        if self._ended(msg, outcome):
            return
        self._return_held([msg], failed=outcome is Outcome.MODIFIED and (delivery_failed or undeliverable_here))

    def return_held(self, msgs: list[Message], *, failed: bool = True) -> None:
        """Rollback: held messages return to the head of the queue in their original order,
        ``failed`` counting one more failed delivery attempt (dead-lettered once exhausted)."""
        for msg in msgs:
            self.tx_held.discard(msg.mid)
        if self.deleted:
            for msg in msgs:
                if msg.durable and self.durable:
                    self.host.store.remove(self.name, msg)
            return
        self._return_held(msgs, failed=failed)

    def _return_held(self, msgs: list[Message], *, failed: bool) -> None:
        back = self._put_back(msgs, failed=failed)
        if not failed:
            self.released += back
        if self.subs:
            self.dispatch()
        if self.browsers:
            self._browse()

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
                    self.host.store.remove(self.name, m)
        return out

    def __repr__(self) -> str:
        return (f"Queue({self.name!r}, address={self.address!r}, {self.routing_type}, "
                f"durable={self.durable}, depth={self.depth}, consumers={len(self.subs)})")


def total_depth(queues: Iterable[Queue]) -> int:
    return sum(q.depth for q in queues)
