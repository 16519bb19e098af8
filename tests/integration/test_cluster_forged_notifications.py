"""Forged and garbage binding notifications on a real cluster link (issue 10).

Node A is a real broker process whose static connector is a *fake peer* written here. A dials it
as it dials any node (TCP, SASL PLAIN with the cluster credential, AMQP Open carrying the
peer's ``node-id``), attaches its receiver on ``$lodestone.cluster.notifications`` and its
sender on ``$lodestone.cluster.forward``, and believes what arrives on the first. The fake lies:

* a **forged binding** — distance 0 (so "my own queue") but another node's id: A must cut that
  connection off with ``amqp:invalid-field``, log it, count it, and learn nothing from it — not
  the forged binding, nor anything the fake says after it on that connection;
* **garbage** instead of a notification: cut off with ``amqp:decode-error``.

A reconnects (it cannot tell a liar from a node that had a bad moment) and is cut off again,
over and over, while a second real node B, joined to A, keeps receiving every message A
forwards to B's consumer. Last, the fake turns honest and A learns its binding: the checks
above could fail.

The fake peer is python-qpid-proton's protocol engine (``Transport``/``Connection``/
``Collector``) on a plain socket in a thread. Proton's built-in SASL server offers only
ANONYMOUS and EXTERNAL (PLAIN needs Cyrus), and A logs in with PLAIN, so the SASL exchange in
front of it is the repo's sans-IO :class:`broker.wire.sasl.SaslServer`; everything after the
SASL outcome is proton's.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
from proton import Collector, Connection, Delivery, Event, Message, Timeout, Transport, symbol

from broker.wire.frames import NEED_DATA
from broker.wire.sasl import AmqpHeaderReceived, AuthRequested, SaslServer
from broker.wire.cluster import NOTIFY_ADDRESS, BindingNote, Hello, Reset, encode_note
from tests.clusterproc import (CLUSTER_PASSWORD, cluster_view, connect, known_bindings, start_node,
                               wait_known_consumers, wait_mesh, wait_until)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

FAKE_ID = "fake-node-0000"
FORGED_ID = "node-that-never-spoke"
GARBAGE = b"\x00\x53\x77not a notification at all"


@dataclass
class FakeConnection:
    """What one connection from A looked like to the fake."""

    index: int
    mode: str
    login: bytes | None = None
    sent: int = 0
    outcomes: dict = field(default_factory=dict)   # delivery tag ("n0", "n1", ...) -> A's outcome
    close: tuple[str, str] | None = None           # A's Close: (condition, description)


class FakePeer:
    """A cluster peer that says what its ``script`` says (see the module docstring).

    ``mode`` is read when a connection opens: ``"lie"`` alternates a forged binding and garbage,
    one per connection; ``"honest"`` sends what a real node would (hello, reset, its binding).
    """

    def __init__(self):
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.listener.settimeout(0.05)
        self.url = "amqp://127.0.0.1:%d" % self.listener.getsockname()[1]
        self.mode = "lie"
        self.connections: list[FakeConnection] = []
        self._lies = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def stop(self) -> None:
        self._stop.set()
        for t in list(self._threads):
            t.join(5)
        self.listener.close()

    # -- what it says ----------------------------------------------------------------------
    def hello(self) -> bytes:
        return encode_note(Hello(FAKE_ID, "test-cluster", self.url, "", 1, ()))

    def script(self) -> tuple[str, list[bytes]]:
        head = [self.hello(), encode_note(Reset())]
        # a binding of the fake's own queue, fine on its own: said after a lie, it must not count
        after = encode_note(BindingNote(FAKE_ID, "said-after-the-lie", "orders", "anycast", None, 1, (), 0))
        if self.mode == "honest":
            return "honest", head + [encode_note(BindingNote(FAKE_ID, "fake-q", "fake-address", "anycast", None,
                                                             1, (), 0))]
        self._lies += 1
        if self._lies % 2:
            # distance 0 means "my own queue", but the node id is not the fake's
            forged = encode_note(BindingNote(FORGED_ID, "stolen", "orders", "anycast", None, 5, (), 0))
            return "forged", head + [forged, after]
        return "garbage", head + [GARBAGE, after]

    def closes(self, condition: str) -> int:
        return sum(1 for c in self.connections if c.close is not None and c.close[0] == condition)

    # -- the socket side -------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            t = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            with sock:
                login = self._login(sock)
                if login is not None:
                    self._amqp(sock, *login)
        except OSError:
            pass

    def _recv(self, sock: socket.socket) -> bytes | None:
        """Bytes from A; b"" at EOF; None if nothing came within a tick."""
        if not select.select([sock], [], [], 0.05)[0]:
            return None
        return sock.recv(65536)

    def _login(self, sock: socket.socket) -> tuple[bytes, bytes | None] | None:
        """SASL PLAIN, accepting any credential; returns (bytes after it, A's initial response)."""
        sasl = SaslServer(["PLAIN"])
        response = None
        while not self._stop.is_set():
            ev = sasl.next_event()
            out = sasl.data_to_send()
            if out:
                sock.sendall(out)
            if ev is NEED_DATA:
                data = self._recv(sock)
                if data == b"":
                    return None
                if data:
                    sasl.receive_data(data)
            elif isinstance(ev, AuthRequested):
                response = ev.initial_response
                sasl.accept("cluster-user")
            elif isinstance(ev, AmqpHeaderReceived):
                return sasl.leftover(), response
        return None

    def _amqp(self, sock: socket.socket, leftover: bytes, login: bytes | None) -> None:
        mode, payloads = self.script()
        rec = FakeConnection(len(self.connections), mode, login=login)
        self.connections.append(rec)
        transport = Transport(Transport.SERVER)
        conn = Connection()
        collector = Collector()
        conn.collect(collector)
        transport.bind(conn)
        conn.container = "fake-peer"
        conn.properties = {symbol("node-id"): FAKE_ID}
        transport.push(leftover)
        notify = None
        while not self._stop.is_set():
            while (ev := collector.peek()) is not None:
                t = ev.type
                if t == Event.CONNECTION_REMOTE_OPEN:
                    conn.open()
                elif t == Event.SESSION_REMOTE_OPEN:
                    ev.session.open()
                elif t == Event.LINK_REMOTE_OPEN:
                    link = ev.link
                    link.source.copy(link.remote_source)
                    link.target.copy(link.remote_target)
                    link.open()
                    if link.is_sender and link.remote_source.address == NOTIFY_ADDRESS:
                        notify = link
                    elif link.is_receiver:
                        link.flow(100)  # A's forward link: nothing should come (no binding of ours)
                elif t == Event.DELIVERY:
                    d = ev.delivery
                    if d.link.is_sender:
                        if d.remote_state:
                            tag = d.tag.decode() if isinstance(d.tag, bytes) else d.tag
                            rec.outcomes[tag] = d.remote_state
                    else:  # a forwarded message (only once honest): take it
                        d.link.recv(d.pending)
                        d.link.advance()
                        d.update(Delivery.ACCEPTED)
                        d.settle()
                elif t == Event.CONNECTION_REMOTE_CLOSE:
                    c = conn.remote_condition
                    rec.close = (c.name, c.description) if c is not None else ("", "")
                    conn.close()
                collector.pop()
            # one burst, as soon as A's receiver gives credit: A reads it all at once
            while notify is not None and rec.sent < len(payloads) and notify.credit > 0:
                notify.delivery(b"n%d" % rec.sent)
                notify.send(payloads[rec.sent])
                notify.advance()
                rec.sent += 1
            pending = transport.pending()
            if pending > 0:
                out = transport.peek(pending)
                transport.pop(len(out))
                sock.sendall(out)
                continue
            if pending < 0 and transport.capacity() < 0:
                break
            data = self._recv(sock)
            if data == b"":
                transport.close_tail()
            elif data:
                transport.push(data)
            transport.tick(time.monotonic())


@pytest.fixture
def fake():
    f = FakePeer()
    yield f
    f.stop()



def _bad_notes(node) -> int:
    return cluster_view(node)["counters"].get("bad_notifications", 0)


def _bindings_of(node, *node_ids) -> list[dict]:
    return [b for b in known_bindings(node) if b["node_id"] in node_ids]


def test_a_lying_peer_is_cut_off_and_believed_in_nothing_while_the_cluster_keeps_serving(tmp_path, fake, procs):
    cfg = {"addresses.orders": {"routing-types": ["anycast"]}}
    a = start_node(tmp_path, "a", static=[fake.url], config=cfg)
    procs.append(a)
    # B joins A; B does not dial the members A names (the fake), so the fake sees A alone
    b = start_node(tmp_path, "b", static=[a.amqp_url], config=cfg, extra={"allow-direct-connections-only": True})
    procs.append(b)
    wait_mesh([a, b])

    # (a) forged bindings and (b) garbage, each cut off with its condition, again on every reconnect
    wait_until(lambda: fake.closes("amqp:invalid-field") >= 2 and fake.closes("amqp:decode-error") >= 2, 30,
               "A cut the fake off twice for a forged binding and twice for garbage")
    assert all(c.login == b"\x00cluster-user\x00" + CLUSTER_PASSWORD.encode() for c in fake.connections)
    for c in fake.connections:
        if c.close is not None and c.mode == "forged":
            assert c.close[0] == "amqp:invalid-field", c
            assert FORGED_ID in c.close[1] and "distance 0" in c.close[1]
        elif c.close is not None and c.mode == "garbage":
            assert c.close[0] == "amqp:decode-error", c
    # the lie itself is rejected; what the fake said after it on that connection is not taken
    for c in fake.connections:
        if c.close is not None and c.mode in ("forged", "garbage"):
            assert c.outcomes.get("n2") == Delivery.REJECTED, c
            assert c.outcomes.get("n3") != Delivery.ACCEPTED, c
    err = a.stderr_text()
    assert "bad notification" in err
    assert "condition=amqp:invalid-field" in err and "condition=amqp:decode-error" in err
    assert _bad_notes(a) >= 4
    # A learned nothing from the liar: not the forged binding, not what it said after the lie
    assert _bindings_of(a, FORGED_ID, FAKE_ID) == []
    assert {x["to"] for x in cluster_view(b)["bridges"] if x["connected"]} == {a.node_id}

    # (c) meanwhile A keeps serving: B's consumer gets every message sent to A, exactly once,
    # with the fake cut off between the two halves
    cb = connect(b)
    try:
        r = cb.create_receiver("orders", credit=500)
        wait_known_consumers(a, "orders", 1)
        sender_conn = connect(a)
        s = sender_conn.create_sender("orders")
        for i in range(100):
            s.send(Message(body=f"m{i}", durable=True))
        cut = len([c for c in fake.connections if c.close is not None])
        wait_until(lambda: len([c for c in fake.connections if c.close is not None]) >= cut + 2, 20,
                   "the fake cut off again while messages flow")
        for i in range(100, 200):
            s.send(Message(body=f"m{i}", durable=True))
        sender_conn.close()
        got = []
        for _ in range(200):
            got.append(r.receive(timeout=20).body)
            r.accept()
        assert sorted(got, key=lambda m: int(m[1:])) == [f"m{i}" for i in range(200)]
        with pytest.raises(Timeout):
            r.receive(timeout=1.0)  # nothing more: no copy went anywhere else
    finally:
        cb.close()
    assert a.queue("orders")["depth"] == 0 and b.queue("orders")["depth"] == 0

    # still nothing learned from the liar, and B's binding is the only one A knows
    assert _bindings_of(a, FORGED_ID, FAKE_ID) == []
    assert {x["node_id"] for x in known_bindings(a)} == {b.node_id}
    # the fake goes on reconnecting and being cut off: count its closes first, then read A's counter
    # (A counts a bad notification before it closes the connection, so the counter can only be ahead)
    cut_off = fake.closes("amqp:invalid-field") + fake.closes("amqp:decode-error")
    assert cluster_view(a)["counters"].get("bad_notifications", 0) >= cut_off

    # the fake turns honest: A learns its binding, so the checks above could fail
    fake.mode = "honest"
    wait_until(lambda: _bindings_of(a, FAKE_ID), 20, "A learned the honest fake's binding")
    assert [(x["queue"], x["address"], x["consumers"]) for x in _bindings_of(a, FAKE_ID)] == \
        [("fake-q", "fake-address", 1)]
    assert _bindings_of(a, FORGED_ID) == []
    honest = [c for c in fake.connections if c.mode == "honest"]
    wait_until(lambda: any(FAKE_ID == x["to"] and x["connected"] for x in cluster_view(a)["bridges"]), 10,
               "A's bridge to the honest fake stays up")
    assert honest and all(c.close is None for c in honest)
    wait_mesh([a, b])
