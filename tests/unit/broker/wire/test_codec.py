"""AMQP 1.0 type system and frames: hand-built vectors, round trips, malformed input, proton
cross-checks (proton.Data and a real proton Transport reading our redirect/refuse frames)."""

from __future__ import annotations

import struct
import uuid

import proton
import pytest

from broker.wire.codec import (
    MAX_DEPTH,
    Array,
    Byte,
    Char,
    Decimal32,
    Decimal64,
    Decimal128,
    Described,
    Float,
    Int,
    Long,
    Short,
    Symbol,
    Timestamp,
    UByte,
    UInt,
    ULong,
    UShort,
    decode,
    decode_all,
    encode,
)
from broker.wire.frames import (
    AMQP_HEADER,
    CONNECTION_ESTABLISHMENT_FAILED,
    FRAME_AMQP,
    FRAME_SASL,
    NEED_DATA,
    Close,
    Error,
    FrameReader,
    Open,
    SaslChallenge,
    SaslInit,
    SaslMechanisms,
    SaslOutcome,
    SaslResponse,
    close_frames,
    decode_performative,
    encode_frame,
    redirect_frames,
    refuse_frames,
)
from broker.wire.errors import DecodeError, EncodeError, FramingError, RemoteProtocolError

U = uuid.UUID("12345678-9abc-def0-1234-56789abcdef0")

# (value, expected encoding) — built by hand from AMQP 1.0 §1.6.
VECTORS = [
    (None, "40"),
    (True, "41"),
    (False, "42"),
    (UByte(0xAB), "50ab"),
    (UShort(0x1234), "601234"),
    (UInt(0), "43"),
    (UInt(255), "52ff"),
    (UInt(256), "7000000100"),
    (ULong(0), "44"),
    (ULong(7), "5307"),
    (ULong(2**64 - 1), "80ffffffffffffffff"),
    (Byte(-1), "51ff"),
    (Short(-2), "61fffe"),
    (Int(-128), "5480"),
    (Int(128), "7100000080"),
    (Long(127), "557f"),
    (Long(-129), "81ffffffffffffff7f"),
    (1000, "8100000000000003e8"),  # plain int -> long
    (Float(1.0), "723f800000"),
    (1.0, "823ff0000000000000"),
    (Decimal32(b"\x01\x02\x03\x04"), "7401020304"),
    (Decimal64(b"\x00" * 8), "840000000000000000"),
    (Decimal128(b"\xff" * 16), "94" + "ff" * 16),
    (Char("A"), "7300000041"),
    (Timestamp(1), "830000000000000001"),
    (U, "98123456789abcdef0123456789abcdef0"),
    (b"", "a000"),
    (b"\x01\x02", "a0020102"),
    (b"x" * 256, "b000000100" + "78" * 256),
    ("", "a100"),
    ("hé", "a10368c3a9"),
    (Symbol("PLAIN"), "a305504c41494e"),
    (Symbol("s" * 300), "b30000012c" + "73" * 300),
    ([], "45"),
    ([True, None], "c003024140"),
    ({Symbol("a"): UInt(1)}, "c10602a301615201"),
    (Array([Symbol("a"), Symbol("bc")]), "e00702a30161026263"),
    (Array([UInt(1), UInt(2)]), "e00a02700000000100000002"),
    (Array([], code=0xA3), "e00200a3"),
    (Described(ULong(0x10), ["c"]), "005310c00401a10163"),
    (Described(Symbol("x:y"), None), "00a303783a7940"),
]


@pytest.mark.parametrize("value,hexbytes", VECTORS, ids=[repr(v)[:30] for v, _ in VECTORS])
def test_known_vectors_encode_and_decode(value, hexbytes):
    raw = bytes.fromhex(hexbytes)
    assert encode(value) == raw
    decoded = decode_all(raw)
    assert decoded == value
    expected_type = Long if type(value) is int else type(value)
    assert type(decoded) is expected_type


# Wide / non-canonical forms a peer may send: each decodes to the same value and type.
WIDE_FORMS = [
    ("7000000005", UInt(5)),
    ("800000000000000005", ULong(5)),
    ("7100000005", Int(5)),
    ("810000000000000005", Long(5)),
    ("5601", True),
    ("5600", False),
    ("b00000000161", b"a"),
    ("b10000000161", "a"),
    ("b30000000161", Symbol("a")),
    ("d00000000500000001" + "41", [True]),
    ("d1000000080000000241" + "a10162", {True: "b"}),
    ("c00100", []),
    ("f0000000070000000252" + "0102", Array([UInt(1), UInt(2)])),
    ("e0020241", Array([True, True])),  # array of zero-width true
    ("e00a0200a30178a1016101" + "62", Array([Described(Symbol("x"), "a"), Described(Symbol("x"), "b")])),
]


@pytest.mark.parametrize("hexbytes,value", WIDE_FORMS)
def test_wide_forms_decode(hexbytes, value):
    got = decode_all(bytes.fromhex(hexbytes))
    assert got == value
    assert type(got) is type(value)


ROUND_TRIPS = [
    {Symbol("k"): [1, "two", {b"3": Array([Long(4)])}]},
    [Described(ULong(1), [Described(Symbol("inner"), {"a": None})])],
    Array([[1, 2], [3]]),
    Array([{Symbol("a"): 1}]),
    Array([Array([UByte(1)]), Array([UByte(2)])]),
    Array([U, U]),
    Array(["x" * 300]),
    Array([Float(0.5), Float(-2.0)]),
    Array([Char("a"), Char("€")]),
    Array([Timestamp(5), Timestamp(-5)]),
    Array([True, False]),
    Array([None, None]),
    Array([b"a", b"b" * 300]),
    ["x" * 70000],
    list(range(300)),
    {Long(i): str(i) for i in range(200)},
]


@pytest.mark.parametrize("value", ROUND_TRIPS, ids=range(len(ROUND_TRIPS)))
def test_round_trip(value):
    raw = encode(value)
    assert decode_all(raw) == value
    assert encode(decode_all(raw)) == raw


def test_decode_offset_and_end_and_memoryview():
    raw = b"\xff\xff" + encode("abc") + b"\x40"
    v, pos = decode(memoryview(raw), 2)
    assert (v, pos) == ("abc", 7)
    assert decode(raw, pos) == (None, 8)
    with pytest.raises(DecodeError):
        decode(raw, 2, end=5)  # the string overruns the given end


MALFORMED = [
    ("", "empty"),
    ("50", "truncated ubyte"),
    ("70000000", "truncated uint"),
    ("5602", "boolean not 0/1"),
    ("a105616263", "str8 size overruns"),
    ("b0ffffffff00", "vbin32 size overruns"),
    ("a102c328", "invalid utf-8"),
    ("a301ff", "non-ascii symbol"),
    ("73ffffffff", "char out of range"),
    ("730000d800", "char surrogate"),
    ("ff", "unknown code"),
    ("c0", "list truncated header"),
    ("c00000", "list size 0"),
    ("c005ff414141", "list count > bytes"),
    ("c003024140aa", None),  # valid list + trailing byte -> decode_all error
    ("c004024140", "list shorter than size"),
    ("c00402414041", "list with extra bytes inside size"),
    ("c1030141", "odd map count"),
    ("c10502a10161", "map truncated value"),
    ("c10902a10161" + "41a1016140", "duplicate map key"),
    ("c10602c0020141" + "41", "unhashable key"),
    ("d0ffffffff00000000", "list32 size overruns"),
    ("f000000008ffffffff40", "zero-width array bomb"),
    ("e0030270" + "00", "array count > bytes"),
    ("e00201ff", "array unknown element code"),
    ("e00101", "array missing constructor"),
    ("00", "descriptor missing"),
    ("0053", "descriptor truncated"),
    ("005310", "described value missing"),
    ("00" * 200, "descriptor depth bomb"),
]


@pytest.mark.parametrize("hexbytes,why", MALFORMED)
def test_malformed_raises_decode_error(hexbytes, why):
    with pytest.raises(DecodeError) as ei:
        decode_all(bytes.fromhex(hexbytes))
    assert ei.value.condition == "amqp:decode-error"
    assert isinstance(ei.value, RemoteProtocolError)


def _nested(levels: int) -> list:
    value: list = [None]
    for _ in range(levels - 1):
        value = [value]
    return value


def test_nesting_depth_limit():
    ok = _nested(MAX_DEPTH)
    assert decode_all(encode(ok)) == ok
    with pytest.raises(DecodeError, match="nesting"):
        decode_all(encode(_nested(MAX_DEPTH + 1)))
    # a depth bomb far deeper than the limit fails fast, without RecursionError
    bomb = b"\xc0\xff\x01" * 5000
    with pytest.raises(DecodeError):
        decode_all(bomb)
    with pytest.raises(DecodeError):
        decode_all(b"\x00" * 100000)


@pytest.mark.parametrize(
    "value",
    [UByte(256), UShort(-1), UInt(2**32), ULong(-1), Byte(128), Short(2**15), Int(2**31),
     Long(2**63), 2**63, Symbol("é"), object(), Array([UInt(1), "x"]), Char("ab"),
     Array([Described(ULong(1), 1), Described(ULong(2), 1)]), "\ud800"],
    ids=repr,
)
def test_encode_errors(value):
    with pytest.raises(EncodeError):
        encode(value)


# --- proton cross-checks -------------------------------------------------------------------------


def _proton_decode(raw: bytes):
    d = proton.Data()
    assert d.decode(raw) == len(raw)
    d.rewind()
    d.next()
    obj = d.get_object()
    # proton hands binary out as a memoryview into the Data's own buffer: copy it while alive
    return bytes(obj) if isinstance(obj, memoryview) else obj


def test_open_encoded_by_us_decodes_in_proton():
    o = Open("cid", "vhost", 65536, 100, 30000, (Symbol("en-US"),), None, (Symbol("cap"),), None,
             {Symbol("product"): "lodestone"})
    got = _proton_decode(encode(o.to_described()))
    assert got.descriptor == 0x10
    v = got.value
    assert v[0] == "cid" and v[1] == "vhost"
    assert isinstance(v[2], proton.uint) and v[2] == 65536
    assert isinstance(v[3], proton.ushort) and v[3] == 100
    assert list(v[5]) == ["en-US"] and list(v[7]) == ["cap"]
    assert v[9] == {proton.symbol("product"): "lodestone"}


def test_proton_encoded_values_decode_with_us():
    d = proton.Data()
    d.put_object(
        proton.Described(
            proton.ulong(0x10),
            ["cid", "host", proton.uint(1 << 20), proton.ushort(9), proton.uint(1000), None, None,
             proton.Array(proton.UNDESCRIBED, proton.Data.SYMBOL, proton.symbol("a"), proton.symbol("b")),
             None, {proton.symbol("k"): proton.ulong(2), proton.symbol("t"): proton.timestamp(7)}],
        )
    )
    raw = bytes(d.encode())
    o = decode_performative(raw)
    assert o == Open("cid", "host", 1 << 20, 9, 1000, None, None, (Symbol("a"), Symbol("b")), None,
                     {Symbol("k"): ULong(2), Symbol("t"): Timestamp(7)})
    assert type(o.properties[Symbol("t")]) is Timestamp


@pytest.mark.parametrize(
    "pv,ours",
    [
        (proton.ubyte(3), UByte(3)), (proton.ushort(3), UShort(3)), (proton.uint(3), UInt(3)),
        (proton.ulong(3), ULong(3)), (proton.byte(-3), Byte(-3)), (proton.short(-3), Short(-3)),
        (proton.int32(-3), Int(-3)), (-3, Long(-3)), (proton.float32(0.5), Float(0.5)), (0.25, 0.25),
        (proton.char("z"), Char("z")), (proton.timestamp(12), Timestamp(12)), (U, U),
        (b"bin", b"bin"), ("str", "str"), (proton.symbol("sym"), Symbol("sym")), (True, True),
        (proton.decimal32(1), None), ([1, "a"], [Long(1), "a"]),
    ],
    ids=repr,
)
def test_proton_scalars_decode_with_us(pv, ours):
    d = proton.Data()
    d.put_object(pv)
    raw = bytes(d.encode())
    got = decode_all(raw)
    if ours is None:
        assert isinstance(got, Decimal32)
        return
    assert got == ours and type(got) is type(ours)
    # and back: proton reads our encoding of the same value
    back = _proton_decode(encode(ours))
    assert back == pv and type(back) is type(pv)


# --- frames ---------------------------------------------------------------------------------------


PERFORMATIVES = [
    Open("c"),
    Open("c", "h", 512, 1, 0, (Symbol("en"),), (Symbol("fr"),), (Symbol("a"),), (Symbol("b"),),
         {Symbol("x"): [1]}),
    Close(),
    Close(Error(Symbol("amqp:internal-error"), "boom", {Symbol("k"): "v"})),
    SaslMechanisms((Symbol("PLAIN"), Symbol("EXTERNAL"))),
    SaslInit(Symbol("PLAIN"), b"\x00u\x00p", "host"),
    SaslChallenge(b"c"),
    SaslResponse(b"r"),
    SaslOutcome(0),
    SaslOutcome(4, b"more"),
]


@pytest.mark.parametrize("perf", PERFORMATIVES, ids=repr)
def test_performative_frame_round_trip(perf):
    ftype = FRAME_SASL if type(perf).__name__.startswith("Sasl") else FRAME_AMQP
    raw = encode_frame(ftype, 0, perf)
    r = FrameReader(4096)
    r.receive_data(raw)
    f = r.next_event()
    assert (f.type, f.channel, f.size) == (ftype, 0, len(raw))
    assert decode_performative(f.body) == perf
    assert r.next_event() is NEED_DATA


def test_frame_reader_byte_by_byte_with_heartbeats_and_extended_header():
    stream = (
        encode_frame(FRAME_AMQP, 0)  # heartbeat
        + struct.pack(">IBBH", 16, 3, 0, 5) + b"\xee" * 4 + b"\x45\x40\x40\x40"  # doff 3
        + encode_frame(FRAME_AMQP, 7, Close())
    )
    r = FrameReader(1024)
    frames = []
    for i in range(len(stream)):
        r.receive_data(stream[i : i + 1])
        while (f := r.next_event()) is not NEED_DATA:
            frames.append(f)
    assert [(f.channel, f.body) for f in frames] == [
        (0, b""), (5, b"\x45\x40\x40\x40"), (7, encode(Close().to_described()))
    ]
    assert r.consumed == len(stream)


@pytest.mark.parametrize(
    "header,match",
    [
        (struct.pack(">IBBH", 7, 2, 0, 0), "below the 8-byte"),
        (struct.pack(">IBBH", 8, 1, 0, 0), "data offset 1"),
        (struct.pack(">IBBH", 8, 3, 0, 0), "exceeds frame size"),
        (struct.pack(">IBBH", 4097, 2, 0, 0), "exceeds the maximum frame size of 4096"),
        (struct.pack(">I", 0xFFFFFFFF), "exceeds the maximum"),  # seen from 4 bytes alone
    ],
)
def test_frame_reader_rejects_bad_headers(header, match):
    r = FrameReader(4096)
    r.receive_data(header)
    with pytest.raises(FramingError, match=match) as ei:
        r.next_event()
    assert ei.value.condition == "amqp:connection:framing-error"


def test_decode_performative_rejects_non_performatives():
    with pytest.raises(DecodeError):
        decode_performative(encode([1]))
    with pytest.raises(DecodeError, match="mandatory"):
        decode_performative(encode(Described(ULong(0x10), [])))
    with pytest.raises(DecodeError, match="open.hostname"):
        decode_performative(encode(Described(ULong(0x10), ["c", 5])))
    with pytest.raises(DecodeError, match="unexpected bytes"):
        decode_performative(encode(Open("c").to_described()) + b"\x40")
    # symbolic descriptor and unknown performatives
    assert decode_performative(encode(Described(Symbol("amqp:open:list"), ["c"]))) == Open("c")
    begin = decode_performative(encode(Described(ULong(0x11), [])))
    assert begin == Described(ULong(0x11), [])


def _proton_client_reading(data: bytes):
    conn = proton.Connection()
    conn.container = "client"
    t = proton.Transport()
    t.bind(conn)
    conn.open()
    t.peek(t.pending())  # the client's own header + open, not needed here
    t.push(data)
    return conn


def test_redirect_frames_structure_and_proton_reads_them():
    raw = redirect_frames("10.1.2.3", 5673, "use node b", hostname="vh1", container_id="router-1")
    assert raw.startswith(AMQP_HEADER)
    r = FrameReader(4096)
    r.receive_data(raw[8:])
    op = decode_performative(r.next_event().body)
    cl = decode_performative(r.next_event().body)
    # Artemis's failed-establishment Open (see frames.failed_open), with our container id here
    assert op == Open("router-1", max_frame_size=131072, channel_max=65535, idle_time_out=30000,
                      properties={CONNECTION_ESTABLISHMENT_FAILED: True})
    assert cl.error.condition == "amqp:connection:redirect"
    assert cl.error.info == {Symbol("network-host"): "10.1.2.3", Symbol("port"): 5673,
                             Symbol("hostname"): "vh1"}
    assert type(cl.error.info[Symbol("port")]) is Int

    conn = _proton_client_reading(raw)
    cond = conn.remote_condition
    assert cond.name == "amqp:connection:redirect"
    assert cond.description == "use node b"
    assert cond.info == {proton.symbol("network-host"): "10.1.2.3", proton.symbol("port"): 5673,
                         proton.symbol("hostname"): "vh1"}
    assert conn.remote_properties == {proton.symbol("amqp:connection-establishment-failed"): True}
    assert conn.state & proton.Endpoint.REMOTE_CLOSED


def test_redirect_without_hostname_has_no_hostname_key():
    raw = redirect_frames("h", 1, "d")
    r = FrameReader(4096)
    r.receive_data(raw[8:])
    r.next_event()
    assert set(decode_performative(r.next_event().body).error.info) == {"network-host", "port"}


def test_refuse_and_close_frames_read_by_proton():
    conn = _proton_client_reading(refuse_frames("amqp:resource-limit-exceeded", "no broker"))
    assert conn.remote_condition.name == "amqp:resource-limit-exceeded"
    assert conn.remote_condition.description == "no broker"
    assert conn.remote_condition.info is None
    conn = _proton_client_reading(close_frames("amqp:decode-error", "bad frame"))
    assert conn.remote_condition.name == "amqp:decode-error"
    # After our header and open were sent, only the Close goes out.
    only_close = close_frames("amqp:decode-error", "x", header_sent=True, open_sent=True)
    assert decode_performative(only_close[8:]) == Close(Error("amqp:decode-error", "x"))
