"""A proxied connection's Open reaches its broker without ``lodestone:follows-redirect`` (issue 19):
a broker redirects only clients that announced it, and a proxied client must come back through
the router, never be sent past it."""

from __future__ import annotations

from broker.wire.frames import (
    AMQP_HEADER,
    FOLLOWS_REDIRECT,
    FRAME_AMQP,
    Open,
    Symbol,
    decode_performative,
    encode_frame,
)
from router.sniff.amqp import Detected, replace_open

EMPTY = encode_frame(FRAME_AMQP, 0)
PIPELINED = bytes.fromhex("0000001f02000000005311c00a05") + b"\x40" * 17  # whatever the client sent next


def _detected(open_: Open, *, empty_first: bool = False, channel: int = 0) -> Detected:
    raw = AMQP_HEADER + (EMPTY if empty_first else b"") + encode_frame(FRAME_AMQP, channel, open_) + PIPELINED
    return Detected(open=open_, user="app", mechanism="PLAIN", client_bytes=raw, sasl_init_bytes=None)


def _open_in(raw: bytes) -> tuple[Open, int, bytes]:
    """(Open, its channel, the bytes after it) parsed from header + frames, skipping empty frames."""
    assert raw.startswith(AMQP_HEADER)
    off = len(AMQP_HEADER)
    while True:
        size = int.from_bytes(raw[off:off + 4], "big")
        if size > 8:
            return decode_performative(raw[off + 8:off + size]), int.from_bytes(raw[off + 6:off + 8], "big"), \
                raw[off + size:]
        off += size


def test_capability_removed_everything_else_kept():
    o = Open(container_id="orders-7", hostname="router.example", max_frame_size=65536, channel_max=255,
             idle_time_out=30000,
             desired_capabilities=(Symbol("ANONYMOUS-RELAY"), Symbol(FOLLOWS_REDIRECT), Symbol("DELAYED_DELIVERY")),
             offered_capabilities=(Symbol(FOLLOWS_REDIRECT),), properties={Symbol("product"): "proton"})
    d = _detected(o, empty_first=True, channel=3)
    assert d.follows_redirect
    out = d.proxied_bytes()
    got, channel, tail = _open_in(out)
    assert channel == 3
    assert tail == PIPELINED
    assert tuple(got.desired_capabilities) == ("ANONYMOUS-RELAY", "DELAYED_DELIVERY")
    assert tuple(got.offered_capabilities) == (FOLLOWS_REDIRECT,)  # only the desire is taken away
    assert (got.container_id, got.hostname, got.max_frame_size, got.channel_max, got.idle_time_out) == \
        ("orders-7", "router.example", 65536, 255, 30000)
    assert got.properties == {"product": "proton"}
    assert out.startswith(AMQP_HEADER + EMPTY)


def test_only_capability_leaves_none():
    o = Open(container_id="c", desired_capabilities=(Symbol(FOLLOWS_REDIRECT),))
    got, _, tail = _open_in(_detected(o).proxied_bytes())
    assert not got.desired_capabilities
    assert tail == PIPELINED


def test_other_clients_replayed_byte_for_byte():
    o = Open(container_id="c", desired_capabilities=(Symbol("ANONYMOUS-RELAY"),))
    d = _detected(o)
    assert d.proxied_bytes() is d.client_bytes


def test_replace_open_without_open_frame_is_an_error():
    import pytest

    with pytest.raises(ValueError):
        replace_open(AMQP_HEADER + EMPTY, Open(container_id="x"))
