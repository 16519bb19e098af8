"""SaslServer and SaslClientReplay: table-driven exchanges, byte-by-byte feeding, and real
python-qpid-proton peers (a SASL PLAIN client; a SASL-less server Transport taking leftover())."""

from __future__ import annotations

import proton
import pytest

from broker.wire.codec import Symbol
from broker.wire.frames import (
    AMQP_HEADER,
    FRAME_AMQP,
    FRAME_SASL,
    NEED_DATA,
    SASL_HEADER,
    TLS_HEADER,
    FrameReader,
    Open,
    SaslChallenge,
    SaslInit,
    SaslMechanisms,
    SaslOutcome,
    SaslResponse,
    decode_performative,
    encode_frame,
)
from broker.wire.sasl import (
    AmqpHeaderReceived,
    AuthFailed,
    AuthRequested,
    NoSasl,
    SaslClientReplay,
    SaslHeaderReceived,
    SaslServer,
    SaslState,
    UpstreamAuthFailed,
    UpstreamAuthOk,
    parse_plain,
)
from broker.wire.errors import (
    FramingError,
    LocalProtocolError,
    NotThisProtocol,
    RemoteProtocolError,
    SaslProtocolError,
)

INIT = encode_frame(FRAME_SASL, 0, SaslInit(Symbol("PLAIN"), b"\x00alice\x00pw", "vhost"))
OPEN = encode_frame(FRAME_AMQP, 0, Open("cid"))


def events(server, data: bytes, *, byte_by_byte: bool = False):
    """Feed data, collect events until NEED_DATA (accept() on AuthRequested)."""
    out = []
    chunks = [data[i : i + 1] for i in range(len(data))] if byte_by_byte else [data]
    for chunk in chunks:
        server.receive_data(chunk)
        while (ev := server.next_event()) is not NEED_DATA:
            out.append(ev)
            if isinstance(ev, AuthRequested):
                server.accept("alice")
    return out


def sasl_frames(data: bytes) -> list:
    assert data[:8] == SASL_HEADER
    r = FrameReader(4096)
    r.receive_data(data[8:])
    out = []
    while (f := r.next_event()) is not NEED_DATA:
        assert f.type == FRAME_SASL
        out.append(decode_performative(f.body))
    return out


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_plain_exchange_and_leftover(byte_by_byte):
    s = SaslServer(["PLAIN", "EXTERNAL"])
    stream = SASL_HEADER + INIT + AMQP_HEADER + OPEN + b"\x00\x00"
    evs = events(s, stream, byte_by_byte=byte_by_byte)
    assert evs == [
        SaslHeaderReceived(),
        AuthRequested("PLAIN", b"\x00alice\x00pw", "vhost"),
        AmqpHeaderReceived(AMQP_HEADER),
    ]
    assert sasl_frames(s.data_to_send()) == [
        SaslMechanisms((Symbol("PLAIN"), Symbol("EXTERNAL"))),
        SaslOutcome(0),
    ]
    assert s.leftover() == AMQP_HEADER + OPEN + b"\x00\x00"
    assert s.init_frame_bytes == INIT
    assert s.user == "alice"
    with pytest.raises(LocalProtocolError):
        s.receive_data(b"more")


def test_mechanisms_sent_as_soon_as_header_arrives():
    s = SaslServer(["PLAIN"])
    s.receive_data(SASL_HEADER)
    assert s.next_event() == SaslHeaderReceived()
    assert s.next_event() is NEED_DATA
    assert sasl_frames(s.data_to_send()) == [SaslMechanisms((Symbol("PLAIN"),))]
    assert s.data_to_send() == b""


def test_reject_queues_outcome_and_ignores_the_rest():
    s = SaslServer(["PLAIN"])
    s.receive_data(SASL_HEADER + INIT)
    assert s.next_event() == SaslHeaderReceived()
    assert isinstance(s.next_event(), AuthRequested)
    s.reject()
    assert s.next_event() == AuthFailed(1, "authentication failed")
    assert s.next_event() is NEED_DATA
    assert sasl_frames(s.data_to_send())[-1] == SaslOutcome(1)
    s.receive_data(b"garbage after failure is ignored")
    assert s.next_event() is NEED_DATA
    with pytest.raises(LocalProtocolError):
        s.accept("late")


def test_unoffered_mechanism_is_rejected_with_auth_code():
    s = SaslServer(["PLAIN"])
    s.receive_data(SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit(Symbol("ANONYMOUS"))))
    evs = events(s, b"")
    assert evs[0] == SaslHeaderReceived()
    assert isinstance(evs[1], AuthFailed) and evs[1].code == 1 and "ANONYMOUS" in evs[1].description
    assert sasl_frames(s.data_to_send())[-1] == SaslOutcome(1)
    assert s.state is SaslState.FAILED


def test_no_sasl_header_reports_nosasl_with_leftover():
    s = SaslServer(["PLAIN", "ANONYMOUS"])
    evs = events(s, AMQP_HEADER + OPEN)
    assert evs == [NoSasl(AMQP_HEADER + OPEN)]
    assert s.leftover() == AMQP_HEADER + OPEN
    assert s.data_to_send() == b""


@pytest.mark.parametrize(
    "data,immediate",
    [
        (TLS_HEADER, False),
        (b"AMQP\x00\x00\x09\x01", False),  # AMQP 0-9-1
        (b"AMQP\x03\x01\x00\x01", False),  # wrong revision
        (b"GET / HTTP/1.1\r\n", True),
        (b"\x16\x03\x01\x02\x00", True),  # TLS ClientHello
    ],
)
def test_wrong_protocol_header(data, immediate):
    s = SaslServer(["PLAIN"])
    fed = b""
    with pytest.raises(NotThisProtocol) as ei:
        for i in range(len(data)):
            fed += data[i : i + 1]
            s.receive_data(data[i : i + 1])
            s.next_event()
    assert ei.value.reply == SASL_HEADER  # §2.2: answer with the header we support
    assert ei.value.data == fed
    if immediate:
        assert len(fed) == 1  # non-AMQP traffic is recognised from its first byte
    assert isinstance(ei.value, RemoteProtocolError)


@pytest.mark.parametrize(
    "after_header,exc",
    [
        (encode_frame(FRAME_SASL, 0, SaslResponse(b"x")), SaslProtocolError),
        (encode_frame(FRAME_AMQP, 0, SaslInit(Symbol("PLAIN"))), SaslProtocolError),
        (encode_frame(FRAME_SASL, 0, Open("c")), SaslProtocolError),
        (b"\x00\x00\x00\x04\x02\x01\x00\x00", FramingError),
        (b"\x00\x01\x00\x00\x02\x01\x00\x00", FramingError),  # 65536 > max 1024
        (b"\x00\x00\x00\x0a\x02\x01\x00\x00\x00\x53", RemoteProtocolError),  # truncated body
    ],
)
def test_bad_sasl_frames(after_header, exc):
    s = SaslServer(["PLAIN"], max_frame_bytes=1024)
    s.receive_data(SASL_HEADER + after_header)
    with pytest.raises(exc):
        while s.next_event() is not NEED_DATA:
            pass
        raise AssertionError("no error")


def test_bad_amqp_header_after_outcome():
    s = SaslServer(["PLAIN"])
    events(s, SASL_HEADER + INIT)
    s.receive_data(SASL_HEADER)  # client restarts SASL instead of sending the AMQP header
    with pytest.raises(NotThisProtocol) as ei:
        s.next_event()
    assert ei.value.reply == AMQP_HEADER


@pytest.mark.parametrize(
    "response,expected",
    [
        (b"\x00alice\x00pw", ("", "alice", "pw")),
        (b"admin\x00alice\x00pw", ("admin", "alice", "pw")),
        (b"\x00j\xc3\xb6rg\x00p\x00", None),
        (b"\x00\x00pw", None),
        (b"alice", None),
        (b"", None),
        (None, None),
        (b"\x00al\xffice\x00pw", None),
        ("\x00ü\x00ö".encode(), ("", "ü", "ö")),
    ],
)
def test_parse_plain(response, expected):
    if expected is None:
        with pytest.raises(RemoteProtocolError) as ei:
            parse_plain(response)
        assert ei.value.condition == "amqp:unauthorized-access"
    else:
        assert parse_plain(response) == expected


# --- SaslClientReplay ---------------------------------------------------------------------------


def upstream_reply(*perfs, extra=b"") -> bytes:
    return SASL_HEADER + b"".join(encode_frame(FRAME_SASL, 0, p) for p in perfs) + extra


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_replay_ok_with_leftover(byte_by_byte):
    rp = SaslClientReplay(SASL_HEADER + INIT)
    assert rp.data_to_send() == SASL_HEADER + INIT
    up = upstream_reply(SaslMechanisms((Symbol("PLAIN"),)), SaslOutcome(0), extra=AMQP_HEADER[:3])
    chunks = [up[i : i + 1] for i in range(len(up))] if byte_by_byte else [up]
    ev = NEED_DATA
    while ev is NEED_DATA:
        rp.receive_data(chunks.pop(0))
        ev = rp.next_event()
    assert isinstance(ev, UpstreamAuthOk)
    # bytes after the outcome: the leftover plus whatever the caller pumps directly afterwards
    assert ev.leftover + b"".join(chunks) == AMQP_HEADER[:3]
    assert rp.upstream_mechanisms == ("PLAIN",)
    with pytest.raises(LocalProtocolError):
        rp.receive_data(b"x")


def test_replay_failure_and_errors():
    rp = SaslClientReplay(SASL_HEADER + INIT)
    rp.receive_data(upstream_reply(SaslMechanisms((Symbol("PLAIN"),)), SaslOutcome(1)))
    assert rp.next_event() == UpstreamAuthFailed(1, b"")

    rp = SaslClientReplay(SASL_HEADER + INIT)
    rp.receive_data(upstream_reply(SaslMechanisms((Symbol("X"),)), SaslChallenge(b"?")))
    with pytest.raises(SaslProtocolError, match="challenge"):
        rp.next_event()

    rp = SaslClientReplay(SASL_HEADER + INIT)
    rp.receive_data(AMQP_HEADER)  # upstream does not do SASL
    with pytest.raises(NotThisProtocol):
        rp.next_event()

    with pytest.raises(LocalProtocolError):
        SaslClientReplay(INIT)


# --- real proton peers -----------------------------------------------------------------------------


def _drain(t: proton.Transport) -> bytes:
    n = t.pending()
    if n <= 0:
        return b""
    data = bytes(t.peek(n))
    t.pop(len(data))
    return data


def _proton_plain_client(user="alice", password="secret", container="client-1", hostname="vh.example"):
    conn = proton.Connection()
    conn.container = container
    conn.hostname = hostname
    conn.user = user
    conn.password = password
    t = proton.Transport()
    sasl = t.sasl()
    sasl.allowed_mechs("PLAIN")
    sasl.allow_insecure_mechs = True  # proton refuses PLAIN in clear text otherwise
    t.bind(conn)
    conn.open()
    return conn, t, sasl


def test_proton_client_authenticates_then_proton_server_takes_leftover():
    conn, ct, csasl = _proton_plain_client()
    s = SaslServer(["PLAIN", "EXTERNAL"])
    server_t = None
    server_conn = None
    seen = []
    for _ in range(20):
        data = _drain(ct)
        if server_t is None:
            if data:
                s.receive_data(data)
            while (ev := s.next_event()) is not NEED_DATA:
                seen.append(type(ev).__name__)
                if isinstance(ev, AuthRequested):
                    _, user, pw = parse_plain(ev.initial_response)
                    assert (user, pw) == ("alice", "secret")
                    s.accept(user)
                elif isinstance(ev, AmqpHeaderReceived):
                    # hand over to proton's engine, created WITHOUT a SASL layer
                    server_t = proton.Transport(proton.Transport.SERVER)
                    server_conn = proton.Connection()
                    server_conn.container = "broker-1"
                    server_t.bind(server_conn)
                    server_t.push(s.leftover())
                    server_conn.open()
                    break
            out = s.data_to_send()
            if out:
                ct.push(out)
        else:
            if data:
                server_t.push(data)
            out = _drain(server_t)
            if out:
                ct.push(out)
        if server_conn is not None and conn.state & proton.Endpoint.REMOTE_ACTIVE:
            break
    assert seen == ["SaslHeaderReceived", "AuthRequested", "AmqpHeaderReceived"]
    assert csasl.outcome == proton.SASL.OK
    assert server_conn.remote_container == "client-1"
    assert server_conn.remote_hostname == "vh.example"
    assert conn.state & proton.Endpoint.REMOTE_ACTIVE
    assert conn.remote_container == "broker-1"


def test_proton_client_sees_rejection():
    conn, ct, csasl = _proton_plain_client(password="wrong")
    s = SaslServer(["PLAIN"])
    failed = None
    for _ in range(10):
        data = _drain(ct)
        if data:
            s.receive_data(data)
        while (ev := s.next_event()) is not NEED_DATA:
            if isinstance(ev, AuthRequested):
                s.reject(1)
            elif isinstance(ev, AuthFailed):
                failed = ev
        out = s.data_to_send()
        if out:
            ct.push(out)
        if failed:
            break
    assert failed == AuthFailed(1, "authentication failed")
    assert csasl.outcome == proton.SASL.AUTH


def test_replay_against_a_real_proton_sasl_server():
    # proton's built-in server SASL does ANONYMOUS without Cyrus: replay an ANONYMOUS init.
    init = SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit(Symbol("ANONYMOUS"), b"anon"))
    up_t = proton.Transport(proton.Transport.SERVER)
    up_sasl = up_t.sasl()
    up_sasl.allowed_mechs("ANONYMOUS")
    up_conn = proton.Connection()
    up_t.bind(up_conn)
    rp = SaslClientReplay(init)
    result = None
    for _ in range(10):
        out = rp.data_to_send()
        if out:
            up_t.push(out)
        data = _drain(up_t)
        if data:
            rp.receive_data(data)
        if (result := rp.next_event()) is not NEED_DATA:
            break
    assert isinstance(result, UpstreamAuthOk)
    assert up_sasl.outcome == proton.SASL.OK
    assert "ANONYMOUS" in rp.upstream_mechanisms
