"""Local transactions (AMQP 1.0 §4): the pure part.

Theory of operation
-------------------
A client declares a transaction on a *coordinator* link and gets a txn-id (§4.3); it then sends
messages and settles deliveries carrying ``TransactionalState(txn-id, …)`` (§4.4) and finally
discharges it: commit or roll back (§4.3). The wire side lives in :mod:`broker.amqp.txn`; this
module only decides.

* :class:`TransactionTable` — the transactions of one connection: ``declare`` (at most
  ``limit`` open at once, else :class:`TooManyTransactions`), ``get`` (unknown id →
  :class:`UnknownTransaction`), ``discharge`` and ``rollback_all`` (the connection went away).
* A **transactional send** is held by its :class:`Transaction` (nothing routed, nothing
  written) and routed to the address's queues only at commit; a rollback drops it.
* A **transactional acknowledgement** takes the message away from its consumer at once
  (``Queue.hold``: it stays acquired — counted in the queue's depth, redelivered to nobody —
  even if the consumer's link goes away, as in Artemis, where a transactional ack leaves the
  consumer's delivering list) and applies the outcome at commit (``Queue.settle_held``).
  A rollback returns the held messages to the head of their queues in their original order
  with one more failed delivery attempt (Artemis increments the delivery count of a rolled-back
  ack; past ``max_delivery_count`` they are dead-lettered), ``Queue.return_held``.
* **Commit** applies everything inside ``store.begin_group()`` … ``store.end_group()``: a
  durable store writes every message add, ack and delivery-count change of the commit as one
  atomic journal record (``broker.store.journal`` GROUP). ``Discharged.stored`` tells the shell
  to answer the discharge only once that record is durable.
* A transaction marked *rollback-only* (one of its sends was refused) rolls back when asked to
  commit; the discharge then fails with ``amqp:transaction:rollback``.
* **Duplicate ids** (``_AMQ_DUPL_ID``, :mod:`broker.core.duplicates`): a send whose id its
  address already remembers marks the transaction rollback-only (Artemis
  ``PostOfficeImpl.checkDuplicateID`` does, for a send inside a transaction). The commit looks
  again before it applies anything — another connection may have committed the id since, or the
  transaction may carry one id twice — and rolls back if any id is a duplicate. Otherwise each
  send's id is remembered in the commit's store group, with its message.

Every acknowledgement carries an opaque ``token`` (the shell's handle of the delivery); a
discharge hands the tokens back so the shell can settle the deliveries. Nothing here reads a
clock, does I/O or knows about proton.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from broker.core.deliveries import DEFAULT_PRIORITY, Message, Outcome
from broker.core.duplicates import MISSING
from broker.wire.errors import LodestoneError

if TYPE_CHECKING:  # pragma: no cover
    from broker.core.addresses import Broker
    from broker.core.queues import Queue, Subscription

__all__ = ["Transaction", "TransactionTable", "Discharged", "TransactionError", "UnknownTransaction",
           "TransactionRollback", "TooManyTransactions", "DEFAULT_MAX_TRANSACTIONS"]

DEFAULT_MAX_TRANSACTIONS = 16


class TransactionError(LodestoneError):
    """A transaction request that cannot be honoured; ``condition`` is the AMQP error."""

    condition = "amqp:internal-error"


class UnknownTransaction(TransactionError):
    """No open transaction has this txn-id (on this connection)."""

    condition = "amqp:transaction:unknown-id"


class TransactionRollback(TransactionError):
    """A commit that could not be done: the transaction was rolled back instead."""

    condition = "amqp:transaction:rollback"


class TooManyTransactions(TransactionError):
    """The connection has as many open transactions as it may."""

    condition = "amqp:resource-limit-exceeded"


@dataclass(slots=True)
class _Publish:
    address: str
    body: bytes
    durable: bool
    priority: int = DEFAULT_PRIORITY
    expires: float = 0
    origin: object = None
    dup_key: bytes | None = None   # the send's duplicate id (broker.core.duplicates.duplicate_key)


@dataclass(slots=True)
class _Ack:
    queue: "Queue"
    msg: Message
    outcome: Outcome
    delivery_failed: bool
    undeliverable_here: bool
    token: Any


@dataclass(frozen=True)
class Discharged:
    """What a discharge did. ``error`` is set when a commit became a rollback."""

    txn_id: bytes
    committed: bool
    stored: bool = False          # a store group was written: answer after it is durable
    tokens: list = field(default_factory=list)
    published: int = 0
    acknowledged: int = 0
    error: TransactionError | None = None


class Transaction:
    """One open transaction: the sends and acknowledgements it holds until discharged."""

    __slots__ = ("txn_id", "owner", "publishes", "acks", "rollback_only")

    def __init__(self, txn_id: bytes, owner: object = None):
        self.txn_id = txn_id
        self.owner = owner                    # free for the shell (its coordinator link)
        self.publishes: list[_Publish] = []
        self.acks: list[_Ack] = []
        self.rollback_only: str | None = None

    def publish(self, address: str, body: bytes, durable: bool, priority: int = DEFAULT_PRIORITY,
                expires: float = 0, origin: object = None, dup_key: bytes | None = None) -> None:
        """Hold a message for ``address`` until commit (its expiry counts from its arrival);
        ``dup_key``: its duplicate id, checked again and remembered at commit."""
        self.publishes.append(_Publish(address, body, durable, priority, expires, origin, dup_key))

    def acknowledge(self, queue: "Queue", sub: "Subscription", mid: int, outcome: Outcome, *,
                    delivery_failed: bool = False, undeliverable_here: bool = False,
                    token: Any = None) -> bool:
        """A consumer settled message ``mid`` inside this transaction. False if the consumer does
        not hold it (already settled, or returned when the consumer went away)."""
        msg = queue.hold(sub, mid)
        if msg is None:
            return False
        self.acks.append(_Ack(queue, msg, outcome, delivery_failed, undeliverable_here, token))
        return True

    def mark_rollback_only(self, reason: str) -> None:
        if self.rollback_only is None:
            self.rollback_only = reason

    def _duplicate(self, broker: "Broker") -> str | None:
        """Why the commit must not happen: a send whose duplicate id its address remembers, or
        that an earlier send of this transaction carries (counted as a duplicate); else None."""
        ours: set[tuple[str, bytes]] = set()
        dups = broker.duplicates
        for p in self.publishes:
            if p.dup_key is None:
                continue
            if (p.address, p.dup_key) in ours or dups.lookup(p.address, p.dup_key) is not MISSING:
                dups.duplicate(p.address, transactional=True)
                return f"duplicate message detected: _AMQ_DUPL_ID already seen on address {p.address!r}"
            ours.add((p.address, p.dup_key))
        return None

    def _commit(self, broker: "Broker") -> Discharged:
        store = broker.store
        store.begin_group()
        try:
            for p in self.publishes:
                held: list[str] | None = None if p.dup_key is None else []
                stored = broker.publish(p.address, p.body, p.durable, p.priority, p.expires, p.origin, held)
                if p.dup_key is not None:
                    broker.duplicates.remember(p.address, p.dup_key, persist=stored, held=held)
            for a in self.acks:
                a.queue.settle_held(a.msg, a.outcome, delivery_failed=a.delivery_failed,
                                    undeliverable_here=a.undeliverable_here)
        finally:
            stored = store.end_group()
        return Discharged(self.txn_id, True, stored, [a.token for a in self.acks],
                          len(self.publishes), len(self.acks))

    def _rollback(self, error: TransactionError | None = None) -> Discharged:
        per_queue: dict[int, tuple["Queue", list[Message]]] = {}
        for a in self.acks:
            per_queue.setdefault(id(a.queue), (a.queue, []))[1].append(a.msg)
        for q, msgs in per_queue.values():
            q.return_held(msgs)
        return Discharged(self.txn_id, False, False, [a.token for a in self.acks], 0, 0, error)


class TransactionTable:
    """The open transactions of one connection (txn-ids are ``<prefix>:<n>``, unique per node run)."""

    def __init__(self, prefix: str, limit: int = DEFAULT_MAX_TRANSACTIONS):
        self.prefix = prefix
        self.limit = limit
        self.open: dict[bytes, Transaction] = {}
        self._n = 0
        self.committed = 0
        self.rolled_back = 0

    def __len__(self) -> int:
        return len(self.open)

    def declare(self, owner: object = None) -> Transaction:
        """A new transaction; :class:`TooManyTransactions` past ``limit`` open ones."""
        if len(self.open) >= self.limit:
            raise TooManyTransactions(f"connection has {len(self.open)} transactions open: "
                                      f"max-transactions {self.limit} reached")
        self._n += 1
        txn = Transaction(f"{self.prefix}:{self._n}".encode(), owner)
        self.open[txn.txn_id] = txn
        return txn

    def get(self, txn_id: bytes) -> Transaction:
        txn = self.open.get(bytes(txn_id)) if txn_id is not None else None
        if txn is None:
            raise UnknownTransaction(f"unknown transaction id {_show(txn_id)}")
        return txn

    def discharge(self, txn_id: bytes, fail: bool, broker: "Broker") -> Discharged:
        """Commit (``fail`` false) or roll back; :class:`UnknownTransaction` if not open.

        A rollback-only transaction asked to commit rolls back; the result carries a
        :class:`TransactionRollback` error.
        """
        txn = self.get(txn_id)
        del self.open[txn.txn_id]
        if fail:
            self.rolled_back += 1
            return txn._rollback()
        if txn.rollback_only is None:
            txn.rollback_only = txn._duplicate(broker)
        if txn.rollback_only is not None:
            self.rolled_back += 1
            return txn._rollback(TransactionRollback(f"transaction rolled back: {txn.rollback_only}"))
        self.committed += 1
        return txn._commit(broker)

    def rollback_where(self, owner: object) -> list[Discharged]:
        """Roll back the open transactions declared by ``owner`` (its coordinator link ended)."""
        out = []
        for txn_id in [t.txn_id for t in self.open.values() if t.owner == owner]:
            txn = self.open.pop(txn_id)
            self.rolled_back += 1
            out.append(txn._rollback())
        return out

    def rollback_all(self) -> list[Discharged]:
        """The connection ended: every open transaction rolls back."""
        out = []
        for txn in list(self.open.values()):
            self.rolled_back += 1
            out.append(txn._rollback())
        self.open.clear()
        return out


def _show(txn_id: object) -> str:
    if isinstance(txn_id, (bytes, bytearray, memoryview)):
        b = bytes(txn_id)
        try:
            return repr(b.decode("ascii"))
        except UnicodeDecodeError:
            return "0x" + b.hex()
    return repr(txn_id)
