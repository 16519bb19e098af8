"""Fuzz the AMQP wire layer: random bytes and mutated valid handshakes, fed whole and byte by
byte, either parse or raise a RemoteProtocolError subclass — never anything else (h11's
afl-server property). Profiles: ``fast`` (default) and ``deep`` (HYPOTHESIS_PROFILE=deep)."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from broker.wire.codec import Symbol, decode, decode_all, encode
from broker.wire.frames import (
    AMQP_HEADER,
    FRAME_AMQP,
    FRAME_SASL,
    NEED_DATA,
    SASL_HEADER,
    FrameReader,
    Open,
    SaslInit,
    decode_performative,
    encode_frame,
)
from broker.wire.sasl import AuthRequested, SaslClientReplay, SaslServer
from broker.wire.frames import SaslMechanisms, SaslOutcome
from broker.wire.errors import RemoteProtocolError
from router.sniff.amqp import Detected, HandshakeSniffer

VALID_HANDSHAKE = (
    SASL_HEADER
    + encode_frame(FRAME_SASL, 0, SaslInit(Symbol("PLAIN"), b"\x00alice\x00secret", "host"))
    + AMQP_HEADER
    + encode_frame(
        FRAME_AMQP,
        0,
        Open("client-1", "vhost", 65536, 100, 30000, None, None, (Symbol("cap"),), None,
             {Symbol("k"): ["v", 1, {b"x": None}]}),
    )
)
UPSTREAM_REPLY = (
    SASL_HEADER
    + encode_frame(FRAME_SASL, 0, SaslMechanisms((Symbol("PLAIN"), Symbol("ANONYMOUS"))))
    + encode_frame(FRAME_SASL, 0, SaslOutcome(0))
    + AMQP_HEADER
)


@st.composite
def mutated(draw, base: bytes):
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[i] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x40, 0xA1, 0xB0, 0xD0, 0xF0]))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 8))]
        else:
            del data[i:]
    return bytes(data)


inputs = st.one_of(st.binary(max_size=400), mutated(VALID_HANDSHAKE))


def _chunks(data: bytes, byte_by_byte: bool):
    return [data[i : i + 1] for i in range(len(data))] if byte_by_byte else [data]


def drive_sasl(data: bytes, byte_by_byte: bool) -> None:
    s = SaslServer(["PLAIN", "ANONYMOUS"], max_frame_bytes=1024)
    for c in _chunks(data, byte_by_byte):
        s.receive_data(c)
        while (ev := s.next_event()) is not NEED_DATA:
            if isinstance(ev, AuthRequested):
                s.accept("u")
            if s.state.name == "DONE":
                s.leftover()
                return
        s.data_to_send()


def drive_sniffer(data: bytes, byte_by_byte: bool, needed: bool) -> None:
    sn = HandshakeSniffer(authenticator_needed=needed, max_handshake_bytes=2048)
    for c in _chunks(data, byte_by_byte):
        sn.receive_data(c)
        while (ev := sn.next_event()) is not NEED_DATA:
            if isinstance(ev, AuthRequested):
                sn.accept("u")
            elif isinstance(ev, Detected):
                assert ev.client_bytes.startswith(AMQP_HEADER)
                assert ev.client_bytes in data
                return
        sn.data_to_send()


def drive_frames(data: bytes, byte_by_byte: bool) -> None:
    r = FrameReader(2048)
    for c in _chunks(data, byte_by_byte):
        r.receive_data(c)
        while (f := r.next_event()) is not NEED_DATA:
            decode_performative(f.body)


def _only_remote_errors(fn, *args):
    try:
        fn(*args)
    except RemoteProtocolError:
        pass


@given(data=inputs, byte_by_byte=st.booleans())
@example(data=VALID_HANDSHAKE, byte_by_byte=True)
@example(data=b"AMQP\x00\x01\x00\x00" + b"\x00" * 100, byte_by_byte=False)
def test_sasl_server_parses_or_raises_remote_error(data, byte_by_byte):
    _only_remote_errors(drive_sasl, data, byte_by_byte)


@given(data=inputs, byte_by_byte=st.booleans(), needed=st.booleans())
@example(data=VALID_HANDSHAKE, byte_by_byte=True, needed=True)
def test_sniffer_parses_or_raises_remote_error(data, byte_by_byte, needed):
    _only_remote_errors(drive_sniffer, data, byte_by_byte, needed)


@given(data=st.one_of(st.binary(max_size=400), mutated(VALID_HANDSHAKE[8:])), byte_by_byte=st.booleans())
def test_frame_reader_parses_or_raises_remote_error(data, byte_by_byte):
    _only_remote_errors(drive_frames, data, byte_by_byte)


@given(data=st.one_of(st.binary(max_size=200), mutated(UPSTREAM_REPLY)), byte_by_byte=st.booleans())
def test_replay_parses_or_raises_remote_error(data, byte_by_byte):
    init = VALID_HANDSHAKE[: VALID_HANDSHAKE.index(AMQP_HEADER)]

    def run():
        rp = SaslClientReplay(init, max_frame_bytes=1024)
        for c in _chunks(data, byte_by_byte):
            rp.receive_data(c)
            if rp.next_event() is not NEED_DATA:
                return

    _only_remote_errors(run)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=20)
    | st.binary(max_size=20) | st.builds(Symbol, st.text("abcxyz:-", max_size=10)) | st.floats(allow_nan=False),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=5) | st.integers(-(2**63), 2**63 - 1), children, max_size=5),
    max_leaves=30,
)


@given(value=values)
def test_codec_round_trip(value):
    assert decode_all(encode(value)) == value


@given(data=st.one_of(st.binary(max_size=300), mutated(encode({Symbol("k"): [1, "a", b"b", [None, 2.5]]}))))
def test_codec_decode_never_crashes(data):
    try:
        decode(data)
    except RemoteProtocolError:
        pass
