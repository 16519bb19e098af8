"""The broker as the dialling side (broker.amqp.peer.PeerConnection) against real broker processes.

Each test runs a ``PeerConnection`` in its own trio run (its host a real ``broker.node.Node``)
against a broker subprocess (tests/brokerproc.py, ports from the OS) and checks with an
unmodified python-qpid-proton client (BlockingConnection) what arrived there.
"""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import trio
from proton import Message
from proton.utils import BlockingConnection

from broker.amqp.peer import (
    PeerConnectFailed,
    PeerConnected,
    PeerAttemptStarted,
    PeerConnection,
    PeerDisconnected,
    PeerGaveUp,
    PeerLoginRefused,
    RetrySettings,
)
from broker.config import load_config
from broker.node import Node
from tests.brokerproc import start_broker, write_config
from tests.waiting import wait_for_async

pytestmark = pytest.mark.slow

APP = ("app", "app")


def local_node(tmp_path) -> Node:
    """The dialling side's host: a real Node (no journal, no listeners)."""
    cfg = load_config(write_config(tmp_path / "dialler", name="dialler"))
    return Node(cfg, None, "d1a11e40000000000000000000000000", None)


def app_url(b) -> str:
    return b.amqp_url.replace("amqp://", "amqp://app:app@")


def receive_all(b, address: str, *, quiet_s: float = 2.0, limit: int = 100_000) -> list[bytes]:
    """Everything on ``address``'s queue, with a stock proton client (stops after quiet_s idle)."""
    c = BlockingConnection(app_url(b), timeout=20, allowed_mechs="PLAIN")
    try:
        r = c.create_receiver(address, credit=200)
        out = []
        while len(out) < limit:
            try:
                m = r.receive(timeout=quiet_s)
            except Exception:  # proton.Timeout
                break
            out.append(m.body)
            r.accept()
        return out
    finally:
        c.close()


def body(i: int) -> bytes:
    return Message(body=f"m-{i}", durable=True).encode()


def test_peer_logs_in_sends_durable_messages_and_gets_every_acceptance(tmp_path):
    b = start_broker(tmp_path)
    node = local_node(tmp_path)
    n = 200
    events, outcomes = [], {}

    async def main():
        async with trio.open_nursery() as nursery:
            peer = PeerConnection(node, b.amqp_url, credentials=APP, on_event=events.append, name="p1")
            snd = peer.sender("peer.orders", lambda token, state: outcomes.__setitem__(token, state))
            nursery.start_soon(peer.run)
            for i in range(n):
                snd.send(body(i), i)
            await wait_for_async(lambda: len(outcomes) >= n, 30, interval_s=0.02, what=f"{n} outcomes")
            assert not snd.unacked
            nursery.cancel_scope.cancel()
        return peer

    try:
        peer = trio.run(main)
        assert outcomes == {i: "accepted" for i in range(n)}
        connected = [e for e in events if isinstance(e, PeerConnected)]
        assert len(connected) == 1 and not connected[0].reconnect
        assert connected[0].node_id == b.node_id  # the peer's Open names its node
        assert peer.connections == 1 and peer.auth_failures == 0
        got = receive_all(b, "peer.orders")
        assert sorted(got) == sorted(f"m-{i}" for i in range(n)) and len(got) == n
        # the broker saw our container-id and node id
        assert node.links_opened == 1
    finally:
        b.stop()


def test_wrong_password_is_reported_and_retried_with_growing_intervals(tmp_path, caplog):
    b = start_broker(tmp_path)
    node = local_node(tmp_path)
    retry = RetrySettings(retry_interval_ms=200, retry_interval_multiplier=2.0, max_retry_interval_ms=1000,
                          initial_connect_attempts=6)
    stamps: list[tuple[float, object]] = []

    async def main():
        peer = PeerConnection(node, b.amqp_url, credentials=("app", "wrong"), retry=retry, name="badpw",
                              on_event=lambda ev: stamps.append((trio.current_time(), ev)))
        with trio.fail_after(60):
            await peer.run()  # returns once the 6 initial attempts are spent
        return peer

    try:
        with caplog.at_level("INFO", logger="lodestone.broker.peer"):
            peer = trio.run(main)
        refused = [(t, ev) for t, ev in stamps if isinstance(ev, PeerLoginRefused)]
        assert len(refused) == 6 and all(ev.auth for _, ev in refused)
        assert isinstance(stamps[-1][1], PeerGaveUp) and stamps[-1][1].attempts == 6
        assert peer.auth_failures == 6 and node.counters["peer_login_refused"] == 6
        # logged once per peer, not once per attempt
        assert sum("refused our login" in r.getMessage() for r in caplog.records) == 1
        # from each refusal to the next attempt: the back-off, 0.2, 0.4, 0.8, 1.0 (capped), 1.0 s
        starts = [t for t, ev in stamps if isinstance(ev, PeerAttemptStarted)]
        assert len(starts) == 6
        waits = [start - t_refused for (t_refused, _), start in zip(refused, starts[1:])]
        expected = [retry.delay_s(k) for k in range(1, 6)]
        assert expected == [0.2, 0.4, 0.8, 1.0, 1.0]
        for wait, want in zip(waits, expected):
            assert want - 0.01 <= wait <= want + 0.25, (waits, expected)
        # and attempt to attempt (each attempt's own time added: the broker answers a bad
        # password after its failure delay) the spacing grows until the cap
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        assert gaps[0] < gaps[1] < gaps[2] and all(g >= w for g, w in zip(gaps, expected)), gaps
    finally:
        b.stop()


@pytest.mark.parametrize("where", ["sasl", "amqp"])
def test_garbage_from_the_peer_is_cut_off_with_a_condition_and_retried(tmp_path, where):
    """A 'broker' that sends garbage: instead of SASL (an HTTP reply), or after a good SASL
    exchange a malformed AMQP frame (a size below the 8-byte frame header, §2.3.1)."""
    node = local_node(tmp_path)
    from broker.wire.frames import SASL_HEADER, FRAME_SASL, SaslMechanisms, SaslOutcome, encode_frame
    from broker.wire.codec import Symbol
    stamps = []
    connections = []
    received = []

    async def fake_broker(stream):
        connections.append(stream)
        if where == "sasl":
            await stream.send_all(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            await stream.receive_some(65536)
            return
        await stream.send_all(SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslMechanisms((Symbol("ANONYMOUS"),))))
        got = b""
        while len(got) < 8 + 8:
            data = await stream.receive_some(65536)
            if not data:
                return
            got += data
        await stream.send_all(encode_frame(FRAME_SASL, 0, SaslOutcome(0)))
        await stream.send_all(b"AMQP\x00\x01\x00\x00" + b"\x00\x00\x00\x04\x02\x00\x00\x00garbage!")
        got = b""
        try:
            while data := await stream.receive_some(65536):
                got += data
        except trio.BrokenResourceError:
            pass
        received.append(got)

    async def main():
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, fake_broker, 0)
            port = listeners[0].socket.getsockname()[1]
            peer = PeerConnection(node, f"amqp://127.0.0.1:{port}", retry=RetrySettings(
                retry_interval_ms=100, initial_connect_attempts=3),
                on_event=lambda ev: stamps.append(ev))
            with trio.fail_after(30):
                await peer.run()
            nursery.cancel_scope.cancel()

    trio.run(main)
    failed = [ev for ev in stamps if isinstance(ev, PeerConnectFailed)]
    assert len(failed) == 3 and len(connections) == 3
    assert all(ev.condition == "amqp:connection:framing-error" for ev in failed), failed
    assert node.counters["peer_protocol_error"] == 3
    if where == "amqp":  # proton answered with Close(framing-error) before we cut the socket
        assert all(b"amqp:connection:framing-error" in got for got in received), received
    assert isinstance(stamps[-1], PeerGaveUp)


def test_sigkilled_peer_restarted_gets_every_unacknowledged_message_again(tmp_path):
    b = start_broker(tmp_path)
    port = b.port
    # restart on the same port: pin the acceptor's port in the config after the first start
    text = b.config_path.read_text()
    b.config_path.write_text(text.replace('port = 0\nsasl-mechanisms', f'port = {port}\nsasl-mechanisms', 1))
    node = local_node(tmp_path)
    n = 3000
    events, accepted = [], set()
    killed_at = {}

    async def main():
        async with trio.open_nursery() as nursery:
            peer = PeerConnection(node, b.amqp_url, credentials=APP, name="crash", on_event=events.append,
                                  retry=RetrySettings(retry_interval_ms=100, max_retry_interval_ms=500,
                                                      retry_interval_multiplier=2.0))
            snd = peer.sender("peer.crash", lambda token, state: state == "accepted" and accepted.add(token))
            nursery.start_soon(peer.run)
            kill_at = n // 3 + 200
            for i in range(n):
                snd.send(body(i), i)
                if i % 50 == 0:
                    await trio.sleep(0.001)  # pacing, not a wait: let the pump run
                if i == n // 3:  # the stream is flowing: accepted messages come back
                    await wait_for_async(lambda: len(accepted) >= n // 10, 20, interval_s=0.005,
                                         what="a tenth accepted")
                    # freeze the broker: what we write from now on is certainly not acknowledged
                    # when it is killed (mid-stream, with transfers on the wire)
                    os.kill(b.proc.pid, signal.SIGSTOP)
                if i == kill_at:
                    # the pump has written transfers the frozen broker cannot answer
                    await wait_for_async(lambda: snd._transferred, 10, interval_s=0.005,
                                         what="transfers in flight")
                    killed_at["accepted"] = len(accepted)
                    killed_at["unacked"] = len(snd.unacked)
                    killed_at["in_flight"] = len(snd._transferred)  # written, not acknowledged
                    await trio.to_thread.run_sync(b.kill)
                    # the peer saw its connection go before the broker is back
                    await wait_for_async(lambda: any(isinstance(e, PeerDisconnected) for e in events), 10,
                                         interval_s=0.005, what="the peer to see its connection go")
                    await trio.to_thread.run_sync(b.start)
            await wait_for_async(lambda: len(accepted) >= n, 60, what=f"all {n} accepted")
            assert not snd.unacked
            nursery.cancel_scope.cancel()
        return peer, snd

    try:
        peer, snd = trio.run(main)
        assert b.port == port
        assert killed_at["in_flight"] > 0  # the kill did land with messages in flight
        connected = [e for e in events if isinstance(e, PeerConnected)]
        assert len(connected) == 2 and connected[-1].reconnect
        assert connected[-1].resent == killed_at["in_flight"]  # every one of them sent again
        assert any(isinstance(e, PeerDisconnected) for e in events)
        got = receive_all(b, "peer.crash")
        want = {f"m-{i}" for i in range(n)}
        duplicates = len(got) - len(set(got))
        assert set(got) == want, f"lost {len(want - set(got))}"   # none lost
        assert duplicates <= snd.sent - n                         # only resends can duplicate
        print(f"messages {n}, received {len(got)}, duplicates {duplicates}, transfers {snd.sent}, "
              f"resent on reconnect {connected[-1].resent}")
    finally:
        b.stop()


def test_initial_connect_attempts_bound_a_peer_that_is_not_there(tmp_path):
    node = local_node(tmp_path)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    stamps = []

    async def main():
        peer = PeerConnection(node, f"amqp://127.0.0.1:{port}", on_event=lambda ev: stamps.append(
            (trio.current_time(), ev)), retry=RetrySettings(retry_interval_ms=150, initial_connect_attempts=4))
        with trio.fail_after(20):
            await peer.run()

    t0 = time.monotonic()
    trio.run(main)
    failed = [t for t, ev in stamps if isinstance(ev, PeerConnectFailed)]
    assert len(failed) == 4 and isinstance(stamps[-1][1], PeerGaveUp)
    gaps = [b - a for a, b in zip(failed, failed[1:])]
    assert all(0.13 <= g <= 0.6 for g in gaps), gaps  # multiplier 1.0: a steady 150 ms
    assert time.monotonic() - t0 < 10


@pytest.mark.parametrize("trusted", [True, False])
def test_amqps_peer_verified_by_its_ca(tmp_path, trusted):
    import trustme
    ca = trustme.CA()
    b = start_broker(tmp_path, tls=ca)
    node = local_node(tmp_path)
    other = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other))
    events, outcomes = [], {}

    async def main():
        peer = PeerConnection(node, b.amqps_url, credentials=APP, on_event=events.append,
                              ca_file=str(b.workdir / "ca.pem") if trusted else str(other),
                              retry=RetrySettings(retry_interval_ms=100, initial_connect_attempts=2))
        snd = peer.sender("peer.tls", lambda token, state: outcomes.__setitem__(token, state))
        for i in range(10):
            snd.send(body(i), i)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer.run)
            await wait_for_async(lambda: len(outcomes) >= 10 or any(isinstance(e, PeerGaveUp) for e in events), 20,
                                 interval_s=0.02, what="10 outcomes, or the peer giving up")
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        if trusted:
            assert outcomes == {i: "accepted" for i in range(10)}
            assert sorted(receive_all(b, "peer.tls")) == sorted(f"m-{i}" for i in range(10))
        else:
            failed = [e for e in events if isinstance(e, PeerConnectFailed)]
            assert len(failed) == 2 and "CERTIFICATE_VERIFY_FAILED" in failed[0].description
            assert outcomes == {} and isinstance(events[-1], PeerGaveUp)
    finally:
        b.stop()


def test_peer_receiver_takes_every_message_and_accepts_after_the_callback(tmp_path):
    b = start_broker(tmp_path)
    node = local_node(tmp_path)
    n = 300
    c = BlockingConnection(app_url(b), timeout=20, allowed_mechs="PLAIN")
    try:
        s = c.create_sender("peer.inbox")
        for i in range(n):
            s.send(Message(body=f"in-{i}", durable=True))
    finally:
        c.close()
    got = []

    def on_message(data: bytes) -> str:
        m = Message()
        m.decode(data)
        got.append(m.body)
        # the first copy of message 7 is released: it comes back and is taken again
        return "released" if m.body == "in-7" and got.count("in-7") == 1 else "accepted"

    async def main():
        async with trio.open_nursery() as nursery:
            peer = PeerConnection(node, b.amqp_url, credentials=APP)
            peer.receiver("peer.inbox", on_message, credit=50)
            nursery.start_soon(peer.run)
            await wait_for_async(lambda: len(got) >= n + 1, 30, interval_s=0.02, what=f"{n + 1} messages")

            async def drained():
                return (await trio.to_thread.run_sync(b.queue, "peer.inbox"))["depth"] == 0
            await wait_for_async(drained, 10, what="the last dispositions to reach the broker")
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        assert sorted(set(got)) == sorted(f"in-{i}" for i in range(n))
        assert len(got) == n + 1 and got.count("in-7") == 2
        assert b.queue("peer.inbox")["depth"] == 0  # every one accepted
    finally:
        b.stop()
