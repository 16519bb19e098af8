"""The broker's AMQP engine with transactions, in memory: a proton client transport wired to an
``AmqpEngine`` on a real ``Node`` and a real journal (no sockets, no trio). Shows what the
process tests cannot time exactly: a commit's discharge is answered only after the fsync."""

from __future__ import annotations

from proton import Collector, Connection, Delivery, Described, Message, Terminus, Transport, symbol

from broker.amqp.engine import AmqpEngine
from broker.config import load_config
from broker.node import Node
from broker.store.journal import Journal
from tests.brokerproc import write_config
from tests.engine_pair import pump


class Wire:
    """A proton client connection pumped against one engine."""

    def __init__(self, tmp_path):
        cfg = load_config(write_config(tmp_path / "cfg"))
        self.journal = Journal.open(tmp_path / "journal")
        self.node = Node(cfg, None, "0123456789abcdef", self.journal)
        self.node.authorize = lambda principal, permission, address: True
        self.engine = AmqpEngine(self.node, conn_id="c1", principal=None, source="test", tls=False,
                                 wake=lambda: None)
        self.conn = Connection()
        self.transport = Transport()
        self.transport.bind(self.conn)
        self.conn.collect(Collector())
        self.conn.open()
        self.session = self.conn.session()
        self.session.open()
        self.tags = 0
        self.pump()

    def pump(self) -> None:
        pump(self.transport, self.engine, 10)

    def commit_fsync(self) -> None:
        """What Node.committer does: flush + fsync, then answer the deliveries that waited."""
        waiters, self.node.sync_waiters = self.node.sync_waiters, {}
        self.journal.flush()
        for engine, ds in waiters.items():
            engine.synced(ds)
        self.pump()

    def coordinator(self):
        snd = self.session.sender("txn-ctrl")
        snd.target.type = Terminus.COORDINATOR
        snd.target.capabilities.put_object(symbol("amqp:local-transactions"))
        snd.open()
        self.pump()
        return snd

    def control(self, snd, descriptor: str, fields: list) -> Delivery:
        self.tags += 1
        d = snd.delivery(b"c%d" % self.tags)
        snd.send(Message(body=Described(symbol(descriptor), fields)).encode())
        snd.advance()
        self.pump()
        return d


def test_discharge_is_answered_only_after_the_fsync(tmp_path):
    w = Wire(tmp_path)
    ctrl = w.coordinator()
    assert ctrl.remote_target.type == Terminus.COORDINATOR
    declare = w.control(ctrl, "amqp:declare:list", [None])
    assert declare.remote_state == 0x33
    txn_id = bytes(declare.remote.data[0])
    producer = w.session.sender("p")
    producer.target.address = "q"
    producer.open()
    w.pump()
    for i in range(3):
        d = producer.delivery(b"t%d" % i)
        d.local.data = [txn_id]
        d.update(0x34)
        producer.send(Message(body=f"m{i}", durable=True).encode())
        producer.advance()
    w.pump()
    assert w.node.core.queues["q"].depth == 0 and w.journal.messages("q") == []
    discharge = w.control(ctrl, "amqp:discharge:list", [txn_id, False])
    # committed in memory and in the journal's pending records, but not durable: no answer yet
    assert w.node.core.queues["q"].depth == 3
    assert len(w.journal.messages("q")) == 3 and w.journal.synced_seq < w.journal.last_seq
    assert discharge.remote_state == 0 and not discharge.settled
    w.commit_fsync()
    assert discharge.remote_state == Delivery.ACCEPTED and discharge.settled
    w.journal.close()
    with Journal.open(tmp_path / "journal") as j:
        assert [m.body[-2:] for m in j.messages("q")] == [b"m0", b"m1", b"m2"]


def test_rollback_and_unknown_id_are_answered_at_once(tmp_path):
    w = Wire(tmp_path)
    ctrl = w.coordinator()
    txn_id = bytes(w.control(ctrl, "amqp:declare:list", [None]).remote.data[0])
    rb = w.control(ctrl, "amqp:discharge:list", [txn_id, True])
    assert rb.remote_state == Delivery.ACCEPTED
    again = w.control(ctrl, "amqp:discharge:list", [txn_id, False])
    assert again.remote_state == Delivery.REJECTED
    assert again.remote.condition.name == "amqp:transaction:unknown-id"
    glob = w.control(ctrl, "amqp:declare:list", [b"global"])
    assert glob.remote_state == Delivery.REJECTED and glob.remote.condition.name == "amqp:not-implemented"
    junk = w.control(ctrl, "amqp:frobnicate:list", [])
    assert junk.remote_state == Delivery.REJECTED


def test_connections_without_a_coordinator_never_build_one(tmp_path):
    w = Wire(tmp_path)
    producer = w.session.sender("p")
    producer.target.address = "q"
    producer.open()
    w.pump()
    d = producer.delivery(b"x")
    producer.send(Message(body="plain").encode())
    producer.advance()
    w.pump()
    assert w.engine.txn is None and d.remote_state == Delivery.ACCEPTED
