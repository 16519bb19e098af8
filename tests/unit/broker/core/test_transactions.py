"""Pure tests of local transactions (broker.core.transactions) over the real message core."""

from __future__ import annotations

import pytest

from broker.core.addresses import ANYCAST, MULTICAST, AddressSettings, Broker, SettingsResolver
from broker.core.deliveries import Outcome
from broker.core.queues import Subscription
from broker.core.transactions import (TooManyTransactions, TransactionRollback, TransactionTable,
                                      UnknownTransaction)


class GroupStore:
    """Records store calls; inside begin_group/end_group they are collected as one group."""

    def __init__(self):
        self.ops = []          # ("add", q, mid) ... or ("group", [ops])
        self.live = {}
        self._group = None

    def _op(self, op):
        (self._group if self._group is not None else self.ops).append(op)

    def add(self, queue, msg):
        self._op(("add", queue, msg.mid))
        self.live[(queue, msg.mid)] = msg.body

    def remove(self, queue, msg):
        self._op(("remove", queue, msg.mid))
        self.live.pop((queue, msg.mid))

    def delivery_count_changed(self, queue, msg):
        self._op(("count", queue, msg.mid, msg.delivery_count))

    def queue_created(self, d):
        self.ops.append(("queue", d["name"]))

    def queue_deleted(self, name):
        self.ops.append(("unqueue", name))

    def begin_group(self):
        assert self._group is None
        self._group = []

    def end_group(self):
        ops, self._group = self._group, None
        if ops:
            self.ops.append(("group", ops))
        return bool(ops)

    def groups(self):
        return [op[1] for op in self.ops if op[0] == "group"]


class Sink:
    def __init__(self, credit=0):
        self.got = []
        self.sub = Subscription(self.deliver)
        self.sub.credit = credit

    def deliver(self, sub, msg):
        self.got.append(msg)


def durable(body: str) -> bytes:
    return body.encode()


def make(**settings):
    store = GroupStore()
    b = Broker(SettingsResolver(AddressSettings(**settings)), store)
    b.declare_address("q", [ANYCAST])
    store.ops.clear()
    return b, store


def test_sends_are_held_until_commit_then_routed_in_one_group():
    b, store = make()
    table = TransactionTable("c1")
    txn = table.declare()
    assert txn.txn_id == b"c1:1"
    for i in range(3):
        txn.publish("q", f"m{i}".encode(), True)
    txn.publish("q", b"volatile", False)
    q = b.queues["q"]
    assert q.depth == 0 and store.ops == []          # nothing routed, nothing written
    done = table.discharge(txn.txn_id, False, b)
    assert done.committed and done.stored and done.published == 4 and done.error is None
    assert [m.body for m in q.messages] == [b"m0", b"m1", b"m2", b"volatile"]
    (group,) = store.groups()
    assert [op[0] for op in group] == ["add", "add", "add"]   # the non-durable one is not written
    assert len(table) == 0 and table.committed == 1


def test_rollback_drops_sends_and_writes_nothing():
    b, store = make()
    table = TransactionTable("c1")
    txn = table.declare()
    txn.publish("q", b"m", True)
    done = table.discharge(txn.txn_id, True, b)
    assert not done.committed and not done.stored
    assert b.queues["q"].depth == 0 and store.ops == []
    with pytest.raises(UnknownTransaction):       # discharged: gone
        table.discharge(txn.txn_id, False, b)


def test_commit_without_durable_work_writes_no_group():
    b, store = make()
    table = TransactionTable("c1")
    txn = table.declare()
    txn.publish("q", b"v", False)
    assert table.discharge(txn.txn_id, False, b).stored is False and store.ops == []


def deliver_three(b):
    for i in range(3):
        b.publish("q", f"m{i}".encode(), True)
    q = b.queues["q"]
    s = Sink(credit=3)
    q.add_subscription(s.sub)
    return q, s


def test_transactional_acks_hold_messages_until_commit():
    b, store = make()
    q, s = deliver_three(b)
    store.ops.clear()
    table = TransactionTable("c1")
    txn = table.declare()
    for m in s.got:
        assert txn.acknowledge(q, s.sub, m.mid, Outcome.ACCEPTED, token=("d", m.mid))
    assert not txn.acknowledge(q, s.sub, s.got[0].mid, Outcome.ACCEPTED)   # held already
    assert q.depth == 3 and q.held == 3 and not s.sub.unacked and store.ops == []
    # the consumer goes away: held messages are not returned to the queue
    q.remove_subscription(s.sub)
    assert list(q.messages) == [] and q.depth == 3
    done = table.discharge(txn.txn_id, False, b)
    assert done.committed and done.acknowledged == 3 and done.tokens == [("d", m.mid) for m in s.got]
    assert q.depth == 0 and q.acked == 3 and store.live == {}
    (group,) = store.groups()
    assert group == [("remove", "q", m.mid) for m in s.got]


def test_rollback_returns_acks_in_original_order_with_one_more_attempt():
    b, store = make(max_delivery_count=5)
    q, s = deliver_three(b)
    other = Sink(credit=0)
    q.add_subscription(other.sub)
    b.publish("q", b"m3", True)                   # waiting behind them
    store.ops.clear()
    table = TransactionTable("c1")
    txn = table.declare()
    for m in reversed(s.got):                     # settled in any order
        txn.acknowledge(q, s.sub, m.mid, Outcome.ACCEPTED)
    done = table.discharge(txn.txn_id, True, b)
    assert not done.committed and len(done.tokens) == 3
    assert [m.body for m in q.messages] == [b"m0", b"m1", b"m2", b"m3"]
    assert [m.delivery_count for m in q.messages] == [1, 1, 1, 0]
    assert q.held == 0 and q.depth == 4 and q.acked == 0
    assert store.ops == [("count", "q", m.mid, 1) for m in s.got]
    other.sub.credit = 10
    q.dispatch()
    assert [m.body for m in other.got] == [b"m0", b"m1", b"m2", b"m3"]


def test_rollback_past_max_delivery_count_dead_letters():
    b, store = make(max_delivery_count=1, dead_letter_address="DLQ")
    q, s = deliver_three(b)
    table = TransactionTable("c1")
    txn = table.declare()
    txn.acknowledge(q, s.sub, s.got[0].mid, Outcome.ACCEPTED)
    table.discharge(txn.txn_id, True, b)
    assert q.dead_lettered == 1 and [m.body for m in b.queues["DLQ"].messages] == [b"m0"]


@pytest.mark.parametrize("outcome,kw,where,count", [
    (Outcome.REJECTED, {}, "DLQ", 0),
    (Outcome.RELEASED, {}, "q", 0),
    (Outcome.MODIFIED, {"delivery_failed": True}, "q", 1),
])
def test_other_outcomes_apply_at_commit(outcome, kw, where, count):
    b, store = make(dead_letter_address="DLQ")
    q, s = deliver_three(b)
    table = TransactionTable("c1")
    txn = table.declare()
    m = s.got[0]
    txn.acknowledge(q, s.sub, m.mid, outcome, **kw)
    assert all(x.body != b"m0" for x in q.messages)
    table.discharge(txn.txn_id, False, b)
    target = b.queues[where]
    assert [x.body for x in target.messages][:1] == [b"m0"] and target.messages[0].delivery_count == count


def test_sends_and_acks_commit_as_one_group():
    """Consume-transform-produce: the ack of the input and the output message land together."""
    b, store = make()
    b.declare_address("out", [ANYCAST])
    q, s = deliver_three(b)
    store.ops.clear()
    table = TransactionTable("c1")
    txn = table.declare()
    txn.acknowledge(q, s.sub, s.got[0].mid, Outcome.ACCEPTED)
    txn.publish("out", b"result", True)
    table.discharge(txn.txn_id, False, b)
    (group,) = store.groups()
    assert sorted(op[0] for op in group) == ["add", "remove"] and len(store.ops) == 1


def test_multicast_commit_reaches_every_subscriber_queue_present_at_commit():
    b, store = make()
    b.declare_address("t", [MULTICAST])
    table = TransactionTable("c1")
    txn = table.declare()
    txn.publish("t", b"x", True)
    q1 = b.subscription_queue("t", "c.s1", durable=True)
    q2 = b.subscription_queue("t", "c.s2", durable=True)
    table.discharge(txn.txn_id, False, b)
    assert [m.body for m in q1.messages] == [b"x"] == [m.body for m in q2.messages]
    (group,) = store.groups()
    assert {op[1] for op in group} == {"c.s1", "c.s2"}


def test_rollback_only_transaction_fails_its_commit():
    b, store = make()
    table = TransactionTable("c1")
    txn = table.declare()
    txn.publish("q", b"m", True)
    txn.mark_rollback_only("a send was refused")
    done = table.discharge(txn.txn_id, False, b)
    assert not done.committed and isinstance(done.error, TransactionRollback)
    assert done.error.condition == "amqp:transaction:rollback" and b.queues["q"].depth == 0


def test_limit_and_unknown_ids():
    table = TransactionTable("c1", limit=2)
    a, _ = table.declare(), table.declare()
    with pytest.raises(TooManyTransactions) as exc:
        table.declare()
    assert exc.value.condition == "amqp:resource-limit-exceeded"
    with pytest.raises(UnknownTransaction) as exc:
        table.get(b"c1:99")
    assert exc.value.condition == "amqp:transaction:unknown-id"
    with pytest.raises(UnknownTransaction):
        table.get(None)
    assert table.get(memoryview(a.txn_id)) is a       # proton hands binaries as memoryview
    b, _store = make()
    table.discharge(a.txn_id, True, b)
    table.declare()                                  # room again


def test_rollback_all_and_by_owner():
    b, store = make()
    q, s = deliver_three(b)
    table = TransactionTable("c1")
    t1 = table.declare(owner="link1")
    t2 = table.declare(owner="link2")
    t1.acknowledge(q, s.sub, s.got[0].mid, Outcome.ACCEPTED)
    t2.acknowledge(q, s.sub, s.got[1].mid, Outcome.ACCEPTED)
    t2.publish("q", b"never", True)
    (d1,) = table.rollback_where("link1")
    assert d1.txn_id == t1.txn_id and list(table.open) == [t2.txn_id]
    assert [m.body for m in q.messages] == [b"m0"]
    (d2,) = table.rollback_all()
    assert not d2.committed and len(table) == 0
    # each rollback returns its messages to their original place in the queue (the broker's
    # ordering rule: whatever order returns happen in, the queue keeps its original order)
    assert [m.body for m in q.messages] == [b"m0", b"m1"] and q.held == 0


def test_queue_deleted_while_held():
    b, store = make()
    b.declare_address("t", [MULTICAST])
    q = b.subscription_queue("t", "c.s1", durable=True)
    b.publish("t", b"x", True)
    s = Sink(credit=1)
    q.add_subscription(s.sub)
    table = TransactionTable("c1")
    txn = table.declare()
    txn.acknowledge(q, s.sub, s.got[0].mid, Outcome.ACCEPTED)
    q.remove_subscription(s.sub)
    b.delete_queue("c.s1")
    table.discharge(txn.txn_id, True, b)
    assert store.live == {}              # the held message's record went with its queue


def test_a_committed_send_keeps_its_priority_and_expiry_in_the_journal(tmp_path):
    """A transactional send's GROUP record carries what recovery cannot read from the body."""
    from broker.node import JournalStore
    from broker.store.journal import Journal, JournalConfig

    j = Journal.open(tmp_path / "j", JournalConfig(sync="never"))
    b = Broker(store=JournalStore(j, lambda: None))
    b.declare_address("q", [ANYCAST])
    table = TransactionTable("c1")
    txn = table.declare()
    txn.publish("q", b"urgent", True, priority=9, expires=123456.0)
    table.discharge(txn.txn_id, False, b)
    j.flush()
    (stored,) = j.messages("q")
    assert stored.properties == {"expires": 123456.0, "priority": 9}
    j.close()


def _mirror_ack(q, mid, seen):
    """What a mirror target does with an acknowledgement from the other site (see
    broker.connections.mirror.MirrorTarget._hold): wait for the holder, acknowledge if it comes back."""
    def done(msg, returned):
        seen.append((msg.mid, returned))
        if returned:
            q.acknowledge(msg)
    return q.hold_ack(mid, done)


def _acked_in_a_transaction_then_mirrored():
    """Three delivered; the first accepted inside an open transaction, then acknowledged by a
    mirror (which must wait: the transaction holds it)."""
    b, store = make()
    q, s = deliver_three(b)
    table = TransactionTable("c1")
    txn = table.declare()
    first = s.got[0]
    txn.acknowledge(q, s.sub, first.mid, Outcome.ACCEPTED)    # settled in the transaction only
    seen = []
    assert _mirror_ack(q, first.mid, seen)       # held by the transaction: the ack waits
    return b, store, q, table, txn, first, seen


def test_a_mirrored_ack_for_a_message_held_by_an_open_transaction_waits_for_its_rollback():
    b, store, q, table, txn, first, seen = _acked_in_a_transaction_then_mirrored()
    table.discharge(txn.txn_id, True, b)         # rolled back: the message comes back...
    assert seen == [(first.mid, True)]           # ...and the mirrored ack takes it instead
    assert [m.mid for m in q.messages] == [] and q.acked == 1 and q.held == 0
    assert ("q", first.mid) not in store.live    # its removal was written


def test_a_mirrored_ack_for_a_message_held_by_a_transaction_that_commits_is_moot():
    b, store, q, table, txn, first, seen = _acked_in_a_transaction_then_mirrored()
    table.discharge(txn.txn_id, False, b)
    assert seen == [(first.mid, False)] and q.acked == 1 and q.held == 0 and q.depth == 2
    assert not _mirror_ack(q, 999_999, seen)     # a message nobody holds: not held
