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

from broker.amqp.frames import (
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


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("broker-bad")
    users = write_users_file(tmp / "users.toml", {"app": ("app", ["app"])}, anonymous_roles=["app"])
    b = start_broker(tmp, users_file=users, mechanisms=("PLAIN", "ANONYMOUS"),
                     config={"amqp": {"max-frame-bytes": MAX_FRAME}})
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


def exchange(broker, data: bytes | list[bytes], timeout: float = 10.0) -> bytes:
    """Send ``data`` (a list = separate writes), half-close, and read until the broker closes."""
    host, port = broker.host, broker.port
    with socket.create_connection((host, port), timeout=timeout) as s:
        for chunk in (data if isinstance(data, list) else [data]):
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
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
    out = {"headers": [], "sasl": [], "amqp": [], "close_error": None, "closed": False}
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
            break
        perf = decode_performative(frame.body) if frame.body else None
        if layer == "sasl":
            out["sasl"].append(perf)
            if isinstance(perf, SaslOutcome):
                layer = "sasl-done"
        else:
            out["amqp"].append(perf)
            if isinstance(perf, Close):
                out["closed"] = True
                out["close_error"] = perf.error.condition if perf.error else None
    return out


def amqp_error(broker, payload: bytes | list[bytes]) -> str | None:
    reply = parse_reply(exchange(broker, [SASL_ANON + AMQP_HEADER] + (
        payload if isinstance(payload, list) else [payload])))
    assert reply["headers"][:2] == [SASL_HEADER, AMQP_HEADER]
    assert reply["closed"], reply
    return reply["close_error"]


def test_http_request_gets_our_protocol_header(broker, bystander):
    reply = exchange(broker, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert reply == SASL_HEADER  # §2.2: the header we speak, then close
    bystander()


def test_wrong_protocol_version(broker, bystander):
    assert exchange(broker, b"AMQP\x03\x02\x00\x00") == SASL_HEADER
    bystander()


def test_garbage_sasl_frame(broker, bystander):
    reply = exchange(broker, SASL_HEADER + b"\x00\x00\x00\x10\x02\x01\x00\x00" + b"\xff" * 8)
    assert reply.startswith(SASL_HEADER)
    bystander()


def test_garbage_after_amqp_header(broker, bystander):
    assert amqp_error(broker, b"\x00\x00\x00\x10\x02\x00\x00\x00" + b"\xde\xad\xbe\xef" * 2) in (
        "amqp:decode-error", "amqp:connection:framing-error")
    bystander()


def test_oversized_frame(broker, bystander):
    big = struct.pack(">IBBH", MAX_FRAME * 4, 2, 0, 0) + b"\x00" * (MAX_FRAME * 4 - 8)
    assert amqp_error(broker, [OPEN, big]) == "amqp:connection:framing-error"
    bystander()


def test_truncated_frame_then_eof(broker, bystander):
    # after Open: proton answers the truncated frame + EOF with Close(framing-error)
    begin = bytes.fromhex("0000001f02000000005311c0120540520070000008005200700000080070000000ff")
    err = amqp_error(broker, [OPEN, begin[:-5]])
    assert err == "amqp:connection:framing-error"
    # before Open there is no connection to carry an error: the socket is just closed
    reply = parse_reply(exchange(broker, [SASL_ANON + AMQP_HEADER, OPEN[:-3]]))
    assert reply["headers"] == [SASL_HEADER, AMQP_HEADER] and reply["amqp"] == []
    bystander()


def test_sasl_auth_failure_reply(broker, bystander):
    data = SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", b"\x00app\x00wrong"))
    reply = parse_reply(exchange(broker, data))
    assert reply["sasl"][-1] == SaslOutcome(1)
    bystander()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(min_size=1, max_size=600), split=st.integers(min_value=1, max_value=64))
def test_fuzzed_bytes_after_handshake(broker, bystander, junk, split):
    chunks = [junk[i:i + split] for i in range(0, len(junk), split)]
    data = exchange(broker, [SASL_ANON + AMQP_HEADER, OPEN] + chunks)
    # whatever the bytes, the broker answers within the protocol and closes this connection only
    assert data.startswith(SASL_HEADER)
    bystander()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(min_size=1, max_size=300))
def test_fuzzed_bytes_in_sasl(broker, bystander, junk):
    exchange(broker, SASL_HEADER + junk)
    bystander()
