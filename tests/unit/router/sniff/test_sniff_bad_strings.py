"""The router's handshake sniffer and invalid UTF-8 in the client's Open: a DecodeError whose reply
is our AMQP header, a failed Open and Close(amqp:decode-error) — fed whole and byte by byte."""

from __future__ import annotations

import pytest

from broker.wire.frames import (
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
from broker.wire.errors import DecodeError
from router.sniff.amqp import HandshakeSniffer

SASL = SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("ANONYMOUS", b""))


def bad_open(field: str) -> bytes:
    frame = encode_frame(FRAME_AMQP, 0, Open("QQQQ" if field == "container-id" else "ok",
                                             hostname="QQQQ" if field == "hostname" else None))
    return frame.replace(b"QQQQ", b"\xff\xfe\xc0\x80")


@pytest.mark.parametrize("field", ["container-id", "hostname"])
@pytest.mark.parametrize("step", [1, 1 << 20])
def test_invalid_utf8_in_the_open_is_a_decode_error(field, step):
    sniffer = HandshakeSniffer(False, mechanisms=("ANONYMOUS",))
    data = SASL + AMQP_HEADER + bad_open(field)
    with pytest.raises(DecodeError) as exc:
        for i in range(0, len(data), step):
            sniffer.receive_data(data[i:i + step])
            while sniffer.next_event() is not NEED_DATA:
                pass
    err = exc.value
    assert err.condition == "amqp:decode-error" and "UTF-8" in err.description
    r = FrameReader()
    r.receive_data(err.reply)
    assert r.next_protocol_header() == AMQP_HEADER
    perfs = [decode_performative(r.next_event().body) for _ in range(2)]
    assert isinstance(perfs[0], Open) and isinstance(perfs[1], Close)
    assert perfs[1].error.condition == "amqp:decode-error"
