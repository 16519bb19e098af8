"""A local queue's consumer that sends what it is handed to a peer and settles it on the peer's
outcome: the one shape under a broker connection's senders and its mirror link.

Theory of operation
-------------------
A :class:`QueueFeed` is a core ``Subscription`` on one local queue with ``window`` messages in
flight. Each message handed out goes to the peer on a ``broker.amqp.peer.PeerSender`` with a
token naming it (:meth:`QueueFeed.token`), or — when :attr:`QueueFeed.batching` is on — joins a
batch that the owner sends as one transfer right before the connection's next write
(:meth:`QueueFeed.flush`, run from ``PeerConnection.before_output``; also when the batch is
full). The message stays unacknowledged here until the peer settles its transfer:

* accepted → acknowledged here;
* rejected → :attr:`QueueFeed.on_reject` (the senders dead-letter it, the mirror drops it);
* released or modified → nothing here: the ``PeerSender`` sends it again.

The window is topped up once per settled transfer, so one dispatch hands out as many messages as
that transfer answered. A lost connection sends the unsettled transfers again on the next one
(at-least-once); :meth:`QueueFeed.close` puts what the peer has not settled back on the queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from broker.core.deliveries import Message, Outcome
from broker.core.queues import Subscription

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.peer import PeerSender

__all__ = ["QueueFeed"]

BATCH_BYTES = 256 * 1024    # a batch is sent at once when it reaches this many bytes


class QueueFeed:
    """One local queue's consumer sending to a peer (see the module doc)."""

    #: the local outcome of a message the peer rejected
    on_reject = Outcome.REJECTED

    def __init__(self, queue, sender: "PeerSender", window: int, *, started: bool = True,
                 batch: Callable[[list[bytes]], bytes] | None = None, batch_max: int = 1) -> None:
        """``started``: hand messages out now (False: only after :meth:`start`); ``batch``:
        how several bodies become one transfer's (used once :attr:`batching` is set)."""
        self.queue = queue
        self.sender = sender
        self.window = window
        self.batching = False
        self._encode_batch = batch
        self._batch_max = batch_max
        self._batch: list[Message] = []
        self._batch_bytes = 0
        self.sent = self.acknowledged = self.rejected = self.transfers = 0
        self._open = started
        self.sub = Subscription(self._sink, owner=self)
        self.sub.credit = window if started else 0
        queue.add_subscription(self.sub)

    def token(self, mid: int) -> Any:
        """What names one message on the ``PeerSender`` (unique among its transfers)."""
        return mid

    def mids(self, token: Any) -> tuple:
        """The messages a transfer's token names."""
        return token if type(token) is tuple else (token,)

    def start(self) -> None:
        """Open the window (a feed made with ``started=False``)."""
        if self._open or self.sub.closed:
            return
        self._open = True
        self.sub.credit = self.window - len(self.sub.unacked)
        self.queue.credit_changed(self.sub)

    def _sink(self, sub: Subscription, msg: Message) -> None:
        self.sent += 1
        if not self.batching:
            self.transfers += 1
            self.sender.send(msg.body, self.token(msg.mid))
            return
        batch = self._batch
        batch.append(msg)
        self._batch_bytes += len(msg.body)
        if len(batch) >= self._batch_max or self._batch_bytes >= BATCH_BYTES:
            self.flush()
        elif len(batch) == 1:
            self.sender.peer.wake()    # the connection's writer runs flush first

    def flush(self) -> None:
        """Send the batch as one transfer (the connection's ``before_output``; also when full)."""
        batch = self._batch
        if not batch:
            return
        self._batch = []
        self._batch_bytes = 0
        self.transfers += 1
        self.send_batch(batch)

    def send_batch(self, batch: list[Message]) -> None:
        """One transfer for the messages of ``batch``, named by the tuple of their ids."""
        if len(batch) == 1:
            self.sender.send(batch[0].body, self.token(batch[0].mid))
        else:
            self.sender.send(self._encode_batch([m.body for m in batch]), tuple(m.mid for m in batch))

    def outcome(self, token: Any, state: str) -> None:
        """The peer settled the transfer ``token`` names."""
        sub = self.sub
        if state not in ("accepted", "rejected") or sub.closed:
            return   # released/modified: the PeerSender sends it again
        mids = self.mids(token)
        if state == "accepted":
            self.acknowledged += len(mids)
            outcome = Outcome.ACCEPTED
        else:
            self.rejected += len(mids)
            self.rejected_by_peer(len(mids))
            outcome = self.on_reject
        unacked = sub.unacked
        queue = self.queue
        for mid in mids:
            if mid in unacked:
                queue.settle(sub, mid, outcome)
        if self._open:
            sub.credit = self.window - len(unacked)     # what is handed out is in unacked, batched or sent
            queue.credit_changed(sub)

    def rejected_by_peer(self, n: int) -> None:
        """Log a rejection (the owner's words)."""

    def close(self) -> None:
        """Stop consuming: what the peer has not settled goes back to the queue."""
        self._batch = []
        self._batch_bytes = 0
        if not self.queue.deleted:
            self.queue.remove_subscription(self.sub)
