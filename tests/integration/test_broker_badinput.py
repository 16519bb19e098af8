"""Bad input over real sockets: garbage, truncated and oversized frames (and hypothesis-made bytes)
close only the offending connection, with an AMQP error where the protocol has a place for one;
a bystander proton client keeps working throughout."""

from __future__ import annotations

import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proton import Message
from proton.utils import BlockingConnection

from broker.wire.frames import (
    AMQP_HEADER,
    FRAME_AMQP,
    FRAME_SASL,
    SASL_HEADER,
    Close,
    FrameReader,
    NEED_DATA,
    Open,
    SaslInit,
    SaslOutcome,
    decode_performative,
    encode_frame,
)
from tests.brokerproc import start_broker, write_users_file

pytestmark = pytest.mark.slow

MAX_FRAME = 4096
OPEN_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broker-bad")
    users = write_users_file(tmp / "users.toml", {"app": ("app", ["app"])}, anonymous_roles=["app"])
    b = start_broker(tmp, users_file=users, mechanisms=("PLAIN", "ANONYMOUS"),
                     config={"amqp": {"max-frame-bytes": MAX_FRAME, "handshake-timeout-s": OPEN_TIMEOUT_S}})
    yield b
    b.terminate()


@pytest.fixture(scope="module")
def bystander(broker):
    """A proton client connected before the bad input and used after each case."""
    c = BlockingConnection(broker.amqp_url.replace("amqp://", "amqp://app:app@"), timeout=10,
                           allowed_mechs="PLAIN")
    s = c.create_sender("bystander")
    r = c.create_receiver("bystander", credit=10)
    n = [0]

    def check():
        n[0] += 1
        s.send(Message(body=n[0]))
        m = r.receive(timeout=10)
        r.accept()
        assert m.body == n[0]
    yield check
    c.close()


SASL_ANON = SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("ANONYMOUS", b"", "localhost"))
OPEN = encode_frame(FRAME_AMQP, 0, Open("bad-client", max_frame_size=MAX_FRAME))


def exchange(broker, data: bytes | list[bytes], timeout: float = 10.0, half_close: bool = True) -> bytes:
    """Send ``data`` (a list = separate writes), half-close, and read until the broker closes.

    ``half_close=False`` keeps our sending side open: the broker has to end the connection."""
    host, port = broker.host, broker.port
    with socket.create_connection((host, port), timeout=timeout) as s:
        for chunk in (data if isinstance(data, list) else [data]):
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        if half_close:
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        out = bytearray()
        while True:
            try:
                b = s.recv(65536)
            except ConnectionResetError:
                break
            if not b:
                break  # the broker closed the connection (a socket timeout would raise)
            out += b
    return bytes(out)


def parse_reply(data: bytes) -> dict:
    """Split the broker's bytes: SASL outcome, AMQP header, performatives, the Close error."""
    r = FrameReader(1 << 20)
    r.receive_data(data)
    out = {"headers": [], "sasl": [], "amqp": [], "close_error": None, "closed": False, "open_failed": False,
           "trailing": b""}
    layer = None
    while True:
        if layer in (None, "sasl-done"):
            hdr = r.next_protocol_header()
            if hdr is NEED_DATA:
                break
            out["headers"].append(hdr)
            layer = "sasl" if hdr == SASL_HEADER else "amqp"
            continue
        frame = r.next_event()
        if frame is NEED_DATA:
            out["trailing"] = r.peek(r.buffered)
            break
        perf = decode_performative(frame.body) if frame.body else None
        if layer == "sasl":
            out["sasl"].append(perf)
            if isinstance(perf, SaslOutcome):
                layer = "sasl-done"
        else:
            out["amqp"].append(perf)
            if isinstance(perf, Open) and perf.properties:
                out["open_failed"] = any(str(k) == "amqp:connection-establishment-failed" for k in perf.properties)
            if isinstance(perf, Close):
                out["closed"] = True
                out["close_error"] = perf.error.condition if perf.error else None
    return out


def amqp_error(broker, payload: bytes | list[bytes], **kw) -> str | None:
    """Authenticate (ANONYMOUS), send our AMQP header and ``payload``; the Close's condition.

    Whatever went wrong, the broker's reply must be well formed: its AMQP header, an Open first
    (§2.4.1), a Close last and nothing after it."""
    reply = parse_reply(exchange(broker, [SASL_ANON + AMQP_HEADER] + (
        payload if isinstance(payload, list) else [payload]), **kw))
    assert reply["headers"][:2] == [SASL_HEADER, AMQP_HEADER]
    assert reply["closed"], reply
    assert isinstance(reply["amqp"][0], Open) and isinstance(reply["amqp"][-1], Close), reply
    assert reply["trailing"] == b"", reply
    return reply["close_error"]


def test_http_request_gets_our_protocol_header(broker, bystander):
    reply = exchange(broker, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reply == SASL_HEADER  # §2.2: the header we speak, then close
    bystander()


def test_wrong_protocol_version(broker, bystander):
    assert exchange(broker, b"AMQP\x03\x02\x00\x00") == SASL_HEADER
    bystander()


def test_garbage_after_amqp_header(broker, bystander):
    assert amqp_error(broker, b"\x00\x00\x00\x10\x02\x00\x00\x00" + b"\xde\xad\xbe\xef" * 2) in (
        "amqp:decode-error", "amqp:connection:framing-error")
    bystander()


def test_oversized_frame(broker, bystander):
    big = struct.pack(">IBBH", MAX_FRAME * 4, 2, 0, 0) + b"\x00" * (MAX_FRAME * 4 - 8)
    assert amqp_error(broker, [OPEN, big]) == "amqp:connection:framing-error"
    bystander()


BEGIN = bytes.fromhex("0000001f02000000005311c0120540520070000008005200700000080070000000ff")


def test_truncated_frame_then_eof(broker, bystander):
    # after Open: proton answers the truncated frame + EOF with Close(framing-error)
    err = amqp_error(broker, [OPEN, BEGIN[:-5]])
    assert err == "amqp:connection:framing-error"
    bystander()


@pytest.mark.parametrize("cut", [1, 3, 8, len(OPEN) - 1])
def test_truncated_open_then_eof_gets_a_close(broker, bystander, cut):
    # before the client's Open: our header, a failed Open, Close(framing-error)
    reply = parse_reply(exchange(broker, [SASL_ANON + AMQP_HEADER, OPEN[:cut]]))
    assert reply["headers"] == [SASL_HEADER, AMQP_HEADER], reply
    assert [type(p) for p in reply["amqp"]] == [Open, Close] and reply["open_failed"], reply
    assert reply["close_error"] == "amqp:connection:framing-error"
    bystander()


def test_eof_right_after_the_amqp_header_gets_a_close(broker, bystander):
    assert amqp_error(broker, b"") == "amqp:connection:framing-error"
    bystander()


def test_garbage_and_oversized_frames_before_open(broker, bystander):
    assert amqp_error(broker, b"\x00\x00\x00\x10\x02\x00\x00\x00" + b"\xde\xad\xbe\xef" * 2) in (
        "amqp:decode-error", "amqp:connection:framing-error")
    big = struct.pack(">IBBH", MAX_FRAME * 4, 2, 0, 0) + b"\x00" * (MAX_FRAME * 4 - 8)
    assert amqp_error(broker, big) == "amqp:connection:framing-error"
    # the same without our half-close: the broker ends the connection itself
    assert amqp_error(broker, big, half_close=False) == "amqp:connection:framing-error"
    bystander()


def test_begin_before_open_is_illegal(broker, bystander):
    # §2.4.1: Open is the first frame; proton would accept a Begin, the broker does not
    assert amqp_error(broker, BEGIN, half_close=False) == "amqp:illegal-state"
    bystander()


def test_no_open_within_the_handshake_timeout(broker, bystander):
    # authenticated, header sent, then silence: closed after [amqp] handshake-timeout-s
    assert amqp_error(broker, [], half_close=False, timeout=OPEN_TIMEOUT_S + 20) == "amqp:connection:forced"
    bystander()


@pytest.mark.parametrize("header", [b"AMQP\x00\x01\x00\x01", b"AMQP\x03\x01\x00\x00", b"HTTP/1.1"])
def test_bad_amqp_header_after_sasl_gets_our_header(broker, bystander, header):
    # §2.2: a header mismatch is answered with the header we support, then the socket closes
    reply = exchange(broker, [SASL_ANON, header])
    r = parse_reply(reply)
    assert r["headers"] == [SASL_HEADER, AMQP_HEADER] and r["amqp"] == [] and r["trailing"] == b"", r
    assert r["sasl"][-1] == SaslOutcome(0)
    bystander()


@pytest.mark.parametrize("data", [
    SASL_HEADER + b"\x00\x00\x00\x10\x02\x01\x00\x00" + b"\xff" * 8,   # undecodable body
    SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("ANONYMOUS", b"", "localhost"))[:-4],  # cut + EOF
    SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslOutcome(0)),        # a server frame from the client
])
def test_malformed_sasl_gets_a_sys_perm_outcome(broker, bystander, data):
    r = parse_reply(exchange(broker, data))
    assert r["headers"] == [SASL_HEADER] and r["trailing"] == b"", r
    assert r["sasl"][-1] == SaslOutcome(SaslOutcome.SYS_PERM), r
    bystander()


def test_sasl_auth_failure_reply(broker, bystander):
    data = SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", b"\x00app\x00wrong"))
    reply = parse_reply(exchange(broker, data))
    assert reply["sasl"][-1] == SaslOutcome(1)
    bystander()


# Example counts come from the hypothesis profile (tests/conftest.py): ``fast`` (200, the
# default) or ``deep`` (HYPOTHESIS_PROFILE=deep).
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(junk=st.binary(min_size=1, max_size=600), split=st.integers(min_value=1, max_value=64),
       opened=st.booleans())
def test_fuzzed_bytes_after_handshake(broker, bystander, junk, split, opened):
    chunks = [junk[i:i + split] for i in range(0, len(junk), split)]
    # whatever the bytes, before or after the client's Open, the broker answers with a
    # well-formed Close and closes this connection only (amqp_error checks the framing)
    amqp_error(broker, ([OPEN] if opened else []) + chunks)
    bystander()


@FUZZ
@given(junk=st.binary(min_size=1, max_size=300))
def test_fuzzed_bytes_in_sasl(broker, bystander, junk):
    r = parse_reply(exchange(broker, SASL_HEADER + junk))
    # every reply is our SASL header + mechanisms + at most one outcome, nothing half-written
    assert r["headers"][:1] == [SASL_HEADER] and r["trailing"] == b"", r
    bystander()
