"""Fuzz the PROXY v2 reader: random and mutated headers, fed whole and byte by byte, either parse
(and then the header round-trips through build_header) or raise a RemoteProtocolError — never
anything else. Profiles: ``fast`` (default) and ``deep`` (HYPOTHESIS_PROFILE=deep)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from broker.wire.errors import RemoteProtocolError
from broker.wire.proxyproto import NEED_DATA, SIGNATURE, ProxyHeader, ProxyHeaderReader, build_header

VALID = [build_header(("192.0.2.7", 40000), ("198.51.100.1", 5672)),
         build_header(("2001:db8::7", 1), ("2001:db8::1", 2)), build_header(None)]


@st.composite
def mutated(draw):
    data = bytearray(draw(st.sampled_from(VALID)) + draw(st.binary(max_size=40)))
    for _ in range(draw(st.integers(0, 4))):
        i = draw(st.integers(0, len(data) - 1))
        data[i] = draw(st.integers(0, 255))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    return bytes(data)


def check(data: bytes, step: int) -> None:
    r = ProxyHeaderReader()
    try:
        for i in range(0, max(len(data), 1), step):
            r.receive_data(data[i:i + step])
            ev = r.next_event()
            if ev is NEED_DATA:
                continue
            assert isinstance(ev, ProxyHeader)
            assert data[:ev.length].startswith(SIGNATURE)
            assert ev.leftover == data[ev.length:i + step]
            if ev.source is not None and ev.destination is not None:
                again = ProxyHeaderReader()
                again.receive_data(build_header(ev.source, ev.destination))
                assert again.next_event().source == ev.source
            return
    except RemoteProtocolError:
        return


@given(data=st.binary(max_size=300), step=st.integers(1, 64))
def test_random_bytes(data, step):
    check(data, step)
    check(SIGNATURE + data, step)


@given(data=mutated(), step=st.integers(1, 64))
def test_mutated_headers(data, step):
    check(data, step)
    check(data, 1)
