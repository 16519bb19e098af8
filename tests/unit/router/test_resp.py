"""router.resp: the RESP2 subset of the Redis read path, fed whole and byte by byte."""

from __future__ import annotations

import pytest

from router.resp import NEED_DATA, RespError, RespParser, encode_command

REPLIES = [
    (b"+OK\r\n", "OK"),
    (b"-ERR wrong\r\n", RespError("ERR wrong")),
    (b":42\r\n", 42),
    (b"$-1\r\n", None),
    (b"$0\r\n\r\n", b""),
    (b"$5\r\nnode1\r\n", b"node1"),
    (b"*2\r\n$1\r\na\r\n:1\r\n", [b"a", 1]),
    (b"*-1\r\n", None),
    (b"$4\r\n\xd0\xba\r\n\r\n", "\u043a\r\n".encode()),
]


@pytest.mark.parametrize("raw, value", REPLIES)
def test_replies_whole_and_byte_by_byte(raw, value):
    p = RespParser()
    p.receive_data(raw)
    assert p.next_event() == value
    assert p.next_event() is NEED_DATA
    p = RespParser()
    for i in range(len(raw) - 1):
        p.receive_data(raw[i:i + 1])
        assert p.next_event() is NEED_DATA
    p.receive_data(raw[-1:])
    assert p.next_event() == value


def test_pipelined_replies_come_out_in_order():
    p = RespParser()
    p.receive_data(b"".join(raw for raw, _ in REPLIES))
    assert [p.next_event() for _ in REPLIES] == [v for _, v in REPLIES]
    assert p.next_event() is NEED_DATA


@pytest.mark.parametrize("raw", [b"?x\r\n", b"$3\r\nabcXY", b":x\r\n"])
def test_malformed_replies_raise_value_error(raw):
    p = RespParser()
    p.receive_data(raw)
    with pytest.raises(ValueError):
        p.next_event()


def test_encode_command_bulk_strings_and_surrogates():
    assert encode_command("GETEX", "k", "PX", 500) == b"*4\r\n$5\r\nGETEX\r\n$1\r\nk\r\n$2\r\nPX\r\n$3\r\n500\r\n"
    assert encode_command("GET", "\ud800") == b"*2\r\n$3\r\nGET\r\n$3\r\n\xed\xa0\x80\r\n"
