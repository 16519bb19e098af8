"""HandshakeSniffer: real proton clients through SASL to Detected, replay of client_bytes into a
real proton server, and the error paths (non-AMQP, no SASL, oversized, wrong first frame)."""

from __future__ import annotations

import proton
import pytest

from broker.wire.codec import Symbol
from broker.wire.frames import (
    FOLLOWS_REDIRECT,
    AMQP_HEADER,
    FRAME_AMQP,
    FRAME_SASL,
    NEED_DATA,
    SASL_HEADER,
    Close,
    FrameReader,
    Open,
    SaslInit,
    decode_performative,
    encode_frame,
)
from broker.wire.sasl import AuthFailed, AuthRequested, parse_plain
from broker.wire.errors import FramingError, NotThisProtocol, RemoteProtocolError
from router.sniff.amqp import Detected, HandshakeSniffer

USERS = {"alice": "secret"}


def _drain(t: proton.Transport) -> bytes:
    n = t.pending()
    if n <= 0:
        return b""
    data = bytes(t.peek(n))
    t.pop(len(data))
    return data


def run_proton_client(sniffer, *, user="alice", password="secret", mechs="PLAIN", sasl=True, desired=None):
    """Pump a real proton client into the sniffer until Detected or AuthFailed."""
    conn = proton.Connection()
    conn.container = "client-42"
    conn.hostname = "tenant-a.example"
    if desired is not None:
        conn.desired_capabilities = proton.SymbolList(desired)
    if user is not None:
        conn.user = user
        conn.password = password
    t = proton.Transport()
    csasl = None
    if sasl:
        csasl = t.sasl()
        csasl.allowed_mechs(mechs)
        csasl.allow_insecure_mechs = True
    t.bind(conn)
    conn.open()
    for _ in range(20):
        data = _drain(t)
        if data:
            sniffer.receive_data(data)
        while (ev := sniffer.next_event()) is not NEED_DATA:
            if isinstance(ev, AuthRequested):
                _, u, pw = parse_plain(ev.initial_response)
                if USERS.get(u) == pw:
                    sniffer.accept(u)
                else:
                    sniffer.reject()
            else:
                out = sniffer.data_to_send()
                if out:
                    t.push(out)
                return ev, conn, t, csasl
        out = sniffer.data_to_send()
        if out:
            t.push(out)
    raise AssertionError("handshake did not complete")


def test_proton_client_detected_with_container_hostname_user():
    ev, conn, t, csasl = run_proton_client(HandshakeSniffer())
    assert isinstance(ev, Detected)
    assert ev.open.container_id == "client-42"
    assert ev.open.hostname == "tenant-a.example"
    assert (ev.user, ev.mechanism, ev.verified) == ("alice", "PLAIN", True)
    assert csasl.outcome == proton.SASL.OK
    assert ev.client_bytes.startswith(AMQP_HEADER)
    assert ev.sasl_init_bytes.startswith(SASL_HEADER)
    r = FrameReader(4096)
    r.receive_data(ev.sasl_init_bytes[8:])
    init = decode_performative(r.next_event().body)
    assert isinstance(init, SaslInit) and parse_plain(init.initial_response)[1] == "alice"


@pytest.mark.parametrize("desired, caps, follows", [
    (None, (), False),
    (["some:capability"], ("some:capability",), False),
    ([FOLLOWS_REDIRECT], (FOLLOWS_REDIRECT,), True),
    (["some:capability", FOLLOWS_REDIRECT], ("some:capability", FOLLOWS_REDIRECT), True),
])
def test_open_desired_capabilities_are_exposed(desired, caps, follows):
    """An ``auto`` acceptor redirects a client that desires lodestone:follows-redirect."""
    ev, *_ = run_proton_client(HandshakeSniffer(), desired=desired)
    assert isinstance(ev, Detected)
    assert ev.desired_capabilities == caps
    assert ev.follows_redirect is follows
    assert FOLLOWS_REDIRECT == "lodestone:follows-redirect"


def test_client_bytes_replay_opens_a_real_proton_server():
    ev, conn, t, _ = run_proton_client(HandshakeSniffer())
    server_t = proton.Transport(proton.Transport.SERVER)
    server_conn = proton.Connection()
    server_conn.container = "broker-b"
    server_t.bind(server_conn)
    server_t.push(ev.client_bytes)
    server_conn.open()
    t.push(_drain(server_t))
    assert server_conn.remote_container == "client-42"
    assert conn.state & proton.Endpoint.REMOTE_ACTIVE
    assert conn.remote_container == "broker-b"


def test_wrong_password_gives_auth_failed_to_the_client():
    ev, conn, t, csasl = run_proton_client(HandshakeSniffer(), password="nope")
    assert isinstance(ev, AuthFailed)
    assert csasl.outcome == proton.SASL.AUTH


def test_without_authenticator_claimed_user_is_unverified():
    sn = HandshakeSniffer(authenticator_needed=False)
    ev, *_ = run_proton_client(sn, password="anything")
    assert isinstance(ev, Detected)
    assert (ev.user, ev.verified) == ("alice", False)
    assert ev.sasl_init_bytes is not None


def test_no_sasl_client_allowed_only_without_authenticator():
    ev, *_ = run_proton_client(HandshakeSniffer(authenticator_needed=False), user=None, sasl=False)
    assert isinstance(ev, Detected)
    assert (ev.user, ev.mechanism, ev.sasl_init_bytes) == (None, None, None)

    sn = HandshakeSniffer()
    sn.receive_data(AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open("c")))
    with pytest.raises(RemoteProtocolError) as ei:
        sn.next_event()
    assert ei.value.condition == "amqp:unauthorized-access"
    assert ei.value.reply == SASL_HEADER


def test_pipelined_bytes_after_open_are_kept():
    after = encode_frame(FRAME_AMQP, 0, None) + b"\x00\x00"  # pipelined after the open
    stream = (
        SASL_HEADER
        + encode_frame(FRAME_SASL, 0, SaslInit(Symbol("PLAIN"), b"\x00alice\x00secret"))
        + AMQP_HEADER
        + encode_frame(FRAME_AMQP, 0, None)  # heartbeat before the open is skipped
        + encode_frame(FRAME_AMQP, 0, Open("c1", "h1"))
        + after
    )
    sn = HandshakeSniffer()
    result = None
    for i in range(len(stream)):  # byte by byte
        sn.receive_data(stream[i : i + 1])
        while (ev := sn.next_event()) is not NEED_DATA:
            if isinstance(ev, AuthRequested):
                sn.accept("alice")
            else:
                result = ev
        if result:
            break
    assert result.open == Open("c1", "h1")
    # fed byte by byte, Detected comes as soon as the Open is complete
    assert stream.endswith(result.client_bytes + after)


def test_pipelined_bytes_in_the_same_chunk_are_included():
    stream = AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open("c1")) + b"\x00\x00\x00\x08"
    sn = HandshakeSniffer(authenticator_needed=False)
    sn.receive_data(stream)
    ev = sn.next_event()
    assert ev.client_bytes == stream


@pytest.mark.parametrize(
    "data",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x00\xa5\x01\x00\x00", b"AMQP\x02\x01\x00\x00"],
)
def test_non_amqp_raises_not_this_protocol_with_bytes(data):
    sn = HandshakeSniffer()
    sn.receive_data(data)
    with pytest.raises(NotThisProtocol) as ei:
        sn.next_event()
    assert ei.value.data == data


def test_oversized_handshake_is_a_framing_error():
    sn = HandshakeSniffer(authenticator_needed=False, max_handshake_bytes=1024)
    sn.receive_data(AMQP_HEADER + b"\x00\x00\x10\x00\x02\x00\x00\x00")
    with pytest.raises(FramingError) as ei:
        sn.next_event()
    assert ei.value.condition == "amqp:connection:framing-error"
    assert ei.value.reply.startswith(AMQP_HEADER)  # header + open + close for the client

    sn = HandshakeSniffer(max_handshake_bytes=600)
    sn.receive_data(SASL_HEADER + b"\x00\x00\x04\x00\x02\x01\x00\x00")
    with pytest.raises(FramingError):
        sn.next_event()


def test_first_frame_not_open_closes_with_reply():
    sn = HandshakeSniffer(authenticator_needed=False)
    sn.receive_data(AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Close()))
    with pytest.raises(RemoteProtocolError, match="expected open") as ei:
        sn.next_event()
    reply = ei.value.reply
    assert reply.startswith(AMQP_HEADER)
    r = FrameReader(4096)
    r.receive_data(reply[8:])
    r.next_event()
    close = decode_performative(r.next_event().body)
    assert close.error.condition == "amqp:connection:framing-error"


def test_malformed_open_is_a_decode_error_with_close_reply():
    sn = HandshakeSniffer(authenticator_needed=False)
    sn.receive_data(AMQP_HEADER + b"\x00\x00\x00\x0c\x02\x00\x00\x00\x00\x53\x10\xc0")
    with pytest.raises(RemoteProtocolError) as ei:
        sn.next_event()
    assert ei.value.condition == "amqp:decode-error"
    assert ei.value.reply
