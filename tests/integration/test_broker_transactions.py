"""AMQP 1.0 local transactions against a real broker process, with unmodified proton clients."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from proton import Delivery, Endpoint, Message, Terminus, symbol
from proton.reactor import LinkOption
from proton.utils import BlockingConnection, LinkDetached

from tests.brokerproc import REPO, start_broker, write_users_file
from tests.txnclient import TXN_STATE, TxClient
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "tests" / "e2e" / "examples" / "proton"
USERS = {"admin": ("admin", ["admin"]), "app": ("app", ["app"])}
PERMISSIONS = [
    {"match": "#", "send": ["admin", "app"], "consume": ["admin", "app"], "create-address": ["admin", "app"],
     "delete-address": ["admin"], "manage": ["admin"]},
    {"match": "secret.#", "send": ["admin"], "consume": ["admin"], "create-address": ["admin"]},
]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("txn")
    users = write_users_file(tmp / "users.toml", USERS, permissions=PERMISSIONS)
    b = start_broker(tmp, users_file=users)
    yield b
    assert b.terminate() == 0, b.stderr_text()


def url(b) -> str:
    return b.amqp_url.replace("amqp://", "amqp://app:app@")


def depth(b, name) -> int:
    q = b.queue(name)
    return q["depth"] if q else 0


def drain(b, address, idle_s=0.5) -> list:
    c = BlockingConnection(url(b), timeout=10, allowed_mechs="PLAIN")
    r = c.create_receiver(address, credit=100)
    out = []
    while True:
        try:
            m = r.receive(timeout=idle_s)
        except Exception:  # proton.Timeout: nothing more
            break
        r.accept()
        out.append(m)
    c.close()
    return out


def fill(b, address, bodies) -> None:
    c = BlockingConnection(url(b), timeout=10, allowed_mechs="PLAIN")
    s = c.create_sender(address)
    for body in bodies:
        s.send(Message(body=body, durable=True))
    c.close()


# -- the proton example programs, unmodified ----------------------------------------------------

def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=60)


def test_proton_tx_send_then_tx_recv_examples(broker):
    address = f"{url(broker)}/examples"
    sent = run_example("tx_send.py", "-a", address, "-m", "35", "-b", "7")
    assert sent.returncode == 0, sent.stderr
    assert sent.stdout.splitlines() == ["all messages committed"]
    assert depth(broker, "examples") == 35
    got = run_example("tx_recv.py", "-a", address, "-m", "35", "-b", "7")
    assert got.returncode == 0, got.stderr
    # what proton's own test_examples.py expects of tx_recv.py
    assert got.stdout.splitlines() == ["{'sequence': %i}" % (i + 1) for i in range(35)]
    q = broker.queue("examples")
    assert q["depth"] == 0 and q["acked"] == 35


# -- sends ----------------------------------------------------------------------------------------

def test_transactional_sends_commit_delivers_all(broker):
    c = TxClient(url(broker))
    s = c.bc.create_sender("tx.commit")
    t = c.declare()
    for i in range(5):
        d = c.send(t, s, Message(body=f"m{i}", durable=True))
        assert d.remote_state == TXN_STATE
        assert bytes(d.remote.data[0]) == bytes(t.handle.id)     # TransactionalState(txn-id, accepted)
        assert int(d.remote.data[1].descriptor) == 0x24
    assert depth(broker, "tx.commit") == 0                        # held until the commit
    c.commit(t)
    assert t.committed and not t.commit_failed
    c.close()
    assert [m.body for m in drain(broker, "tx.commit")] == [f"m{i}" for i in range(5)]


def test_transactional_sends_rollback_leaves_nothing(broker):
    c = TxClient(url(broker))
    s = c.bc.create_sender("tx.rollback")
    t = c.declare()
    for i in range(5):
        c.send(t, s, Message(body=f"m{i}", durable=True))
    c.abort(t)
    assert t.aborted
    s.send(Message(body="outside"))                              # not in a transaction
    c.close()
    assert depth(broker, "tx.rollback") == 1
    assert [m.body for m in drain(broker, "tx.rollback")] == ["outside"]


def test_two_transactions_on_one_connection_are_independent(broker):
    c = TxClient(url(broker))
    s = c.bc.create_sender("tx.two")
    t1, t2 = c.declare(), c.declare()
    assert bytes(t1.handle.id) != bytes(t2.handle.id)
    c.send(t1, s, Message(body="one"))
    c.send(t2, s, Message(body="two"))
    c.abort(t1)
    c.commit(t2)
    c.close()
    assert [m.body for m in drain(broker, "tx.two")] == ["two"]


# -- acknowledgements ----------------------------------------------------------------------------

def test_transactional_acks_committed_remove_the_messages(broker):
    fill(broker, "tx.acks", [f"a{i}" for i in range(4)])
    c = TxClient(url(broker))
    r = c.bc.create_receiver("tx.acks", credit=4)
    t = c.declare()
    for i in range(3):
        m, d = c.receive(r)
        assert m.body == f"a{i}"
        t.handle.accept(d)
    wait_for(lambda: depth(broker, "tx.acks") == 4)             # still acquired until the commit
    c.commit(t)
    assert t.committed
    c.close()
    assert depth(broker, "tx.acks") == 1
    assert [m.body for m in drain(broker, "tx.acks")] == ["a3"]


def test_transactional_acks_rolled_back_return_in_order(broker):
    fill(broker, "tx.back", [f"b{i}" for i in range(3)])
    c = TxClient(url(broker))
    r = c.bc.create_receiver("tx.back", credit=3)
    t = c.declare()
    for _ in range(3):
        _, d = c.receive(r)
        t.handle.accept(d)
    r.close()                 # (an open receiver with credit would get them again at once)
    c.abort(t)
    assert t.aborted
    c.close()
    got = drain(broker, "tx.back")
    assert [m.body for m in got] == ["b0", "b1", "b2"]
    # a rolled-back acknowledgement counts as a failed attempt, as in Artemis
    assert [m.delivery_count for m in got] == [1, 1, 1]


def test_acks_settled_before_the_discharge_roll_back_in_order(broker):
    fill(broker, "tx.presettled", ["p0", "p1", "p2"])
    c = TxClient(url(broker))
    r = c.bc.create_receiver("tx.presettled", credit=3)
    t = c.declare(settle_before_discharge=True)          # the client settles its acks at once
    for _ in range(3):
        _, d = c.receive(r)
        t.handle.accept(d)
    r.close()
    wait_for(lambda: depth(broker, "tx.presettled") == 3)
    c.abort(t)
    c.close()
    got = drain(broker, "tx.presettled")
    assert [m.body for m in got] == ["p0", "p1", "p2"] and [m.delivery_count for m in got] == [1, 1, 1]


def test_coordinator_link_detach_rolls_back_its_transactions(broker):
    fill(broker, "tx.coord.in", ["c0"])
    c = TxClient(url(broker))
    r = c.bc.create_receiver("tx.coord.in", credit=1)
    s = c.bc.create_sender("tx.coord.out")
    t = c.declare()
    _, d = c.receive(r)
    t.handle.accept(d)
    c.send(t, s, Message(body="never"))
    r.close()
    ctrl = c.bc.conn._txn_ctrl                         # proton's coordinator link
    ctrl.close()
    c.bc.wait(lambda: ctrl.state & Endpoint.REMOTE_CLOSED)
    got = wait_for(lambda: drain(broker, "tx.coord.in") or None)
    assert [m.body for m in got] == ["c0"]
    assert depth(broker, "tx.coord.out") == 0
    c.close()


def test_session_end_rolls_back_the_transactions_of_its_coordinator(broker):
    from tests.txnclient import Txn
    fill(broker, "tx.session.in", ["s0"])
    c = TxClient(url(broker))
    r = c.bc.create_receiver("tx.session.in", credit=1)
    other = c.bc.conn.session()
    other.open()
    t = Txn()
    t.handle = c.bc.container.declare_transaction(other, handler=t)   # coordinator on `other`
    c.bc.wait(lambda: t.declared)
    _, d = c.receive(r)
    t.handle.accept(d)
    r.close()
    wait_for(lambda: depth(broker, "tx.session.in") == 1)
    other.close()
    c.bc.wait(lambda: other.state & Endpoint.REMOTE_CLOSED)
    got = wait_for(lambda: drain(broker, "tx.session.in") or None)
    assert [m.body for m in got] == ["s0"] and got[0].delivery_count == 1
    c.close()


def test_acked_messages_stay_with_the_transaction_when_the_consumer_detaches(broker):
    fill(broker, "tx.detach", ["x", "y"])
    c = TxClient(url(broker))
    r = c.bc.create_receiver("tx.detach", credit=2)
    t = c.declare()
    _, d = c.receive(r)
    t.handle.accept(d)
    c.receive(r)                                  # "y" unsettled, outside the transaction
    r.close()
    # "y" is back in the queue, "x" is held by the transaction: nobody else gets it
    assert [m.body for m in drain(broker, "tx.detach")] == ["y"]
    assert depth(broker, "tx.detach") == 1
    c.commit(t)
    c.close()
    assert depth(broker, "tx.detach") == 0


def test_consume_transform_produce_in_one_transaction(broker):
    fill(broker, "tx.in", ["job"])
    c = TxClient(url(broker))
    r = c.bc.create_receiver("tx.in", credit=1)
    s = c.bc.create_sender("tx.out")
    t = c.declare()
    m, d = c.receive(r)
    t.handle.accept(d)
    c.send(t, s, Message(body=m.body + " done", durable=True))
    c.commit(t)
    c.close()
    assert depth(broker, "tx.in") == 0
    assert [m.body for m in drain(broker, "tx.out")] == ["job done"]


# -- errors ---------------------------------------------------------------------------------------

def test_unknown_txn_id(broker):
    c = TxClient(url(broker))
    s = c.bc.create_sender("tx.unknown")
    t = c.declare()
    real = t.handle.id
    t.handle.id = b"no-such-txn"
    d = t.handle.send(s.link, Message(body="lost"))
    c.bc.wait(lambda: d.remote_state != 0)
    assert d.remote_state == Delivery.REJECTED
    assert d.remote.condition.name == "amqp:transaction:unknown-id"
    c.commit(t)
    assert t.commit_failed is not None and t.commit_failed.name == "amqp:transaction:unknown-id"
    t.handle.id = real                             # the real one is still open and usable
    t.commit_failed = None
    c.commit(t)
    assert t.committed
    c.close()
    assert depth(broker, "tx.unknown") == 0


def test_refused_send_makes_the_commit_fail_with_rollback(broker):
    c = TxClient(url(broker))
    relay = c.bc.create_sender(None)             # anonymous relay
    t = c.declare()
    ok = c.send(t, relay, Message(address="tx.relay", body="fine"))
    assert ok.remote_state == TXN_STATE
    bad = c.send(t, relay, Message(address="secret.place", body="forbidden"))
    assert bad.remote_state == Delivery.REJECTED and bad.remote.condition.name == "amqp:unauthorized-access"
    c.commit(t)
    assert t.commit_failed is not None and t.commit_failed.name == "amqp:transaction:rollback"
    c.close()
    assert depth(broker, "tx.relay") == 0


def test_transaction_limit_per_connection(broker):
    c = TxClient(url(broker))
    txns = [c.declare() for _ in range(16)]
    assert all(t.declared for t in txns)
    extra = c.declare()
    assert not extra.declared and extra.declare_failed.name == "amqp:resource-limit-exceeded"
    assert "max-transactions 16 reached" in extra.declare_failed.description
    _, text = broker.management_get("/metrics")
    assert re.search(r'^lodestone_broker_resource_limit_exceeded_total\{limit="max-transactions"\} [1-9]', text, re.M)
    c.abort(txns[0])
    assert c.declare().declared                    # room again
    c.close()


class _Coordinator(LinkOption):
    def __init__(self, capability: str):
        self.capability = capability

    def apply(self, link):
        link.target.type = Terminus.COORDINATOR
        link.target.capabilities.put_object(symbol(self.capability))


def test_coordinator_offers_local_transactions_and_refuses_distributed(broker):
    c = BlockingConnection(url(broker), timeout=10, allowed_mechs="PLAIN")
    ok = c.container.create_sender(c.conn, None, name="coord-ok", options=_Coordinator("amqp:local-transactions"))
    c.wait(lambda: ok.state & Endpoint.REMOTE_ACTIVE)
    caps = ok.remote_target.capabilities
    caps.rewind()
    caps.next()
    assert "amqp:local-transactions" in [str(x) for x in caps.get_object()]
    bad = c.container.create_sender(c.conn, None, name="coord-bad",
                                    options=_Coordinator("amqp:distributed-transactions"))
    with pytest.raises(LinkDetached) as exc:
        c.wait(lambda: bad.state & Endpoint.REMOTE_CLOSED)
    assert bad.remote_condition.name == "amqp:not-implemented"
    c.close()


# -- ending -----------------------------------------------------------------------------------------

CLIENT = r"""
import sys, time
sys.path.insert(0, {repo!r})
from proton import Message
from tests.txnclient import TxClient
c = TxClient({url!r})
r = c.bc.create_receiver("tx.drop.in", credit=2)
s = c.bc.create_sender("tx.drop.out")
t = c.declare()
for _ in range(2):
    m, d = c.receive(r)
    t.handle.accept(d)
for i in range(3):
    c.send(t, s, Message(body="never %d" % i, durable=True))
print("ready", flush=True)
time.sleep(60)  # the thing under test: the transaction stays open until the test drops the connection
"""


@pytest.mark.parametrize("how", ["kill", "close-session"])
def test_connection_dropped_mid_transaction_rolls_back(broker, how):
    fill(broker, "tx.drop.in", ["d0", "d1"])
    if how == "kill":
        with subprocess.Popen([sys.executable, "-c", CLIENT.format(repo=str(REPO), url=url(broker))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
            try:
                assert p.stdout.readline().strip() == "ready", p.stderr.read()
                wait_for(lambda: depth(broker, "tx.drop.in") == 2)
            finally:
                p.kill()                               # no Close, no End: the socket just goes
                p.wait()
    else:
        c = TxClient(url(broker))
        r = c.bc.create_receiver("tx.drop.in", credit=2)
        s = c.bc.create_sender("tx.drop.out")
        t = c.declare()
        for _ in range(2):
            _, d = c.receive(r)
            t.handle.accept(d)
        c.send(t, s, Message(body="never"))
        c.close()                                     # closes with the transaction open
    got = wait_for(lambda: drain(broker, "tx.drop.in") or None)
    assert [m.body for m in got] == ["d0", "d1"] and all(m.delivery_count == 1 for m in got)
    assert depth(broker, "tx.drop.out") == 0
