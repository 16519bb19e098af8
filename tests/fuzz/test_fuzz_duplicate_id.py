"""Fuzz the ``_AMQ_DUPL_ID`` reader (broker.amqp.engine.message_duplicate_id): random bytes and
mutated real messages either give an id (or None) or raise DecodeError / InvalidDuplicateId —
never anything else; for a message proton encoded, the reader agrees with proton's decoder; fed
byte by byte (every prefix), it never fails otherwise. Profiles: ``fast`` (default) and ``deep``
(HYPOTHESIS_PROFILE=deep)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from proton import Message

from broker.amqp.message import may_carry_duplicate_id, message_duplicate_id
from broker.core.duplicates import InvalidDuplicateId
from broker.wire.errors import DecodeError

values = st.one_of(st.text(max_size=40), st.binary(max_size=40), st.integers(-2**63, 2**63 - 1), st.booleans(),
                   st.none(), st.floats(allow_nan=False), st.lists(st.integers(0, 9), max_size=3))
keys = st.one_of(st.just("_AMQ_DUPL_ID"), st.text(max_size=14))


@st.composite
def messages(draw) -> tuple[bytes, dict]:
    props = draw(st.dictionaries(keys, values, max_size=6))
    m = Message(body=draw(st.text(max_size=30)) * draw(st.sampled_from([1, 200])), properties=props or None,
                durable=draw(st.booleans()),
                subject=draw(st.none() | st.text(max_size=10)))
    return m.encode(), props


def _read(data: bytes):
    cheap = may_carry_duplicate_id(data)       # never raises
    try:
        found = message_duplicate_id(data)
    except (DecodeError, InvalidDuplicateId):
        return "refused"
    assert cheap or found is None               # an id is never missed by the cheap test
    return found


@given(data=st.binary(max_size=400))
def test_random_bytes_never_fail_otherwise(data):
    _read(data)
    _read(b"\x00\x53\x74" + data)


@given(m=messages())
def test_the_reader_agrees_with_proton(m):
    data, props = m
    v = props.get("_AMQ_DUPL_ID")
    got = _read(data)
    if v is None:
        assert got is None
    elif isinstance(v, str):
        assert got == (v.encode(), True)
    elif isinstance(v, bytes):
        assert got == (v, False)
    else:
        assert got == "refused"


@given(m=messages(), at=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_mutated_and_cut_messages_never_fail_otherwise(m, at, byte):
    data = m[0]
    i = at % max(len(data), 1)
    _read(data[:i] + bytes((byte,)) + data[i + 1:])
    for n in range(0, len(data), max(1, len(data) // 25)):
        _read(data[:n])
