"""Fuzz the cluster link's wire format (broker/wire/cluster.py): random bytes, mutated valid
encodings and well-formed AMQP values of the wrong shape either decode or raise ProtocolError —
never anything else (no IndexError, UnicodeError, TypeError...); whatever decodes encodes back to
the same value; and every valid value the strategies build round-trips. Profiles: ``fast``
(default) and ``deep`` (HYPOTHESIS_PROFILE=deep)."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from broker.wire.codec import Described, Symbol, UInt, decode_all, encode
from broker.wire.cluster import (AddressNote, encode_forward_generic)
from broker.wire.cluster import (FORWARD_DESCRIPTOR, NOTIFY_DESCRIPTOR, BackupsNote, BindingNote, Forwarded,
                                     Hello,
                                     ProtocolError, Reset, Unbinding, decode_forward, decode_note, encode_forward,
                                     encode_note)

# -- valid values -------------------------------------------------------------------------------------

names = st.text(min_size=1, max_size=40)
filters = st.text(min_size=1, max_size=60)

forwards = st.builds(
    Forwarded,
    dup_id=st.binary(min_size=1, max_size=256),
    origin=names,
    address=names,
    targets=st.lists(st.tuples(names, names), min_size=1, max_size=6).map(tuple),
    hops=st.integers(0, 255),
    durable=st.booleans(),
    priority=st.integers(0, 9),
    expires=st.integers(0, 2**63 - 1),
    message=st.binary(min_size=1, max_size=300),
    create=st.none() | st.tuples(st.sampled_from(["anycast", "multicast"]), st.none() | filters),
    moved=st.booleans(),
)


@st.composite
def bindings(draw):
    cf = draw(st.lists(filters, max_size=4))
    return BindingNote(draw(names), draw(names), draw(names), draw(st.sampled_from(["anycast", "multicast"])),
                       draw(st.none() | filters), draw(st.integers(len(cf), 2**31)), tuple(cf),
                       draw(st.integers(0, 255)))


notes = st.one_of(
    st.builds(Hello, names, names, names, st.text(max_size=40), st.integers(0, 2**63 - 1),
              st.lists(st.tuples(names, names, st.text(max_size=20)), max_size=4).map(tuple), st.none() | names),
    st.builds(AddressNote, names, st.sampled_from([("anycast",), ("multicast",), ("anycast", "multicast")]),
              st.none() | filters, st.integers(0, 2**63 - 1), names, st.booleans()),
    st.just(Reset()),
    bindings(),
    st.builds(Unbinding, names, names),
    st.builds(BackupsNote, names, st.lists(st.tuples(names, st.text(max_size=20), st.booleans()), max_size=4)
              .map(tuple)),
)


@given(f=forwards)
def test_valid_forwarded_messages_round_trip(f):
    assert decode_forward(encode_forward(f)) == f


@given(f=forwards, big=st.booleans())
def test_the_fast_encoder_writes_what_the_generic_codec_writes(f, big):
    """encode_forward builds the bytes by hand; they must be the generic codec's, byte for byte
    (lists and strings past 255 bytes switch to their 32-bit forms in both)."""
    if big:
        from dataclasses import replace
        f = replace(f, address=f.address * 40, message=f.message * 3)
    assert encode_forward(f) == encode_forward_generic(f)
    assert decode_forward(encode_forward(f)) == f


@given(n=notes)
def test_valid_notifications_round_trip(n):
    assert decode_note(encode_note(n)) == n


# -- anything else ------------------------------------------------------------------------------------

VALID = [
    encode_forward(Forwarded(b"\x01" * 16, "node-a", "orders", (("node-b", "orders"), ("node-c", "q")), 1, True, 4,
                             1_700_000_000_000, b"\x00Sw\xa1\x02hi")),
    encode_note(Hello("node-a", "c", "amqp://h:1", "http://h:2", 5, (("node-b", "amqp://h:3", ""),))),
    encode_note(Reset()),
    encode_note(BindingNote("node-b", "orders", "orders", "multicast", "a = 1", 2, ("b = 2",), 0)),
    encode_note(Unbinding("node-b", "orders")),
]


@st.composite
def mutated(draw):
    data = bytearray(draw(st.sampled_from(VALID)))
    for _ in range(draw(st.integers(1, 6))):
        if not data:
            break
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":  # format codes and sizes that make a decoder misstep
            data[i] = draw(st.sampled_from([0x00, 0x40, 0x41, 0x42, 0x43, 0x45, 0x50, 0x52, 0x53, 0x70, 0x80, 0x83,
                                            0xA0, 0xA1, 0xA3, 0xB0, 0xB1, 0xC0, 0xD0, 0xE0, 0xF0, 0x7F, 0xFF]))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[i:i + draw(st.integers(1, 8))]
        else:
            del data[i:]
    return bytes(data)


# well-formed AMQP values of any shape under the right descriptors: past the codec, into the rules
scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.integers(0, 2**32 - 1).map(UInt)
           | st.text(max_size=8) | st.sampled_from(["binding", "unbinding", "reset", "hello", "anycast", "multicast"])
           | st.binary(max_size=8) | st.builds(Symbol, st.sampled_from(["binding", "anycast", "x"]))
           | st.floats(allow_nan=False))
values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=10) | st.dictionaries(st.text(max_size=3), kids,
                                                                                          max_size=3), max_leaves=25)
shaped = st.builds(lambda d, v: encode(Described(d, v)), st.sampled_from([FORWARD_DESCRIPTOR, NOTIFY_DESCRIPTOR]),
                   st.lists(values, max_size=10))



@st.composite
def one_field_wrong(draw):
    """A valid value with one field (or one field of a nested list) replaced by any value."""
    if draw(st.booleans()):
        fields = decode_all(encode_forward(draw(forwards))).value
        descriptor = FORWARD_DESCRIPTOR
    else:
        fields = decode_all(encode_note(draw(notes))).value
        descriptor = NOTIFY_DESCRIPTOR
    target = fields
    i = draw(st.integers(0, len(target) - 1))
    while isinstance(target[i], list) and target[i] and draw(st.booleans()):
        target = target[i]
        i = draw(st.integers(0, len(target) - 1))
    target[i] = draw(values)
    return encode(Described(descriptor, fields))


inputs = st.one_of(st.binary(max_size=400), mutated(), shaped, one_field_wrong())


def _decodes_or_protocol_error(decode, encode_back, data: bytes) -> None:
    try:
        value = decode(data)
    except ProtocolError as exc:
        assert exc.condition in ("amqp:decode-error", "amqp:invalid-field"), exc.condition
        return
    # what decodes is a valid value: it encodes, and decodes back to itself
    assert decode(encode_back(value)) == value


@given(data=inputs)
@example(data=VALID[0])
@example(data=b"")
@example(data=b"\x00\xa3\x14lodestone:forward:v1\xc0\x01\x00")
def test_decode_forward_decodes_or_raises_protocol_error(data):
    _decodes_or_protocol_error(decode_forward, encode_forward, data)


@given(data=inputs)
@example(data=VALID[3])
@example(data=b"\x00\xa3\x13lodestone:notify:v1\x45")
def test_decode_note_decodes_or_raises_protocol_error(data):
    _decodes_or_protocol_error(decode_note, encode_note, data)


@given(data=st.sampled_from(VALID), cut=st.integers(0, 400))
def test_every_prefix_of_a_valid_encoding_is_a_decode_error(data, cut):
    """A transfer cut short anywhere is not the format (``amqp:decode-error``), never a crash."""
    cut = cut % len(data)
    for decode in (decode_forward, decode_note):
        try:
            decode(data[:cut])
        except ProtocolError as exc:
            assert exc.condition == "amqp:decode-error"
        else:
            raise AssertionError(f"a {cut}-byte prefix decoded")
