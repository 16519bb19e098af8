"""Messages and delivery outcomes of the broker's pure message model.

Theory of operation: a :class:`Message` is what a queue holds: the encoded AMQP bare+annotated
message exactly as the producer sent it (the broker does not decode bodies), its durability, and
the number of failed delivery attempts so far. A multicast address puts one ``Message`` per
subscriber queue (they share the ``body`` bytes, but each queue counts its own delivery attempts).

When a consumer answers a delivery, the driver maps the AMQP outcome (§3.4 delivery state) onto
:class:`Outcome` and the queue decides what happens next (see ``queues.Queue.settle``):

* ``ACCEPTED`` — the message is done; the queue forgets it (and the store deletes its record).
* ``RELEASED`` — not processed; back to the head of the queue, delivery count unchanged (§3.4.4).
* ``MODIFIED`` — back to the head; ``delivery_failed`` adds one to the delivery count,
  ``undeliverable_here`` is treated like a failed attempt (the broker has no per-consumer exclusion).
* ``REJECTED`` — the message is invalid: it goes to the dead-letter address at once.

A consumer that goes away without settling counts as a failed attempt for every unsettled
message (Artemis does the same). Past ``max_delivery_count`` attempts a message is dead-lettered.
This module is pure: no clock, no I/O.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["Message", "Mirrored", "Outcome", "DEFAULT_PRIORITY", "Relayed"]


class Outcome(enum.Enum):
    """What a consumer said about one delivery (AMQP 1.0 §3.4)."""

    ACCEPTED = "accepted"
    RELEASED = "released"
    REJECTED = "rejected"
    MODIFIED = "modified"


DEFAULT_PRIORITY = 4  # AMQP 1.0 §3.2.1 (and JMS): a message without a priority has 4


class Mirrored(NamedTuple):
    """A message's ``origin`` on a mirror's target: the source node and its id of the message
    (``x-opt-amq-mr-id``), which the source's acknowledgement names. Journaled with the message."""

    node: str
    id: int


class Relayed(NamedTuple):
    """A shared queue's message (``broker.cluster.shared``): the broker that relayed it to a root
    and its relay id. It travels with the message when the message moves to another root, so that
    root drops a copy it already stored. Journaled with the message."""

    node: str
    id: bytes


class Message:
    """One message in one queue.

    ``mid`` is unique per broker node for the message's lifetime in the store (the journal keys
    records by it); ``body`` is the encoded message; ``address`` is where the producer sent it
    (kept for dead-lettering and management). ``priority`` (0-9) orders delivery within a queue;
    ``expires`` is when the message expires, in milliseconds since the epoch (0: never);
    ``origin`` names the connection that published it (for ``no-local`` consumers).
    """

    __slots__ = ("mid", "body", "durable", "address", "delivery_count", "priority", "expires", "origin", "view")

    def __init__(self, mid: int, body: bytes, durable: bool, address: str, delivery_count: int = 0,
                 priority: int = DEFAULT_PRIORITY, expires: float = 0, origin: object = None):
        self.mid = mid
        self.body = body
        self.durable = durable
        self.address = address
        self.delivery_count = delivery_count
        self.priority = priority
        self.expires = expires
        self.origin = origin
        self.view = None  # a filter's decoded view of the body (broker.core.filters.view_of)

    @property
    def size(self) -> int:
        return len(self.body)

    def copy(self, mid: int) -> "Message":
        """The same message with a new id and no failed attempts (for another queue)."""
        return Message(mid, self.body, self.durable, self.address, 0, self.priority, self.expires, self.origin)

    def __repr__(self) -> str:
        return (f"Message(mid={self.mid}, {len(self.body)} B, durable={self.durable}, "
                f"address={self.address!r}, delivery_count={self.delivery_count}, priority={self.priority})")
