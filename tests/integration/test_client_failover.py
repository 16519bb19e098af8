"""What a failover loses, said aloud (issue 19, part 3): router.client.FailoverConnection and the
rhea helper (clients/node/lodestone-redirect.js) against real broker processes.

* a request/reply over a temporary queue survives the SIGKILL of the primary of a replicated
  pair: the temporary queue is created again on the backup, the next request names its new
  address, its reply comes back;
* the non-durable messages the requester saw accepted by the primary are reported (Python:
  :class:`NonDurableLost` at the next call, rhea: the ``failover`` event), with their count,
  and the backup indeed holds only the durable ones;
* ``reconnect-attempts = 2`` gives up after exactly 3 tries (the first at once + 2 retries),
  counted as TCP connections by a proxy in front of a killed broker, with a DISCONNECT event.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
from proton import Message, Timeout

from router.client import (DISCONNECT, FAILOVER, DeliveryLost, FailoverConnection, FailoverError, NonDurableLost)
from tests.brokerproc import start_broker
from tests.haproc import CLIENT, receive_all, start_replica, wait_active, wait_phase, wait_replication
from tests.tcpproxy import TcpProxy
from tests.nodeclients import node_executable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

FAST_VOTES = {"vote-retries": 2, "vote-retry-wait-ms": 200, "quorum-vote-wait-s": 5}
NODE_DIR = Path(__file__).resolve().parents[2] / "clients" / "node"



def replicated_pair(tmp_path, procs):
    """A primary and its backup, in sync (the primary's Open names the backup)."""
    primary = start_replica(tmp_path, "primary", "primary")
    procs.append(primary)
    wait_active(primary)
    backup = start_replica(tmp_path, "backup", "backup", static=[primary.amqp_url], ha=FAST_VOTES)
    procs.append(backup)
    wait_phase(backup, "in-sync")
    wait_replication(primary, "in-sync")
    return primary, backup


class Responder(threading.Thread):
    """Answers each request on ``requests`` to its ``reply_to`` (upper-cased body, same
    correlation id), itself through a FailoverConnection; records the reply addresses it used
    and the losses it was told of (its replies are non-durable)."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.reply_tos: list[tuple[str, str]] = []   # (correlation id, reply_to) of each reply
        self.lost: list[NonDurableLost] = []
        self.ready = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn = FailoverConnection(self.url, **CLIENT)
            rcv, snd = conn.receiver("requests"), conn.sender(None)
            self.ready.set()
            while not self.done.is_set():
                try:
                    m = rcv.receive(timeout=0.2)
                except Timeout:
                    continue
                except NonDurableLost as lost:
                    self.lost.append(lost)
                    continue
                reply = Message(address=m.reply_to, body=m.body.upper(), correlation_id=m.correlation_id)
                while True:
                    try:
                        snd.send(reply)
                        break
                    except NonDurableLost as lost:    # said before sending: send it again
                        self.lost.append(lost)
                self.reply_tos.append((m.correlation_id, m.reply_to))
                try:
                    rcv.accept()
                except DeliveryLost:
                    pass
            conn.close()
        except BaseException as exc:   # the test asserts there was none
            self.error = exc
            self.ready.set()


def test_request_reply_over_a_temporary_queue_survives_a_failover_and_the_loss_is_said(tmp_path, procs):
    primary, backup = replicated_pair(tmp_path, procs)
    responder = Responder(primary.amqp_url)
    responder.start()
    assert responder.ready.wait(20) and responder.error is None, responder.error
    events = []
    conn = FailoverConnection(primary.amqp_url, failure_listener=events.append, **CLIENT)
    assert conn.learned == [backup.amqp_url]
    replies = conn.receiver(None, dynamic=True)
    temp1 = replies.address
    assert temp1.startswith("temp.")
    requests, notes = conn.sender("requests"), conn.sender("notes")
    for i in range(5):
        notes.send(Message(body=f"nd{i}"))                  # non-durable: on the primary only
    for i in range(3):
        notes.send(Message(body=f"d{i}", durable=True))     # durable: replicated
    requests.send(Message(body="q1", reply_to=temp1, correlation_id="c1", durable=True))
    r = replies.receive(timeout=20)
    replies.accept()
    assert (r.body, r.correlation_id) == ("Q1", "c1")

    primary.kill()
    wait_active(backup)
    # the failover happens inside this send; reply_to names the lost temporary queue and goes
    # with its new address
    requests.send(Message(body="q2", reply_to=temp1, correlation_id="c2", durable=True))
    assert [e.kind for e in events] == [FAILOVER] and conn.current == backup.amqp_url
    with pytest.raises(NonDurableLost) as lost:             # said aloud, at the next call
        replies.receive(timeout=20)
    assert lost.value.count == 5 and "up to 5 non-durable messages" in str(lost.value)
    assert lost.value.old.node_id == lost.value.new.node_id == primary.node_id   # same node id, new process
    assert lost.value.old.started_ms != lost.value.new.started_ms
    r = replies.receive(timeout=20)                         # the call is simply repeated
    replies.accept()
    assert (r.body, r.correlation_id) == ("Q2", "c2")
    temp2 = replies.address
    assert temp2 != temp1 and temp2.startswith("temp.") and conn.temporary_queues == {temp1: temp2}
    assert events[0].lost is lost.value and events[0].temporary_queues == {temp1: temp2} and events[0].tries == 1
    assert conn.failovers == 1
    responder.done.set()
    responder.join(20)
    assert responder.error is None, responder.error
    # q2's reply went to the new temporary queue; q1 may have been answered twice (its accept
    # was in flight at the kill: at least once), to the address it named
    assert [to for c, to in responder.reply_tos if c == "c2"] == [temp2]
    assert {to for c, to in responder.reply_tos if c == "c1"} == {temp1}
    assert [x.count for x in responder.lost] == [1]          # its one non-durable reply on the primary
    conn.close()
    assert sorted(receive_all(backup, "notes")) == ["d0", "d1", "d2"]   # the 5 non-durable ones are gone


class CountingProxy(TcpProxy):
    """A TcpProxy that records when it accepted each connection: one per connection try of a
    client behind it (after the broker is gone it accepts, fails upstream and closes)."""

    def __init__(self, host: str, port: int):
        super().__init__(host, port)
        self.accepted: list[float] = []
        inner = self.listener

        class Listener:
            def accept(_):
                pair = inner.accept()
                self.accepted.append(time.monotonic())
                return pair

            def __getattr__(_, name):
                return getattr(inner, name)

        self.listener = Listener()


def test_reconnect_attempts_2_gives_up_after_exactly_3_tries_with_a_disconnect(tmp_path):
    broker = start_broker(tmp_path)
    proxy = CountingProxy("127.0.0.1", broker.port).start()
    try:
        events = []
        conn = FailoverConnection(f"amqp://127.0.0.1:{proxy.port}", reconnect_attempts=2, retry_interval_s=0.2,
                                  retry_interval_multiplier=1.5, failure_listener=events.append, **CLIENT)
        snd = conn.sender("attempts")
        snd.send(Message(body="before", durable=True))
        assert len(proxy.accepted) == 1
        broker.kill()
        t0 = time.monotonic()
        with pytest.raises(FailoverError) as err:
            snd.send(Message(body="after", durable=True))
        took = time.monotonic() - t0
        assert err.value.tries == 3 and "3 tries" in str(err.value)
        tries = proxy.accepted[1:]
        assert len(tries) == 3, proxy.accepted                     # exactly 3, never a 4th
        gaps = [b - a for a, b in zip(tries, tries[1:])]
        assert gaps[0] >= 0.2 and gaps[1] >= 0.3, gaps             # retry_interval, then x1.5
        assert [e.kind for e in events] == [DISCONNECT] and events[0].tries == 3
        assert events[0].error is not None and events[0].url is None
        print(f"gave up after 3 tries in {took:.2f} s; gaps {gaps}")
    finally:
        proxy.close()
        broker.kill()


# -- the rhea helper ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def node():
    return node_executable("rhea failover tests")


class RheaApp:
    """``clients/node/test/failover.js`` as a subprocess: ``line()`` reads its next JSON line."""

    def __init__(self, node, port: int, mode: str, **options):
        cfg = {"host": "127.0.0.1", "port": port, "username": CLIENT["user"], "password": CLIENT["password"],
               "mode": mode, "options": options, "deadline_ms": 15000}
        self.proc = subprocess.Popen([node, str(NODE_DIR / "test" / "failover.js"), json.dumps(cfg)], cwd=NODE_DIR,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def line(self) -> dict:
        while True:
            text = self.proc.stdout.readline()
            assert text, f"the rhea app ended: {self.proc.wait(10)} {self.proc.stderr.read()}"
            if text.startswith("{"):
                return json.loads(text)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def test_rhea_request_reply_over_a_temporary_queue_survives_a_failover_and_the_loss_is_said(tmp_path, procs,
                                                                                            node):
    primary, backup = replicated_pair(tmp_path, procs)
    responder = Responder(primary.amqp_url)
    responder.start()
    assert responder.ready.wait(20) and responder.error is None, responder.error
    app = RheaApp(node, primary.port, "request-reply")
    try:
        assert app.line() == {"phase": "ready"}          # q1 answered; 5 + 3 notes accepted
        primary.kill()
        out = app.line()
        assert app.proc.wait(10) == 0
    finally:
        app.close()
    assert not out.get("deadline"), (out, responder.reply_tos, responder.lost, responder.error)
    temp1, temp2 = out["temp1"], out["temp2"]
    assert out["notes_accepted"] == 8 and temp1.startswith("temp.") and temp2.startswith("temp.") and temp1 != temp2
    assert out["replies"] == [{"body": "Q1", "correlation_id": "c1"}, {"body": "Q2", "correlation_id": "c2"}], out
    assert len(out["events"]) == 1, out["events"]
    (event,) = out["events"]
    assert event["type"] == "FAILOVER" and event["url"] == f"127.0.0.1:{backup.port}", event
    assert event["lost"]["name"] == "NonDurableLost" and event["lost"]["count"] == 5, event
    assert "up to 5 non-durable messages" in event["lost"]["message"]
    assert event["temporary_queues"] == {temp1: temp2} and event["broker"]["node_id"] == primary.node_id
    responder.done.set()
    responder.join(20)
    assert responder.error is None, responder.error
    assert [to for c, to in responder.reply_tos if c == "c2"] == [temp2]     # sent with the new address
    assert sorted(receive_all(backup, "notes")) == ["d0", "d1", "d2"]       # the 5 non-durable ones are gone


def test_rhea_reconnect_attempts_2_gives_up_after_exactly_3_tries_with_a_disconnect(tmp_path, node):
    broker = start_broker(tmp_path)
    proxy = CountingProxy("127.0.0.1", broker.port).start()
    app = RheaApp(node, proxy.port, "attempts", reconnectAttempts=2, retryInterval=200, retryIntervalMultiplier=1.5)
    try:
        assert app.line() == {"phase": "ready"}
        assert len(proxy.accepted) == 1
        broker.kill()
        out = app.line()                                  # printed once rhea scheduled no reconnect
        assert app.proc.wait(10) == 0
    finally:
        app.close()
        proxy.close()
        broker.kill()
    tries = proxy.accepted[1:]
    assert len(tries) == 3, proxy.accepted
    gaps = [b - a for a, b in zip(tries, tries[1:])]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.3, gaps
    (event,) = out["events"]
    assert event["type"] == "DISCONNECT" and event["tries"] == 3 and event["error"]["tries"] == 3, event
    assert out["rhea_disconnected"][-1] is False, out       # rhea: no reconnect scheduled
