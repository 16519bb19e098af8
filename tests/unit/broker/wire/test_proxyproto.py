"""PROXY protocol v2 codec (broker/wire/proxyproto.py): table-driven parse/build, fed whole and byte by byte."""

from __future__ import annotations

import struct

import pytest

from broker.wire.errors import RemoteProtocolError
from broker.wire.proxyproto import (
    NEED_DATA,
    SIGNATURE,
    ProxyHeader,
    ProxyHeaderReader,
    ProxyProtocolError,
    build_header,
    parse_header,
)


def feed_bytewise(data: bytes):
    r = ProxyHeaderReader()
    for i in range(len(data)):
        r.receive_data(data[i:i + 1])
        ev = r.next_event()
        if ev is not NEED_DATA:
            return ev
    return NEED_DATA


@pytest.mark.parametrize("src, dst, want_src, want_dst", [
    (("192.0.2.7", 40000), ("198.51.100.1", 5672), ("192.0.2.7", 40000), ("198.51.100.1", 5672)),
    (("2001:db8::7", 1), ("2001:db8::1", 65535), ("2001:db8::7", 1), ("2001:db8::1", 65535)),
    (("::ffff:192.0.2.7", 9), ("192.0.2.1", 10), ("192.0.2.7", 9), ("192.0.2.1", 10)),   # mapped → IPv4
    (("2001:db8::7", 9), ("192.0.2.1", 10), ("2001:db8::7", 9), ("192.0.2.1", 10)),      # mixed → IPv6
    (("192.0.2.7", 9), None, ("192.0.2.7", 9), ("0.0.0.0", 0)),
])
def test_round_trip(src, dst, want_src, want_dst):
    data = build_header(src, dst)
    assert data.startswith(SIGNATURE) and data[12] == 0x21
    for ev in (parse_header(data + b"AMQP"), feed_bytewise(data + b"AMQP")):
        assert isinstance(ev, ProxyHeader)
        assert ev.source == want_src and ev.destination == want_dst
        assert ev.length == len(data)
    assert parse_header(data + b"AMQP").leftover == b"AMQP"


def test_ipv4_layout_is_the_spec_one():
    data = build_header(("10.0.0.1", 0x1234), ("10.0.0.2", 0x5678))
    assert data == (SIGNATURE + b"\x21\x11\x00\x0c" + bytes([10, 0, 0, 1, 10, 0, 0, 2]) + b"\x12\x34\x56\x78")
    assert parse_header(data).source_text == "10.0.0.1:4660"
    assert parse_header(build_header(("2001:db8::1", 5))).source_text == "[2001:db8::1]:5"


def test_local_has_no_address_and_tlvs_are_skipped():
    local = build_header(None)
    assert local == SIGNATURE + b"\x20\x00\x00\x00"
    ev = parse_header(local + b"rest")
    assert ev.source is None and ev.source_text is None and ev.leftover == b"rest"
    # a PROXY header with TLVs after the addresses (here one NOOP TLV of 3 bytes)
    base = build_header(("192.0.2.7", 1), ("192.0.2.8", 2))
    tlv = b"\x04\x00\x00"
    with_tlv = base[:14] + struct.pack(">H", 12 + len(tlv)) + base[16:] + tlv
    ev = parse_header(with_tlv + b"X")
    assert ev.source == ("192.0.2.7", 1) and ev.leftover == b"X"


def test_needed_never_reads_past_the_header():
    data = build_header(("192.0.2.7", 1), ("192.0.2.8", 2))
    r = ProxyHeaderReader()
    assert r.needed == 16
    r.receive_data(data[:10])
    assert r.needed == 6
    r.receive_data(data[10:16])
    assert r.needed == len(data) - 16
    r.receive_data(data[16:])
    assert r.needed == 0
    assert isinstance(r.next_event(), ProxyHeader)
    with pytest.raises(ProxyProtocolError):
        r.next_event()


@pytest.mark.parametrize("data, why", [
    (b"PROXY TCP4 192.0.2.1 192.0.2.2 1 2\r\n", "version 1"),
    (b"AMQP\x03\x01\x00\x00", "no PROXY v2 signature"),
    (b"GET / HTTP/1.1\r\n", "no PROXY v2 signature"),
    (SIGNATURE + b"\x11\x11\x00\x0c" + b"\x00" * 12, "version 1, only 2"),
    (SIGNATURE + b"\x22\x11\x00\x0c" + b"\x00" * 12, "unknown command"),
    (SIGNATURE + b"\x21\x31\x00\xd8" + b"\x00" * 216, "address family"),
    (SIGNATURE + b"\x21\x12\x00\x0c" + b"\x00" * 12, "not STREAM"),
    (SIGNATURE + b"\x21\x11\x00\x04" + b"\x00" * 4, "too short"),
    (SIGNATURE + b"\x21\x21\x00\x10" + b"\x00" * 16, "too short"),
    (SIGNATURE + b"\x21\x11\xff\xff", "exceeds"),
])
def test_refused_clearly(data, why):
    for feed in (parse_header, feed_bytewise):
        with pytest.raises(ProxyProtocolError, match=why) as exc:
            feed(data)
        assert isinstance(exc.value, RemoteProtocolError)
        assert exc.value.condition == "amqp:connection:framing-error"


def test_partial_input_needs_data():
    data = build_header(("192.0.2.7", 1))
    for n in range(len(data)):
        assert parse_header(data[:n]) is NEED_DATA
    assert parse_header(b"PROX") is NEED_DATA  # could still be the start of a v1 line: no verdict yet
