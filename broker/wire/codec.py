"""Sans-IO AMQP 1.0 type system: encode and decode values (AMQP 1.0 §1.6).

Theory of operation
-------------------
Every encoded value is a *constructor* followed by its data (§1.2). A constructor is either one
format-code byte or ``0x00 <descriptor value> <constructor>`` for a described type (§1.4). The
decoder is a table of 256 "body" readers indexed by format code; ``decode()`` reads the
constructor and calls the body reader, which returns ``(value, next_offset)``. Arrays (§1.6.24)
carry one constructor for all elements, so the same body readers decode array elements.

Safety: the decoder works on a ``memoryview`` and an explicit ``end`` bound. Every read is bounds
checked against ``end`` (a compound's own size field narrows ``end`` for its elements), counts are
checked against the bytes left before any list is allocated, and nesting (compounds and
descriptors) is limited to ``MAX_DEPTH``. Anything malformed raises ``DecodeError`` (condition
``amqp:decode-error``) — never ``IndexError``, ``struct.error`` or ``UnicodeError``.

Python representation
---------------------
=================  ===========================================================================
AMQP type          Python
=================  ===========================================================================
null               ``None``
boolean            ``bool``
ubyte/ushort/uint/ulong   ``UByte``/``UShort``/``UInt``/``ULong`` (``int`` subclasses)
byte/short/int/long       ``Byte``/``Short``/``Int``/``Long`` (``int`` subclasses)
float / double     ``Float`` (``float`` subclass) / ``float``
decimal32/64/128   ``Decimal32``/``Decimal64``/``Decimal128`` (``bytes`` subclasses, raw IEEE 754)
char               ``Char`` (``str`` subclass of length 1)
timestamp          ``Timestamp`` (``int`` subclass, milliseconds since the Unix epoch)
uuid               ``uuid.UUID``
binary             ``bytes`` (``bytearray``/``memoryview`` also encode as binary)
string             ``str``
symbol             ``Symbol`` (``str`` subclass, ASCII only)
list               ``list`` (``tuple`` also encodes as list)
map                ``dict``
array              ``Array`` (``list`` subclass remembering its element format code)
described          ``Described(descriptor, value)``
=================  ===========================================================================

Encoding a plain Python ``int`` produces an AMQP **long** (smalllong 0x55 when it fits in one
byte, else 0x81); a value outside the signed 64-bit range raises ``EncodeError``. Wrapper types
encode as their AMQP type in the smallest exact form (e.g. ``UInt(0)`` as uint0 0x43).
Decoding always returns the wrapper types, so ``decode(encode(v)) == v`` with types preserved.
"""

from __future__ import annotations

import struct
import uuid as _uuid
from dataclasses import dataclass
from typing import Any, Callable

from broker.wire.errors import DecodeError, EncodeError

__all__ = [
    "Symbol", "UByte", "UShort", "UInt", "ULong", "Byte", "Short", "Int", "Long", "Float",
    "Char", "Timestamp", "Decimal32", "Decimal64", "Decimal128", "Described", "Array",
    "decode", "decode_all", "encode", "encode_into", "MAX_DEPTH", "DecodeError", "EncodeError",
]

#: Maximum nesting of compounds and descriptors the decoder accepts (depth-bomb guard).
MAX_DEPTH = 64
#: Arrays of zero-width elements (null, true, false, uint0, ...) cost no bytes per element; cap
#: their count so a 14-byte array32 cannot ask for four billion Python objects.
MAX_ZERO_WIDTH_ARRAY = 4096


# ---------------------------------------------------------------------------------------------
# Python representation of AMQP types
# ---------------------------------------------------------------------------------------------


class Symbol(str):
    """AMQP symbol (§1.6.21): ASCII string used for constants and keys."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Symbol({str.__repr__(self)})"


class _IntWrapper(int):
    __slots__ = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({int(self)})"


class UByte(_IntWrapper):
    """AMQP ubyte (§1.6.3)."""

    __slots__ = ()


class UShort(_IntWrapper):
    """AMQP ushort (§1.6.4)."""

    __slots__ = ()


class UInt(_IntWrapper):
    """AMQP uint (§1.6.5)."""

    __slots__ = ()


class ULong(_IntWrapper):
    """AMQP ulong (§1.6.6)."""

    __slots__ = ()


class Byte(_IntWrapper):
    """AMQP byte (§1.6.7)."""

    __slots__ = ()


class Short(_IntWrapper):
    """AMQP short (§1.6.8)."""

    __slots__ = ()


class Int(_IntWrapper):
    """AMQP int (§1.6.9)."""

    __slots__ = ()


class Long(_IntWrapper):
    """AMQP long (§1.6.10)."""

    __slots__ = ()


class Timestamp(_IntWrapper):
    """AMQP timestamp (§1.6.17): milliseconds since the Unix epoch, signed 64-bit."""

    __slots__ = ()


class Float(float):
    """AMQP float (§1.6.11), IEEE 754 binary32. A plain ``float`` encodes as double."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Float({float(self)!r})"


class Char(str):
    """AMQP char (§1.6.16): one Unicode code point, UTF-32BE on the wire."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Char({str.__repr__(self)})"


class _Decimal(bytes):
    __slots__ = ()
    _width = 0

    def __new__(cls, raw: bytes = b""):
        self = super().__new__(cls, raw)
        if len(self) != cls._width:
            raise EncodeError(f"{cls.__name__} needs exactly {cls._width} raw bytes, got {len(self)}")
        return self

    def __repr__(self) -> str:
        return f"{type(self).__name__}({bytes(self)!r})"


class Decimal32(_Decimal):
    """AMQP decimal32 (§1.6.13), kept as its 4 raw IEEE 754 decimal bytes."""

    __slots__ = ()
    _width = 4


class Decimal64(_Decimal):
    """AMQP decimal64 (§1.6.14), kept as its 8 raw bytes."""

    __slots__ = ()
    _width = 8


class Decimal128(_Decimal):
    """AMQP decimal128 (§1.6.15), kept as its 16 raw bytes."""

    __slots__ = ()
    _width = 16


@dataclass(frozen=True, slots=True)
class Described:
    """A described type (§1.4): ``descriptor`` (usually ``ULong`` or ``Symbol``) and ``value``."""

    descriptor: Any
    value: Any


class Array(list):
    """AMQP array (§1.6.24): every element has the same type.

    ``code`` is the element format code (e.g. 0xa3 for sym8). When ``None`` the encoder infers it
    from the elements. For arrays of described types the elements are ``Described`` values that
    share one descriptor and ``code`` is the code of the described values.
    """

    __slots__ = ("code",)

    def __init__(self, items=(), code: int | None = None):
        super().__init__(items)
        self.code = code

    def __repr__(self) -> str:
        return f"Array({list.__repr__(self)}, code={self.code if self.code is None else hex(self.code)})"


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------

_S_B = struct.Struct(">B").unpack_from
_S_b = struct.Struct(">b").unpack_from
_S_H = struct.Struct(">H").unpack_from
_S_h = struct.Struct(">h").unpack_from
_S_I = struct.Struct(">I").unpack_from
_S_i = struct.Struct(">i").unpack_from
_S_Q = struct.Struct(">Q").unpack_from
_S_q = struct.Struct(">q").unpack_from
_S_f = struct.Struct(">f").unpack_from
_S_d = struct.Struct(">d").unpack_from
_S_II = struct.Struct(">II").unpack_from
_S_BB = struct.Struct(">BB").unpack_from

_Body = Callable[[memoryview, int, int, int], "tuple[Any, int]"]


def _truncated(what: str, pos: int) -> DecodeError:
    return DecodeError(f"truncated {what} at offset {pos}")


def _fixed(width: int, unpack, wrap, what: str) -> _Body:
    def body(buf, pos, end, depth):
        nxt = pos + width
        if nxt > end:
            raise _truncated(what, pos)
        return wrap(unpack(buf, pos)[0]), nxt

    return body


def _const(value) -> _Body:
    def body(buf, pos, end, depth):
        return value, pos

    return body


def _body_boolean(buf, pos, end, depth):
    # §1.6.2 boolean 0x56: one octet, 0x00 false, 0x01 true; anything else is invalid.
    if pos + 1 > end:
        raise _truncated("boolean", pos)
    b = buf[pos]
    if b > 1:
        raise DecodeError(f"invalid boolean octet 0x{b:02x} at offset {pos}")
    return b == 1, pos + 1


def _body_char(buf, pos, end, depth):
    if pos + 4 > end:
        raise _truncated("char", pos)
    cp = _S_I(buf, pos)[0]
    if cp > 0x10FFFF or 0xD800 <= cp <= 0xDFFF:
        raise DecodeError(f"invalid char code point 0x{cp:x} at offset {pos}")
    return Char(chr(cp)), pos + 4


def _body_uuid(buf, pos, end, depth):
    if pos + 16 > end:
        raise _truncated("uuid", pos)
    return _uuid.UUID(bytes=bytes(buf[pos : pos + 16])), pos + 16


def _decimal(width: int, cls) -> _Body:
    def body(buf, pos, end, depth):
        if pos + width > end:
            raise _truncated(cls.__name__, pos)
        return cls(bytes(buf[pos : pos + width])), pos + width

    return body


def _variable(wide: bool, convert, what: str) -> _Body:
    # §1.6.19-21 vbin/str/sym: size (1 or 4 octets) then that many octets.
    if wide:

        def body(buf, pos, end, depth):
            if pos + 4 > end:
                raise _truncated(what + " size", pos)
            n = _S_I(buf, pos)[0]
            start = pos + 4
            stop = start + n
            if stop > end:
                raise DecodeError(f"{what} of {n} bytes at offset {pos} overruns the buffer")
            return convert(buf[start:stop], pos), stop

    else:

        def body(buf, pos, end, depth):
            if pos >= end:
                raise _truncated(what + " size", pos)
            start = pos + 1
            stop = start + buf[pos]
            if stop > end:
                raise DecodeError(f"{what} of {buf[pos]} bytes at offset {pos} overruns the buffer")
            return convert(buf[start:stop], pos), stop

    return body


def _to_bytes(mv, pos):
    return bytes(mv)


def _to_str(mv, pos):
    try:
        return str(mv, "utf-8")
    except UnicodeDecodeError as e:
        raise DecodeError(f"string at offset {pos} is not valid UTF-8: {e.reason}") from None


def _to_symbol(mv, pos):
    try:
        return Symbol(str(mv, "ascii"))
    except UnicodeDecodeError:
        raise DecodeError(f"symbol at offset {pos} is not ASCII") from None


def _compound_header(buf, pos, end, wide: bool, what: str):
    """Read size and count of a list/map/array (§1.6.22-24); return (count, body_pos, stop)."""
    if wide:
        if pos + 8 > end:
            raise _truncated(what + " header", pos)
        size, count = _S_II(buf, pos)
        body_pos = pos + 8
        stop = pos + 4 + size
        if size < 4:
            raise DecodeError(f"{what} size {size} at offset {pos} is smaller than its count field")
    else:
        if pos + 2 > end:
            raise _truncated(what + " header", pos)
        size, count = _S_BB(buf, pos)
        body_pos = pos + 2
        stop = pos + 1 + size
        if size < 1:
            raise DecodeError(f"{what} size 0 at offset {pos} is smaller than its count field")
    if stop > end:
        raise DecodeError(f"{what} of size {size} at offset {pos} overruns the buffer")
    return count, body_pos, stop


def _list_body(wide: bool) -> _Body:
    def body(buf, pos, end, depth):
        if depth >= MAX_DEPTH:
            raise DecodeError(f"nesting deeper than {MAX_DEPTH} at offset {pos}")
        count, p, stop = _compound_header(buf, pos, end, wide, "list")
        if count > stop - p:  # every element takes at least its constructor octet
            raise DecodeError(f"list count {count} at offset {pos} exceeds its {stop - p} bytes")
        out = []
        append = out.append
        d = depth + 1
        for _ in range(count):
            v, p = _decode_value(buf, p, stop, d)
            append(v)
        if p != stop:
            raise DecodeError(f"list at offset {pos} has {stop - p} trailing bytes")
        return out, stop

    return body


def _map_body(wide: bool) -> _Body:
    def body(buf, pos, end, depth):
        if depth >= MAX_DEPTH:
            raise DecodeError(f"nesting deeper than {MAX_DEPTH} at offset {pos}")
        count, p, stop = _compound_header(buf, pos, end, wide, "map")
        if count & 1:
            raise DecodeError(f"map at offset {pos} has an odd element count {count}")
        if count > stop - p:
            raise DecodeError(f"map count {count} at offset {pos} exceeds its {stop - p} bytes")
        out = {}
        d = depth + 1
        for _ in range(count >> 1):
            kpos = p
            k, p = _decode_value(buf, p, stop, d)
            v, p = _decode_value(buf, p, stop, d)
            try:
                if k in out:
                    raise DecodeError(f"duplicate map key {k!r} at offset {kpos}")
                out[k] = v
            except TypeError:
                raise DecodeError(
                    f"map key of type {type(k).__name__} at offset {kpos} is not supported"
                ) from None
        if p != stop:
            raise DecodeError(f"map at offset {pos} has {stop - p} trailing bytes")
        return out, stop

    return body


_ZERO_WIDTH = frozenset({0x40, 0x41, 0x42, 0x43, 0x44, 0x45})


def _array_body(wide: bool) -> _Body:
    def body(buf, pos, end, depth):
        if depth >= MAX_DEPTH:
            raise DecodeError(f"nesting deeper than {MAX_DEPTH} at offset {pos}")
        count, p, stop = _compound_header(buf, pos, end, wide, "array")
        # Element constructor: format code, or 0x00 descriptor constructor (§1.2).
        descriptors = []
        d = depth + 1
        while True:
            if p >= stop:
                raise _truncated("array element constructor", p)
            code = buf[p]
            p += 1
            if code != 0x00:
                break
            if len(descriptors) + depth >= MAX_DEPTH:
                raise DecodeError(f"nesting deeper than {MAX_DEPTH} at offset {p}")
            desc, p = _decode_value(buf, p, stop, d)
            descriptors.append(desc)
        elem = _BODY[code]
        if elem is None:
            raise DecodeError(f"unknown array element format code 0x{code:02x} at offset {p - 1}")
        if code in _ZERO_WIDTH:
            if count > MAX_ZERO_WIDTH_ARRAY:
                raise DecodeError(f"array of {count} zero-width elements at offset {pos} refused")
        elif count > stop - p:
            raise DecodeError(f"array count {count} at offset {pos} exceeds its {stop - p} bytes")
        items = []
        append = items.append
        for _ in range(count):
            v, p = elem(buf, p, stop, d)
            for desc in reversed(descriptors):
                v = Described(desc, v)
            append(v)
        if p != stop:
            raise DecodeError(f"array at offset {pos} has {stop - p} trailing bytes")
        return Array(items, code), stop

    return body


_BODY: list[_Body | None] = [None] * 256
_BODY[0x40] = _const(None)
_BODY[0x41] = _const(True)
_BODY[0x42] = _const(False)
_BODY[0x56] = _body_boolean
_BODY[0x50] = _fixed(1, _S_B, UByte, "ubyte")
_BODY[0x60] = _fixed(2, _S_H, UShort, "ushort")
_BODY[0x70] = _fixed(4, _S_I, UInt, "uint")
_BODY[0x52] = _fixed(1, _S_B, UInt, "smalluint")
_BODY[0x43] = _const(UInt(0))
_BODY[0x80] = _fixed(8, _S_Q, ULong, "ulong")
_BODY[0x53] = _fixed(1, _S_B, ULong, "smallulong")
_BODY[0x44] = _const(ULong(0))
_BODY[0x51] = _fixed(1, _S_b, Byte, "byte")
_BODY[0x61] = _fixed(2, _S_h, Short, "short")
_BODY[0x71] = _fixed(4, _S_i, Int, "int")
_BODY[0x54] = _fixed(1, _S_b, Int, "smallint")
_BODY[0x81] = _fixed(8, _S_q, Long, "long")
_BODY[0x55] = _fixed(1, _S_b, Long, "smalllong")
_BODY[0x72] = _fixed(4, _S_f, Float, "float")
_BODY[0x82] = _fixed(8, _S_d, float, "double")
_BODY[0x74] = _decimal(4, Decimal32)
_BODY[0x84] = _decimal(8, Decimal64)
_BODY[0x94] = _decimal(16, Decimal128)
_BODY[0x73] = _body_char
_BODY[0x83] = _fixed(8, _S_q, Timestamp, "timestamp")
_BODY[0x98] = _body_uuid
_BODY[0xA0] = _variable(False, _to_bytes, "binary")
_BODY[0xB0] = _variable(True, _to_bytes, "binary")
_BODY[0xA1] = _variable(False, _to_str, "string")
_BODY[0xB1] = _variable(True, _to_str, "string")
_BODY[0xA3] = _variable(False, _to_symbol, "symbol")
_BODY[0xB3] = _variable(True, _to_symbol, "symbol")
_BODY[0x45] = _const(None)  # replaced below: list0 must return a fresh list
_BODY[0xC0] = _list_body(False)
_BODY[0xD0] = _list_body(True)
_BODY[0xC1] = _map_body(False)
_BODY[0xD1] = _map_body(True)
_BODY[0xE0] = _array_body(False)
_BODY[0xF0] = _array_body(True)


def _body_list0(buf, pos, end, depth):
    return [], pos


_BODY[0x45] = _body_list0


def _decode_value(buf, pos: int, end: int, depth: int):
    if pos >= end:
        raise _truncated("value (no constructor)", pos)
    code = buf[pos]
    if code == 0x00:
        # §1.4 described type: 0x00 descriptor-value value
        if depth >= MAX_DEPTH:
            raise DecodeError(f"nesting deeper than {MAX_DEPTH} at offset {pos}")
        desc, pos = _decode_value(buf, pos + 1, end, depth + 1)
        value, pos = _decode_value(buf, pos, end, depth + 1)
        return Described(desc, value), pos
    body = _BODY[code]
    if body is None:
        raise DecodeError(f"unknown format code 0x{code:02x} at offset {pos}")
    return body(buf, pos + 1, end, depth)


def decode(data, offset: int = 0, end: int | None = None) -> tuple[Any, int]:
    """Decode one value from ``data`` starting at ``offset``; return ``(value, next_offset)``.

    ``data`` is ``bytes``, ``bytearray`` or ``memoryview``; ``end`` bounds the read (defaults to
    the end of ``data``). Raises ``DecodeError`` on malformed or truncated input.
    """
    buf = data if isinstance(data, memoryview) else memoryview(data)
    if buf.ndim != 1 or buf.itemsize != 1:
        buf = buf.cast("B")
    n = len(buf)
    if end is None or end > n:
        end = n
    if offset < 0:
        raise DecodeError(f"negative offset {offset}")
    return _decode_value(buf, offset, end, 0)


def decode_all(data) -> Any:
    """Decode exactly one value that fills ``data``; trailing bytes are a ``DecodeError``."""
    value, pos = decode(data)
    if pos != len(data):
        raise DecodeError(f"{len(data) - pos} trailing bytes after value")
    return value


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------

_P_B = struct.Struct(">B").pack
_P_b = struct.Struct(">b").pack
_P_H = struct.Struct(">H").pack
_P_h = struct.Struct(">h").pack
_P_I = struct.Struct(">I").pack
_P_i = struct.Struct(">i").pack
_P_Q = struct.Struct(">Q").pack
_P_q = struct.Struct(">q").pack
_P_f = struct.Struct(">f").pack
_P_d = struct.Struct(">d").pack
_P_BB = struct.Struct(">BB").pack
_P_II = struct.Struct(">II").pack


def _range_error(v, what: str) -> EncodeError:
    return EncodeError(f"{v!r} is out of range for AMQP {what}")


def _enc_ubyte(out, v):
    if not 0 <= v <= 0xFF:
        raise _range_error(v, "ubyte")
    out += b"\x50" + _P_B(v)


def _enc_ushort(out, v):
    if not 0 <= v <= 0xFFFF:
        raise _range_error(v, "ushort")
    out += b"\x60" + _P_H(v)


def _enc_uint(out, v):
    if v == 0:
        out.append(0x43)
    elif 0 < v <= 0xFF:
        out += b"\x52" + _P_B(v)
    elif 0 < v <= 0xFFFFFFFF:
        out += b"\x70" + _P_I(v)
    else:
        raise _range_error(v, "uint")


def _enc_ulong(out, v):
    if v == 0:
        out.append(0x44)
    elif 0 < v <= 0xFF:
        out += b"\x53" + _P_B(v)
    elif 0 < v <= 0xFFFFFFFFFFFFFFFF:
        out += b"\x80" + _P_Q(v)
    else:
        raise _range_error(v, "ulong")


def _enc_byte(out, v):
    if not -0x80 <= v <= 0x7F:
        raise _range_error(v, "byte")
    out += b"\x51" + _P_b(v)


def _enc_short(out, v):
    if not -0x8000 <= v <= 0x7FFF:
        raise _range_error(v, "short")
    out += b"\x61" + _P_h(v)


def _enc_int(out, v):
    if -0x80 <= v <= 0x7F:
        out += b"\x54" + _P_b(v)
    elif -0x80000000 <= v <= 0x7FFFFFFF:
        out += b"\x71" + _P_i(v)
    else:
        raise _range_error(v, "int")


def _enc_long(out, v):
    if -0x80 <= v <= 0x7F:
        out += b"\x55" + _P_b(v)
    elif -0x8000000000000000 <= v <= 0x7FFFFFFFFFFFFFFF:
        out += b"\x81" + _P_q(v)
    else:
        raise _range_error(v, "long")


def _enc_timestamp(out, v):
    if not -0x8000000000000000 <= v <= 0x7FFFFFFFFFFFFFFF:
        raise _range_error(v, "timestamp")
    out += b"\x83" + _P_q(v)


def _enc_bool(out, v):
    out.append(0x41 if v else 0x42)


def _enc_none(out, v):
    out.append(0x40)


def _enc_float(out, v):
    try:
        out += b"\x72" + _P_f(v)
    except OverflowError:
        raise _range_error(v, "float") from None


def _enc_double(out, v):
    out += b"\x82" + _P_d(v)


def _enc_char(out, v):
    if len(v) != 1:
        raise EncodeError(f"Char must be exactly one code point, got {v!r}")
    out += b"\x73" + _P_I(ord(v))


def _enc_decimal(out, v):
    out.append({4: 0x74, 8: 0x84, 16: 0x94}[len(v)])
    out += v


def _enc_uuid(out, v):
    out.append(0x98)
    out += v.bytes


def _enc_binary(out, v):
    n = len(v) if not isinstance(v, memoryview) else v.nbytes
    if n <= 0xFF:
        out += _P_BB(0xA0, n)
    elif n <= 0xFFFFFFFF:
        out += b"\xb0" + _P_I(n)
    else:
        raise EncodeError(f"binary of {n} bytes is too large")
    out += v


def _enc_str(out, v):
    try:
        raw = v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EncodeError(f"string cannot be encoded as UTF-8: {e.reason}") from None
    n = len(raw)
    if n <= 0xFF:
        out += _P_BB(0xA1, n)
    elif n <= 0xFFFFFFFF:
        out += b"\xb1" + _P_I(n)
    else:
        raise EncodeError(f"string of {n} bytes is too large")
    out += raw


def _enc_symbol(out, v):
    try:
        raw = v.encode("ascii")
    except UnicodeEncodeError:
        raise EncodeError(f"symbol {v!r} is not ASCII") from None
    n = len(raw)
    if n <= 0xFF:
        out += _P_BB(0xA3, n)
    elif n <= 0xFFFFFFFF:
        out += b"\xb3" + _P_I(n)
    else:
        raise EncodeError(f"symbol of {n} bytes is too large")
    out += raw


def _compound(out, code8: int, code32: int, count: int, body: bytearray):
    size = len(body)
    if size + 1 <= 0xFF and count <= 0xFF:
        out += _P_BB(code8, size + 1)
        out.append(count)
    elif size + 4 <= 0xFFFFFFFF:
        out.append(code32)
        out += _P_II(size + 4, count)
    else:
        raise EncodeError("compound value too large")
    out += body


def _enc_list(out, v):
    if not v:
        out.append(0x45)
        return
    body = bytearray()
    for item in v:
        _encode(body, item)
    _compound(out, 0xC0, 0xD0, len(v), body)


def _enc_map(out, v):
    body = bytearray()
    for k, item in v.items():
        _encode(body, k)
        _encode(body, item)
    _compound(out, 0xC1, 0xD1, 2 * len(v), body)


def _enc_described(out, v):
    out.append(0x00)
    _encode(out, v.descriptor)
    _encode(out, v.value)


# Element encoders for arrays: body only (no constructor), keyed by element format code.
def _eb_fixed(pack, lo, hi, what):
    def enc(out, v):
        if not lo <= v <= hi:
            raise _range_error(v, what)
        out += pack(v)

    return enc


def _eb_var(wide: bool, to_raw):
    def enc(out, v):
        raw = to_raw(v)
        if wide:
            out += _P_I(len(raw))
        elif len(raw) > 0xFF:
            raise EncodeError(f"array element of {len(raw)} bytes does not fit the 8-bit width")
        else:
            out.append(len(raw))
        out += raw

    return enc


def _raw_str(v):
    try:
        return v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise EncodeError(f"string cannot be encoded as UTF-8: {e.reason}") from None


def _raw_sym(v):
    try:
        return v.encode("ascii")
    except UnicodeEncodeError:
        raise EncodeError(f"symbol {v!r} is not ASCII") from None


def _strip(out, v, enc, code):
    # encode normally then drop the constructor octet: used for wide compounds inside arrays
    tmp = bytearray()
    enc(tmp, v)
    if tmp[0] != code:
        raise EncodeError(f"array element {v!r} does not encode with format code 0x{code:02x}")
    out += memoryview(tmp)[1:]


def _eb_list32(out, v):
    body = bytearray()
    for item in v:
        _encode(body, item)
    out += _P_II(len(body) + 4, len(v))
    out += body


def _eb_map32(out, v):
    body = bytearray()
    for k, item in v.items():
        _encode(body, k)
        _encode(body, item)
    out += _P_II(len(body) + 4, 2 * len(v))
    out += body


def _eb_array32(out, v):
    body = bytearray()
    count = _array_elements(body, v)
    out += _P_II(len(body) + 4, count)
    out += body


def _eb_zero(out, v):
    pass


def _eb_bool(out, v):
    out.append(1 if v else 0)


_ELEM_ENC: dict[int, Callable] = {
    0x40: _eb_zero,
    0x56: _eb_bool,
    0x50: _eb_fixed(_P_B, 0, 0xFF, "ubyte"),
    0x60: _eb_fixed(_P_H, 0, 0xFFFF, "ushort"),
    0x70: _eb_fixed(_P_I, 0, 0xFFFFFFFF, "uint"),
    0x52: _eb_fixed(_P_B, 0, 0xFF, "uint"),
    0x80: _eb_fixed(_P_Q, 0, 0xFFFFFFFFFFFFFFFF, "ulong"),
    0x53: _eb_fixed(_P_B, 0, 0xFF, "ulong"),
    0x51: _eb_fixed(_P_b, -0x80, 0x7F, "byte"),
    0x61: _eb_fixed(_P_h, -0x8000, 0x7FFF, "short"),
    0x71: _eb_fixed(_P_i, -0x80000000, 0x7FFFFFFF, "int"),
    0x54: _eb_fixed(_P_b, -0x80, 0x7F, "int"),
    0x81: _eb_fixed(_P_q, -(1 << 63), (1 << 63) - 1, "long"),
    0x55: _eb_fixed(_P_b, -0x80, 0x7F, "long"),
    0x83: _eb_fixed(_P_q, -(1 << 63), (1 << 63) - 1, "timestamp"),
    0x72: lambda out, v: _strip(out, v, _enc_float, 0x72),
    0x82: lambda out, v: out.__iadd__(_P_d(v)),
    0x73: lambda out, v: _strip(out, v, _enc_char, 0x73),
    0x74: lambda out, v: _strip(out, v, _enc_decimal, 0x74),
    0x84: lambda out, v: _strip(out, v, _enc_decimal, 0x84),
    0x94: lambda out, v: _strip(out, v, _enc_decimal, 0x94),
    0x98: lambda out, v: out.__iadd__(v.bytes),
    0xA0: _eb_var(False, bytes),
    0xB0: _eb_var(True, bytes),
    0xA1: _eb_var(False, _raw_str),
    0xB1: _eb_var(True, _raw_str),
    0xA3: _eb_var(False, _raw_sym),
    0xB3: _eb_var(True, _raw_sym),
    0xD0: _eb_list32,
    0xD1: _eb_map32,
    0xF0: _eb_array32,
}

# Zero-width codes are only valid for arrays whose every element has that exact value.
_ZERO_VALUES = {0x41: True, 0x42: False, 0x43: 0, 0x44: 0}


def _infer_elem_code(items) -> int:
    first = items[0]
    t = type(first)
    if first is None:
        return 0x40
    if t is bool:
        return 0x56
    if isinstance(first, Symbol):
        return 0xA3 if all(len(x) <= 0xFF for x in items) else 0xB3
    if isinstance(first, Char):
        return 0x73
    if isinstance(first, str):
        return 0xA1 if all(len(x.encode("utf-8", "surrogatepass")) <= 0xFF for x in items) else 0xB1
    if isinstance(first, (bytes, bytearray)) and not isinstance(first, _Decimal):
        return 0xA0 if all(len(x) <= 0xFF for x in items) else 0xB0
    for cls, code in _ELEM_CODE_BY_TYPE:
        if isinstance(first, cls):
            return code
    raise EncodeError(f"cannot encode {t.__name__} as an array element")


_ELEM_CODE_BY_TYPE = (
    (UByte, 0x50), (UShort, 0x60), (UInt, 0x70), (ULong, 0x80), (Byte, 0x51), (Short, 0x61),
    (Int, 0x71), (Long, 0x81), (Timestamp, 0x83), (Float, 0x72), (float, 0x82), (int, 0x81),
    (Decimal32, 0x74), (Decimal64, 0x84), (Decimal128, 0x94), (_uuid.UUID, 0x98),
    (Array, 0xF0), (dict, 0xD1), (list, 0xD0), (tuple, 0xD0),
)


def _array_elements(body: bytearray, arr) -> int:
    """Write constructor + elements of ``arr`` into body; return the element count."""
    items = list(arr)
    code = getattr(arr, "code", None)
    if not items:
        body.append(code if code is not None else 0x40)
        return 0
    descriptor = None
    described = isinstance(items[0], Described)
    if described:
        descriptor = items[0].descriptor
        values = []
        for it in items:
            if not isinstance(it, Described) or it.descriptor != descriptor:
                raise EncodeError("array elements must all be described by the same descriptor")
            values.append(it.value)
        items = values
        if code is None or isinstance(items[0], Described):
            code = _infer_elem_code(items)
    elif code is None:
        code = _infer_elem_code(items)
    if code in _ZERO_VALUES:
        want = _ZERO_VALUES[code]
        if any(isinstance(x, bool) is not isinstance(want, bool) or x != want for x in items):
            raise EncodeError(f"array code 0x{code:02x} only holds {want!r}")
        enc = _eb_zero
    elif code == 0x45:
        if any(x != [] for x in items):
            raise EncodeError("array code 0x45 (list0) only holds empty lists")
        enc = _eb_zero
    elif code in (0xC0, 0xC1, 0xE0):
        # 8-bit compound element widths are rarely worth the trouble: widen them.
        code = {0xC0: 0xD0, 0xC1: 0xD1, 0xE0: 0xF0}[code]
        enc = _ELEM_ENC[code]
    else:
        enc = _ELEM_ENC.get(code)
        if enc is None:
            raise EncodeError(f"unsupported array element format code 0x{code:02x}")
    if descriptor is not None:
        body.append(0x00)
        _encode(body, descriptor)
    body.append(code)
    try:
        for it in items:
            enc(body, it)
    except (TypeError, AttributeError, struct.error) as e:
        raise EncodeError(f"array element does not fit format code 0x{code:02x}: {e}") from None
    return len(items)


def _enc_array(out, v):
    body = bytearray()
    count = _array_elements(body, v)
    _compound(out, 0xE0, 0xF0, count, body)


_ENC_BY_TYPE: dict[type, Callable] = {
    type(None): _enc_none,
    bool: _enc_bool,
    int: _enc_long,
    float: _enc_double,
    str: _enc_str,
    bytes: _enc_binary,
    bytearray: _enc_binary,
    memoryview: _enc_binary,
    list: _enc_list,
    tuple: _enc_list,
    dict: _enc_map,
    Symbol: _enc_symbol,
    UByte: _enc_ubyte,
    UShort: _enc_ushort,
    UInt: _enc_uint,
    ULong: _enc_ulong,
    Byte: _enc_byte,
    Short: _enc_short,
    Int: _enc_int,
    Long: _enc_long,
    Timestamp: _enc_timestamp,
    Float: _enc_float,
    Char: _enc_char,
    Decimal32: _enc_decimal,
    Decimal64: _enc_decimal,
    Decimal128: _enc_decimal,
    _uuid.UUID: _enc_uuid,
    Described: _enc_described,
    Array: _enc_array,
}

# Order matters for subclasses: the most specific class first.
_ENC_FALLBACK = (
    (bool, _enc_bool), (Symbol, _enc_symbol), (Char, _enc_char), (str, _enc_str),
    (UByte, _enc_ubyte), (UShort, _enc_ushort), (UInt, _enc_uint), (ULong, _enc_ulong),
    (Byte, _enc_byte), (Short, _enc_short), (Int, _enc_int), (Long, _enc_long),
    (Timestamp, _enc_timestamp), (int, _enc_long), (Float, _enc_float), (float, _enc_double),
    (_Decimal, _enc_decimal), (bytes, _enc_binary), (bytearray, _enc_binary),
    (Array, _enc_array), (list, _enc_list), (tuple, _enc_list), (dict, _enc_map),
    (_uuid.UUID, _enc_uuid), (Described, _enc_described),
)


def _encode(out: bytearray, v) -> None:
    enc = _ENC_BY_TYPE.get(type(v))
    if enc is None:
        for cls, fn in _ENC_FALLBACK:
            if isinstance(v, cls):
                enc = fn
                break
        else:
            raise EncodeError(f"cannot encode a {type(v).__name__} as an AMQP value")
    enc(out, v)


def encode_into(out: bytearray, value) -> None:
    """Append the AMQP encoding of ``value`` to ``out`` (see the module docstring for types)."""
    _encode(out, value)


def encode(value) -> bytes:
    """Return the AMQP encoding of ``value``. Raises ``EncodeError`` for unencodable values."""
    out = bytearray()
    _encode(out, value)
    return bytes(out)
