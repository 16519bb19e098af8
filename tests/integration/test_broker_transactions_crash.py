"""Transactions survive ``kill -9`` exactly: a committed transaction is all there, an
uncommitted one leaves no trace (the commit is one journal GROUP record, answered after its fsync)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import REPO, start_broker
from tests.integration.test_broker_durability import journal_synced
from tests.txnclient import TxClient
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


def url(b) -> str:
    return b.amqp_url.replace("amqp://", "amqp://app:app@")


def fill(b, address, n) -> None:
    c = BlockingConnection(url(b), timeout=10, allowed_mechs="PLAIN")
    s = c.create_sender(address)
    for i in range(n):
        s.send(Message(body=f"in-{i}", durable=True))    # blocks until accepted (after the fsync)
    c.close()


def drain(b, address, idle_s=1.0) -> list:
    c = BlockingConnection(url(b), timeout=10, allowed_mechs="PLAIN")
    r = c.create_receiver(address, credit=500)
    out = []
    while True:
        try:
            m = r.receive(timeout=idle_s)
        except Exception:  # proton.Timeout: the queue is empty
            break
        r.accept()
        out.append(m.body)
    c.close()
    return out


def open_work(b, n_send: int, n_ack: int):
    """A transaction holding ``n_send`` durable sends to ``out`` and ``n_ack`` acks from ``in``."""
    c = TxClient(url(b))
    r = c.bc.create_receiver("in", credit=n_ack)
    s = c.bc.create_sender("out")
    t = c.declare()
    for _ in range(n_ack):
        _, d = c.receive(r)
        t.handle.accept(d)
    for i in range(n_send):
        c.send(t, s, Message(body=f"out-{i}", durable=True))
    return c, t


@pytest.mark.parametrize("round_", range(3))
def test_kill9_before_the_commit_leaves_no_trace(tmp_path, round_):
    n_in, n_send, n_ack = 20, 15 + round_ * 10, 5 + round_ * 3
    b = start_broker(tmp_path)
    try:
        fill(b, "in", n_in)
        c, t = open_work(b, n_send, n_ack)
        wait_for(lambda: b.queue("in")["depth"] == n_in)      # held by the transaction
        wait_for(lambda: journal_synced(b))                   # whatever was written is on disk
        b.kill()
        try:
            c.close()
        except Exception:  # the broker is gone
            pass
        b.restart()
        assert b.queue("in")["depth"] == n_in
        assert (b.queue("out") or {"depth": 0})["depth"] == 0
        assert drain(b, "in") == [f"in-{i}" for i in range(n_in)]
        assert drain(b, "out") == []
    finally:
        b.kill()


@pytest.mark.parametrize("round_", range(3))
def test_kill9_right_after_the_commit_is_acknowledged_keeps_all_of_it(tmp_path, round_):
    n_in, n_send, n_ack = 20, 15 + round_ * 10, 5 + round_ * 3
    b = start_broker(tmp_path)
    try:
        fill(b, "in", n_in)
        c, t = open_work(b, n_send, n_ack)
        c.commit(t)
        assert t.committed
        b.kill()                                              # no waiting: the accept meant durable
        try:
            c.close()
        except Exception:
            pass
        b.restart()
        assert b.queue("out")["depth"] == n_send
        assert b.queue("in")["depth"] == n_in - n_ack
        assert drain(b, "out") == [f"out-{i}" for i in range(n_send)]
        assert drain(b, "in") == [f"in-{i}" for i in range(n_ack, n_in)]
    finally:
        b.kill()


BATCHER = r"""
import sys
sys.path.insert(0, {repo!r})
from proton import Message
from tests.txnclient import TxClient
c = TxClient({url!r})
s = c.bc.create_sender("batches")
batch = 0
while True:
    t = c.declare()
    for i in range(10):
        c.send(t, s, Message(body="b%d-%d" % (batch, i), durable=True))
    c.commit(t)
    assert t.committed
    print("committed", batch, flush=True)
    batch += 1
"""


@pytest.mark.parametrize("kill_after", [3, 17, 40])
def test_kill9_mid_stream_of_commits_keeps_whole_batches(tmp_path, kill_after):
    """Batches of 10 committed back to back; kill -9 at some point: every acknowledged batch is
    there, whole; at most the one in flight is there too (whole); nothing else, in order."""
    b = start_broker(tmp_path)
    acked = []
    try:
        with subprocess.Popen([sys.executable, "-c", BATCHER.format(repo=str(REPO), url=url(b))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
            try:
                for line in p.stdout:
                    acked.append(int(line.split()[1]))
                    if len(acked) >= kill_after:
                        b.kill()
                        break
                p.wait(timeout=30)             # the client fails once the broker is gone
            finally:
                p.kill()
                p.wait()
        b.restart()
        bodies = drain(b, "batches")
        batches: dict[int, list[int]] = {}
        for body in bodies:
            n, i = body[1:].split("-")
            batches.setdefault(int(n), []).append(int(i))
        assert all(v == list(range(10)) for v in batches.values()), "a batch came back partly"
        got = sorted(batches)
        assert got == list(range(len(got))), "batches in order, none missing in the middle"
        assert set(acked) <= set(got), "an acknowledged commit was lost"
        assert len(got) <= len(acked) + 1
        assert bodies == [f"b{n}-{i}" for n in got for i in range(10)]
    finally:
        b.kill()
