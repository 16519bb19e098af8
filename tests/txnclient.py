"""A small blocking client for AMQP 1.0 local transactions, on python-qpid-proton's own API.

``BlockingConnection`` has no transaction calls, but its container does
(``Container.declare_transaction``, proton's ``Transaction``); this wraps them so tests read
top-down::

    c = TxClient(url)
    t = c.declare()                       # waits for Declared
    c.send(t, sender, Message(...))       # waits for TransactionalState(txn-id, accepted)
    m, d = c.receive(receiver); t.handle.accept(d)
    c.commit(t)  /  c.abort(t)            # waits for the discharge's outcome
"""

from __future__ import annotations

from proton import Delivery, Message
from proton.handlers import TransactionHandler
from proton.utils import BlockingConnection

TXN_STATE = 0x34


class Txn(TransactionHandler):
    """One declared transaction and what the broker said about it."""

    def __init__(self):
        super().__init__()
        self.handle = None               # proton's Transaction
        self.declared = False
        self.declare_failed = None       # the rejection's Condition (or True)
        self.committed = False
        self.aborted = False
        self.commit_failed = None

    def on_transaction_declared(self, event):
        self.declared = True

    def on_transaction_declare_failed(self, event):
        self.declare_failed = event.delivery.remote.condition or True

    def on_transaction_committed(self, event):
        self.committed = True

    def on_transaction_aborted(self, event):
        self.aborted = True

    def on_transaction_commit_failed(self, event):
        self.commit_failed = event.delivery.remote.condition or True

    @property
    def discharged(self) -> bool:
        return self.committed or self.aborted or self.commit_failed is not None


class TxClient:
    def __init__(self, url: str, timeout_s: float = 10.0):
        self.bc = BlockingConnection(url, timeout=timeout_s, allowed_mechs="PLAIN")

    def declare(self, *, settle_before_discharge: bool = False) -> Txn:
        t = Txn()
        t.handle = self.bc.container.declare_transaction(self.bc.conn, handler=t,
                                                         settle_before_discharge=settle_before_discharge)
        self.bc.wait(lambda: t.declared or t.declare_failed is not None, msg="waiting for declared")
        return t

    def send(self, t: Txn, sender, msg: Message) -> Delivery:
        """Send inside ``t``; returns the delivery once the broker answered it."""
        d = t.handle.send(sender.link, msg)
        self.bc.wait(lambda: d.remote_state != 0 or d.settled, msg="waiting for the transfer's state")
        return d

    def receive(self, receiver, timeout_s: float = 5.0):
        m = receiver.receive(timeout=timeout_s)
        return m, receiver.fetcher.unsettled.popleft()

    def commit(self, t: Txn) -> Txn:
        t.handle.commit()
        self.bc.wait(lambda: t.discharged, msg="waiting for the commit's outcome")
        return t

    def abort(self, t: Txn) -> Txn:
        t.handle.abort()
        self.bc.wait(lambda: t.discharged, msg="waiting for the rollback's outcome")
        return t

    def close(self) -> None:
        self.bc.close()
