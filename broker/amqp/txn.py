"""AMQP 1.0 local transactions on the wire (AMQP 1.0 Part 4): the coordinator link and the
transactional delivery states, for one connection.

Theory of operation
-------------------
The decisions are in :mod:`broker.core.transactions`; this module maps proton deliveries onto
them. :class:`TxnCoordinator` is created by the engine when a client first attaches a sending
link whose target is a ``coordinator`` (§4.2; proton ``Terminus.COORDINATOR``), so connections
without transactions never carry it.

* **Attach** (§4.2): we answer with a coordinator target offering, as Artemis does,
  ``amqp:local-transactions``, ``amqp:multi-txns-per-ssn`` and ``amqp:multi-ssns-per-txn``. A
  client whose coordinator asks for ``amqp:distributed-transactions`` or
  ``amqp:promotable-transactions`` is refused with ``amqp:not-implemented`` (Artemis ignores the
  request and would fail later).
* **Declare** (0x31, §4.5.1) → ``Declared`` (0x33) with a binary txn-id, settled; a declare with a
  ``global-id`` → rejected ``amqp:not-implemented``; more than ``DEFAULT_MAX_TRANSACTIONS`` open on
  the connection → rejected ``amqp:resource-limit-exceeded``.
* **Discharge** (0x32, §4.5.3): ``fail=false`` commits, ``fail=true`` rolls back; answered
  ``accepted`` — after the journal fsync covering the commit's GROUP record when it wrote one
  (``host.await_sync``, the producers' group commit). An unknown txn-id → rejected
  ``amqp:transaction:unknown-id``; a commit that had to roll back (a send inside it was refused)
  → rejected ``amqp:transaction:rollback``.
* **Transactional send** (a transfer whose state is ``TransactionalState``, 0x34, §4.4.1): held
  by the transaction and answered at once with ``TransactionalState(txn-id, accepted)``, as
  Artemis does. An unknown txn-id → the transfer is rejected ``amqp:transaction:unknown-id``; a
  send the producer may not make (anonymous relay to a forbidden address, an ``_AMQ_DUPL_ID`` of
  another type than string or binary) is rejected and marks the transaction rollback-only. A send
  whose ``_AMQ_DUPL_ID`` its address already remembers is answered as usual but marks the
  transaction rollback-only (Artemis); the commit checks the ids again (``broker.core.transactions``).
* **Transactional acknowledgement** (a consumer's disposition with ``TransactionalState(txn-id,
  outcome)``, §4.4.2): the message is held by the transaction (``Transaction.acknowledge``).
  An unsettled delivery is answered ``TransactionalState(txn-id, accepted)`` (Artemis) and
  settled by us at the discharge: on commit plainly, on rollback as ``modified`` with
  ``delivery-failed`` — the message itself is back in its queue by then. An unknown txn-id
  detaches that consumer link with ``amqp:transaction:unknown-id``.
* **Ending**: the transactions of a coordinator link roll back when it detaches, when its
  session ends and when the connection goes away (Artemis rolls back on connection close).

Proton 0.40 exposes the non-standard states through the generic disposition: the state's
descriptor is ``pn_delivery_remote_state`` (0x34) and its fields are the disposition's ``data``
(``Delivery.remote.data``); we answer by setting ``local.data`` and ``update(0x33|0x34)``.
Only this module pays for that: the engine's hot path does one cheap check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cproton_ffi import lib
from proton import Condition, Delivery, Described, Link, Message, Terminus, symbol, ulong

from broker.core.deliveries import Outcome
from broker.core.duplicates import DUPLICATE_ID_PROPERTY, MISSING
from broker.core.transactions import (DEFAULT_MAX_TRANSACTIONS, TransactionError, TransactionTable,
                                      UnknownTransaction)
from broker.amqp.pn import terminus_capabilities as _capabilities

if TYPE_CHECKING:  # pragma: no cover
    from broker.amqp.engine import AmqpEngine, ConsumerLink, ProducerLink

__all__ = ["TxnCoordinator", "TXN_STATE", "is_coordinator"]

DECLARE = 0x31
DISCHARGE = 0x32
DECLARED = 0x33
TXN_STATE = 0x34
_DESCRIPTORS = {"amqp:declare:list": DECLARE, "amqp:discharge:list": DISCHARGE}
_OUTCOMES = {0x24: Outcome.ACCEPTED, 0x25: Outcome.REJECTED, 0x26: Outcome.RELEASED, 0x27: Outcome.MODIFIED,
             "amqp:accepted:list": Outcome.ACCEPTED, "amqp:rejected:list": Outcome.REJECTED,
             "amqp:released:list": Outcome.RELEASED, "amqp:modified:list": Outcome.MODIFIED}
OFFERED = ("amqp:local-transactions", "amqp:multi-txns-per-ssn", "amqp:multi-ssns-per-txn")
REFUSED = frozenset(("amqp:distributed-transactions", "amqp:promotable-transactions"))
NOT_IMPLEMENTED = "amqp:not-implemented"
DECODE_ERROR = "amqp:decode-error"


def is_coordinator(link: Link) -> bool:
    """A client's sending link to a transaction coordinator (§4.2)?"""
    return link.remote_target.type == Terminus.COORDINATOR


def _code(descriptor) -> int | str | None:
    if isinstance(descriptor, int):
        return int(descriptor)
    if descriptor is not None:
        return str(descriptor)
    return None


def _binary(value) -> bytes | None:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return None


class TxnCoordinator:
    """The coordinator links and transactions of one connection (see the module docstring)."""

    def __init__(self, engine: "AmqpEngine", limit: int = DEFAULT_MAX_TRANSACTIONS):
        self.engine = engine
        self.table = TransactionTable(engine.conn_id, limit)
        self.links: dict[object, Link] = {}      # raw pn_link_t* -> coordinator link

    # -- attach / detach ---------------------------------------------------------------------
    def attach(self, link: Link) -> None:
        engine = self.engine
        wanted = _capabilities(link.remote_target)
        bad = sorted(wanted & REFUSED)
        if bad:
            engine._refuse(link, NOT_IMPLEMENTED, f"only local transactions are supported, not {bad[0]}")
            return
        link.source.copy(link.remote_source)
        link.target.type = Terminus.COORDINATOR
        caps = link.target.capabilities
        caps.put_array(False, caps.SYMBOL)
        caps.enter()
        for c in OFFERED:
            caps.put_symbol(symbol(c))
        caps.exit()
        link.snd_settle_mode = link.remote_snd_settle_mode
        link.rcv_settle_mode = Link.RCV_FIRST
        link.open()
        link.flow(engine.window)
        self.links[link._impl] = link
        engine._count("links_opened")

    def forget_link(self, link: Link) -> None:
        """A coordinator link detached: its open transactions roll back."""
        if self.links.pop(link._impl, None) is not None:
            self._rolled_back(self.table.rollback_where(link._impl))

    def end_session(self, session) -> None:
        for impl, link in list(self.links.items()):
            if link.session == session:
                self.forget_link(link)

    def connection_ended(self) -> None:
        self.links.clear()
        self._rolled_back(self.table.rollback_all())

    def _rolled_back(self, results) -> None:
        for r in results:
            self.engine._count("transactions_rolled_back")
            self._settle_tokens(r.tokens, committed=False)

    # -- deliveries on a coordinator link ------------------------------------------------------
    def on_delivery(self, link, d) -> bool:
        """A delivery on a link that is neither producer nor consumer; True if it was ours."""
        if link not in self.links:
            return False
        dw = Delivery.wrap(d)
        if dw.partial or not dw.readable:
            if dw.settled and not dw.readable:
                dw.settle()
            return True
        lw = self.links[link]
        data = lw.recv(dw.pending)
        lw.advance()
        if lw.credit < self.engine.window >> 1:
            lw.flow(self.engine.window - lw.credit)
        try:
            msg = Message()
            msg.decode(data)
            body = msg.body
            if not isinstance(body, Described) or not isinstance(body.value, list):
                raise ValueError("the body is not a described list")
            code = _code(body.descriptor)
            kind = code if isinstance(code, int) else _DESCRIPTORS.get(code)
        except Exception as exc:  # proton's decode errors, or a body that is no control message
            self.engine._reject(dw._impl, DECODE_ERROR, f"not a transaction control message: {exc}")
            return True
        fields = list(body.value)
        if kind == DECLARE:
            self._declare(dw, link, fields)
        elif kind == DISCHARGE:
            self._discharge(dw, fields)
        else:
            self.engine._reject(dw._impl, NOT_IMPLEMENTED, f"unknown coordinator message {body.descriptor!r}")
        return True

    def _declare(self, dw: Delivery, link_impl, fields: list) -> None:
        if fields and fields[0] is not None:
            self.engine._reject(dw._impl, NOT_IMPLEMENTED, "global transactions (declare with global-id) "
                                                       "are not supported")
            return
        try:
            txn = self.table.declare(owner=link_impl)
        except TransactionError as exc:
            self.engine.limit_exceeded("max-transactions", self.table.limit, "connection")
            self.engine._reject(dw._impl, exc.condition, exc.description)
            return
        self.engine._count("transactions_declared")
        if dw.settled:
            dw.settle()
            return
        dw.local.data = [txn.txn_id]
        dw.update(DECLARED)
        dw.settle()

    def _discharge(self, dw: Delivery, fields: list) -> None:
        engine = self.engine
        txn_id = _binary(fields[0]) if fields else None
        fail = bool(fields[1]) if len(fields) > 1 else False
        mark = engine.core.sync_events
        try:
            result = self.table.discharge(txn_id, fail, engine.core)
        except UnknownTransaction as exc:
            self.engine._reject(dw._impl, exc.condition, exc.description)
            return
        self._settle_tokens(result.tokens, committed=result.committed)
        mirrored = engine.core.sync_events != mark     # a sync mirror's target must have the commit's events
        if not result.committed:
            engine._count("transactions_rolled_back")
            if result.error is not None:
                self.engine._reject(dw._impl, result.error.condition, result.error.description)
                return
        else:
            engine._count("transactions_committed")
            engine._count("messages_in", result.published)
        if dw.settled:
            dw.settle()
        elif result.stored or mirrored:
            d = dw._impl
            lib.pn_incref(d)       # until the fsync answer (engine.synced accepts and settles it)
            engine.host.await_sync(engine, d)
        else:
            dw.update(Delivery.ACCEPTED)
            dw.settle()

    # -- transactional sends ------------------------------------------------------------------
    def on_transfer(self, pl: "ProducerLink", d, data: bytes) -> None:
        """A transfer carrying TransactionalState: hold it in its transaction (§4.4.1)."""
        engine = self.engine
        dw = Delivery.wrap(d)
        state = dw.remote.data or []
        txn_id = _binary(state[0]) if state else None
        try:
            txn = self.table.get(txn_id)
        except UnknownTransaction as exc:
            engine._reject(d, exc.condition, exc.description)
            return
        send, err = engine.prepare_send(pl, data)
        if err is not None:  # as AmqpEngine._publish, but Artemis also marks the transaction rollback-only
            txn.mark_rollback_only(f"a send was refused ({err[0]}: {err[1]})")
            engine._reject(d, *err)
            return
        address, durable, priority, expires, key = send
        if key is not None and engine.core.duplicates.lookup(address, key) is not MISSING:
            # Artemis routes nothing, marks the transaction rollback-only and answers the send
            # as usual; the discharge fails
            engine.core.duplicates.duplicate(address, transactional=True)
            txn.mark_rollback_only(f"duplicate message detected: {DUPLICATE_ID_PROPERTY} already seen "
                                   f"on address {address!r}")
        txn.publish(address, data, durable, priority, expires, engine.conn_id, key)
        if dw.settled:
            dw.settle()
            return
        dw.local.data = [txn.txn_id, Described(ulong(0x24), [])]
        dw.update(TXN_STATE)
        dw.settle()

    # -- transactional acknowledgements ----------------------------------------------------------
    def on_disposition(self, cl: "ConsumerLink", d, mid: int) -> None:
        """A consumer settled a delivery with TransactionalState(txn-id, outcome) (§4.4.2)."""
        engine = self.engine
        dw = Delivery.wrap(d)
        state = dw.remote.data or []
        txn_id = _binary(state[0]) if state else None
        outcome_state = state[1] if len(state) > 1 else None
        try:
            txn = self.table.get(txn_id)
        except UnknownTransaction as exc:
            cl.inflight[d] = mid          # returned with the link's other unsettled messages
            cl.link.condition = Condition(exc.condition, exc.description)
            engine._detach(cl.link, closed=False)
            return
        outcome = None
        failed = undeliverable = False
        if isinstance(outcome_state, Described):
            outcome = _OUTCOMES.get(_code(outcome_state.descriptor))
            if outcome is Outcome.MODIFIED and isinstance(outcome_state.value, list):
                v = outcome_state.value
                failed = bool(v[0]) if len(v) > 0 else False
                undeliverable = bool(v[1]) if len(v) > 1 else False
        if outcome is None:
            # no outcome yet (§4.4.2 allows it): like 'received', not terminal
            if dw.settled:
                cl.queue.settle(cl.sub, mid, Outcome.RELEASED)
                dw.settle()
            else:
                cl.inflight[d] = mid
            return
        remote_settled = dw.settled
        token = None if remote_settled else (cl, d)
        if not txn.acknowledge(cl.queue, cl.sub, mid, outcome, delivery_failed=failed,
                               undeliverable_here=undeliverable, token=token):
            if remote_settled:
                dw.settle()
            return
        if remote_settled:
            dw.settle()
            return
        lib.pn_incref(d)              # until the discharge settles it (_settle_tokens)
        if outcome is Outcome.ACCEPTED:
            dw.local.data = [txn.txn_id, Described(ulong(0x24), [])]
            dw.update(TXN_STATE)
        engine.wake()

    def _settle_tokens(self, tokens: list, *, committed: bool) -> None:
        engine = self.engine
        for token in tokens:
            if token is None:
                continue
            cl, d = token
            if not engine.closed and engine.consumers.get(cl.impl) is cl and not lib.pn_delivery_settled(d):
                if not committed:
                    lib.pn_disposition_set_failed(lib.pn_delivery_local(d), True)
                    lib.pn_delivery_update(d, Delivery.MODIFIED)
                lib.pn_delivery_settle(d)
            lib.pn_decref(d)
        if tokens:
            engine.wake()
