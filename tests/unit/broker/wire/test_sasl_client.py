"""The sans-IO SASL client (broker.wire.sasl.SaslClient): tables of server bytes in → events out,
and the real SaslServer on the other side."""

from __future__ import annotations

import pytest

from broker.wire.frames import AMQP_HEADER, FRAME_AMQP, FRAME_SASL, NEED_DATA, SASL_HEADER, Open, SaslChallenge
from broker.wire.frames import SaslInit, SaslMechanisms, SaslOutcome, decode_performative, encode_frame, FrameReader
from broker.wire.codec import Symbol
from broker.wire.sasl import (
    AuthRequested,
    LoginAccepted,
    LoginRefused,
    SaslClient,
    SaslClientState,
    SaslServer,
    parse_plain,
)
from broker.wire.errors import LocalProtocolError, NotThisProtocol, SaslProtocolError


def mechs(*names: str) -> bytes:
    return encode_frame(FRAME_SASL, 0, SaslMechanisms(tuple(Symbol(n) for n in names)))


def outcome(code: int) -> bytes:
    return encode_frame(FRAME_SASL, 0, SaslOutcome(code))


def sent_init(data: bytes) -> SaslInit:
    r = FrameReader(65536)
    r.receive_data(data)
    frame = r.next_event()
    assert frame.type == FRAME_SASL
    perf = decode_performative(frame.body)
    assert isinstance(perf, SaslInit)
    return perf


def run(client: SaslClient, server_bytes: bytes, *, byte_by_byte: bool):
    """Feed the server's bytes (whole or one at a time); the first event that is not NEED_DATA."""
    chunks = [server_bytes[i:i + 1] for i in range(len(server_bytes))] if byte_by_byte else [server_bytes]
    ev = client.next_event()
    for c in chunks:
        if ev is not NEED_DATA:
            break
        client.receive_data(c)
        ev = client.next_event()
    return ev


OK_FLOW = SASL_HEADER + mechs("PLAIN", "ANONYMOUS") + outcome(SaslOutcome.OK)

CASES = [
    # (id, credentials, server bytes, expected event type, expected code / leftover)
    ("plain-ok", ("peer", "secret"), OK_FLOW, LoginAccepted, b""),
    ("anonymous-ok", None, OK_FLOW, LoginAccepted, b""),
    ("ok-with-amqp-header-behind", ("peer", "s"), OK_FLOW + AMQP_HEADER, LoginAccepted, AMQP_HEADER),
    ("empty-frame-before-mechanisms", ("peer", "s"),
     SASL_HEADER + encode_frame(FRAME_SASL, 0) + mechs("PLAIN") + outcome(0), LoginAccepted, b""),
    ("auth", ("peer", "wrong"), SASL_HEADER + mechs("PLAIN") + outcome(SaslOutcome.AUTH), LoginRefused,
     SaslOutcome.AUTH),
    ("sys-temp", ("peer", "s"), SASL_HEADER + mechs("PLAIN") + outcome(SaslOutcome.SYS_TEMP), LoginRefused,
     SaslOutcome.SYS_TEMP),
    ("plain-not-offered", ("peer", "s"), SASL_HEADER + mechs("EXTERNAL"), LoginRefused, SaslOutcome.SYS_PERM),
    ("anonymous-not-offered", None, SASL_HEADER + mechs("PLAIN"), LoginRefused, SaslOutcome.SYS_PERM),
]


@pytest.mark.parametrize("byte_by_byte", [False, True], ids=["whole", "bytewise"])
@pytest.mark.parametrize("name,credentials,server,kind,expect", CASES, ids=[c[0] for c in CASES])
def test_exchange(name, credentials, server, kind, expect, byte_by_byte):
    c = SaslClient(credentials, hostname="peer.example")
    assert c.data_to_send() == SASL_HEADER  # first, before reading anything
    ev = run(c, server, byte_by_byte=byte_by_byte)
    assert isinstance(ev, kind), ev
    if kind is LoginAccepted:
        # fed byte by byte, the bytes behind the outcome have not been fed yet
        assert ev.leftover == (b"" if byte_by_byte else expect)
        assert c.state is SaslClientState.DONE
        init = sent_init(c.data_to_send())
        assert init.mechanism == ("PLAIN" if credentials else "ANONYMOUS")
        assert init.hostname == "peer.example"
        if credentials:
            assert parse_plain(init.initial_response) == ("", *credentials)
    else:
        assert ev.code == expect
        assert ev.auth is (expect == SaslOutcome.AUTH)
        assert c.state is SaslClientState.FAILED


BAD = [
    ("http", b"HTTP/1.1 400 Bad Request\r\n\r\n", NotThisProtocol),
    ("amqp-header-no-sasl", AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open("x")), NotThisProtocol),
    ("wrong-version", b"AMQP\x03\x02\x00\x00", NotThisProtocol),
    ("outcome-before-mechanisms", SASL_HEADER + outcome(0), SaslProtocolError),
    ("challenge", SASL_HEADER + mechs("PLAIN") + encode_frame(FRAME_SASL, 0, SaslChallenge(b"x")), SaslProtocolError),
    ("amqp-frame-in-sasl", SASL_HEADER + encode_frame(FRAME_AMQP, 0, Open("x")), SaslProtocolError),
    ("garbage-frame", SASL_HEADER + b"\x00\x00\x00\x0c\x02\x01\x00\x00\xff\xff\xff\xff", Exception),
]


@pytest.mark.parametrize("byte_by_byte", [False, True], ids=["whole", "bytewise"])
@pytest.mark.parametrize("name,server,exc", BAD, ids=[b[0] for b in BAD])
def test_garbage_raises_a_remote_error_with_a_condition(name, server, exc, byte_by_byte):
    c = SaslClient(("peer", "s"))
    with pytest.raises(exc) as info:
        run(c, server, byte_by_byte=byte_by_byte)
    assert info.value.condition.startswith("amqp:")


def test_finished_client_refuses_more_bytes():
    c = SaslClient(None)
    assert isinstance(run(c, OK_FLOW, byte_by_byte=False), LoginAccepted)
    with pytest.raises(LocalProtocolError):
        c.receive_data(b"x")


@pytest.mark.parametrize("accept", [True, False])
def test_against_the_real_server(accept):
    c = SaslClient(("peer", "pw"))
    s = SaslServer(["PLAIN"])
    events = []
    for _ in range(6):
        s.receive_data(c.data_to_send())
        ev = s.next_event()
        if isinstance(ev, AuthRequested):
            assert parse_plain(ev.initial_response) == ("", "peer", "pw")
            s.accept("peer") if accept else s.reject()
        out = s.data_to_send()
        if out:
            c.receive_data(out)
        ev = c.next_event()
        if ev is not NEED_DATA:
            events.append(ev)
            break
    assert len(events) == 1
    assert isinstance(events[0], LoginAccepted if accept else LoginRefused)
