"""JMS / Artemis message selectors for AMQP messages (pure: no I/O, no clock, no trio).

The AMQP filter ``apache.org:selector-filter:string`` (descriptor 0x0000468C00000004) carries a
JMS 2.0 §3.8.1 selector. This module parses it once and evaluates it against encoded AMQP
messages exactly as Apache ActiveMQ Artemis does (``artemis-selector`` + ``AMQPMessage``).

Theory of operation
-------------------
1. ``parse_selector(text)`` tokenizes and parses with Artemis's ``StrictParser.jj`` grammar
   (precedence climbing instead of one function per level, so a 200-deep selector uses ~600
   Python frames, not 1600). Each grammar action builds its *closure* right away: there is no AST
   walk per message. A node is ``_N(kind, fn)`` where ``fn(view)`` returns a value typed like the
   Java object Artemis would hold (see "Values" below), ``True``/``False`` for TRUE/FALSE and
   ``None`` for NULL/UNKNOWN. Artemis's parse-time checks (``asBooleanExpression``,
   ``checkLessThanOperand``, ``checkEqualOperand``...) are applied on the node kinds.
2. ``Selector.matches(view)`` runs the root closure and is true only for TRUE. Artemis's
   ``FilterImpl.match`` catches any exception thrown while evaluating and returns false; we do the
   same: a runtime type error (arithmetic on a string, ordering a binary) raises the private
   ``_Abort`` which fails the *whole* selector, not just the sub-expression.
3. ``MessageView(data)`` scans the section boundaries of one encoded message on first use
   (skipping values without building them) and decodes a section (header, properties,
   message-annotations, application-properties) only when an identifier needs it, once.
   A section that does not decode, or a field of the wrong type, counts as absent.

Values (Java types as Python types)
-----------------------------------
Artemis compares by Java class, so the evaluator keeps the codec's wrapper types as the class
tag: ``Byte``/``Short``/``Int``/``Long`` = Java Byte/Short/Integer/Long, ``Float`` = Float,
plain ``float`` = Double, ``decimal.Decimal`` = BigDecimal (only from integer literals beyond the
long range), ``str`` = String, ``bool`` = Boolean, ``Symbol``, ``Char``, ``Timestamp`` (Date),
``uuid.UUID`` stay their own (Comparable) classes; binary, lists, maps, decimals are opaque.
Integer literals are Int when they fit 32 bits, else Long (``ConstantExpression``). Application
property values of unsigned types become Long (``AMQPMessage.getApplicationObjectProperty``,
``longValue()``, so a ulong >= 2**63 wraps negative); message-annotation values stay unsigned.

Semantics copied from Artemis (some differ from a literal reading of JMS/SQL)
-------------------------------------------------------------------------------
* Precedence (``StrictParser.jj``): OR < AND < ``=``/``<>``/``IS [NOT] NULL`` < ``<``/``>``/
  ``<=``/``>=``/LIKE/BETWEEN/IN < ``+``/``-`` < ``*``/``/``/``%`` < unary ``+``/``-``/NOT.
  **NOT is a unary operator binding tighter than comparisons**: ``NOT a = 1`` is
  ``(NOT a) = 1``, which is never TRUE. Write ``NOT (a = 1)``. ``%`` is modulo (Artemis extension).
* ``=``: if the left side is NULL the result is UNKNOWN; if only the right side is NULL it is
  FALSE; if both are NULL it is TRUE (``a = b`` with both missing matches). ``<>`` is ``NOT =``.
  Values of different classes are FALSE, not UNKNOWN, except the numeric widenings of
  ``ComparisonExpression.compare``, which depend on the *left* class: Byte -> Short, Int, Long,
  Float, Double; Short -> Int, Long, Float, Double; Int -> Long, Float, Double; Long -> Int,
  Float, Double; Float -> Int, Long (rounded to float32), Double; Double -> Int, Long, Float.
  So ``Short(1) = Byte(1)`` and ``1 = shortProp`` are FALSE; ``shortProp = 1`` is TRUE.
* ``<``, ``>``, ``<=``, ``>=``: NULL on either side is UNKNOWN; different classes are FALSE;
  strings order by UTF-16 code units and booleans FALSE < TRUE when both sides are properties
  (a string/boolean *literal* operand is a parse error, as in Artemis). Doubles order like
  ``Double.compare``: -0.0 < 0.0, NaN is equal to itself and above +Infinity.
* Arithmetic is Java's: Int or Long arithmetic wraps, ``/`` and ``%`` are always double
  (``x / 0`` is +/-Infinity or NaN, not UNKNOWN), ``'a' + x`` concatenates Java's
  ``toString`` of x. A non-number operand (other than a left string for ``+``) aborts the
  selector (no match). Negating a Byte/Short/unsigned value aborts; negating a non-number is NULL.
* LIKE: non-string operand is FALSE; ``%`` and ``_`` wildcards, every other character literal;
  ESCAPE must be one character and only escapes ``%``, ``_`` or itself (elsewhere it is literal).
  We match without regex backtracking (linear), with the same results as Artemis's regex.
* IN: left side must be an identifier (parse error otherwise), a non-string value is UNKNOWN.
* A property used as a boolean (``a``, ``a AND b``, ``NOT a``): NULL is UNKNOWN, a non-boolean
  value is FALSE.
* The AMQP attach path validates with ``SelectorParser.parse``, so an empty selector is invalid
  there (``parse_selector``); queue filters go through ``FilterImpl.createFilter`` which trims and
  treats blank as "no filter" (``compile_filter``).

Identifiers
-----------
Found in Artemis: ``artemis-commons/.../utils/SelectorTranslator.java`` (renames applied to the
selector text on the AMQP attach path, ``AMQPSessionCallback.createSender``),
``artemis-server/.../core/filter/impl/FilterImpl.java`` (``getHeaderFieldValue`` for names
starting with ``AMQ``; a NULL answer falls through) and ``artemis-protocols/artemis-amqp-protocol
/.../broker/AMQPMessage.java`` (``getObjectPropertyForFilter``, ``getObjectProperty``,
``getApplicationObjectProperty``) with ``converter/AMQPMessageIdHelper.java``:

==========================  ==============================================================
JMSDeliveryMode/AMQDurable  'DURABLE' if header.durable else 'NON_DURABLE'; the literals
                            'PERSISTENT'/'NON_PERSISTENT' anywhere become 'DURABLE'/'NON_DURABLE'
JMSPriority/AMQPriority     Integer min(header.priority, 9), default 4
JMSTimestamp/AMQTimestamp   Long properties.creation-time, default 0
JMSExpiration/AMQExpiration Long: absolute-expiry-time if > 0, else arrival + ttl, else 0
JMSMessageID/AMQUserID      message-id's toString (binary as proton-j Binary.toString),
                            prefixed with "ID:" unless it has it; none: the
                            NATIVE_MESSAGE_ID application property
JMSXGroupID/AMQGroupID      properties.group-id
AMQSize / AMQAddress        encoded length (Integer) / properties.to
JMSType                     properties.subject (never the application property)
JMSCorrelationID            string as is (an "ID:AMQP_..." one gets "ID:AMQP_STRING:" in
                            front); uuid -> "ID:AMQP_UUID:<uuid>"; ulong ->
                            "ID:AMQP_ULONG:<n>"; binary -> opaque bytes
JMSXUserID                  properties.user-id decoded as UTF-8
JMSXGroupSeq                Integer properties.group-sequence, default 0
"m.<key>"                   message annotation <key> (``_AMQ_A_B`` tries ``x-opt-A-B`` first);
                            needs a quoted identifier since ``.`` is not an identifier char
anything else               application property (string keys only)
==========================  ==============================================================

JMSRedelivered, JMSDestination, JMSReplyTo, JMSXDeliveryCount are not mapped by Artemis: they
are looked up as application properties, as there. Artemis renames on the text; we rename
tokens, which differs only inside a double-quoted identifier that merely *contains* such a name.
Note: in the AMQP properties list creation-time is field 9 (absolute-expiry-time is 8).

Where we chose (differences from Artemis, all deliberate)
---------------------------------------------------------
* ``XPATH``/``XQUERY`` and the Artemis prefixes ``hyphenated_props:`` /
  ``convert_string_expressions:`` are refused with SelectorError.
* Bounds: more than 64 KiB of UTF-8 or an expression tree deeper than ``MAX_DEPTH`` (200) is a
  SelectorError (Artemis has no limit; a JVM stack overflow there also refuses the selector).
* Values with no deterministic Java ``toString`` (binary -> ``[B@...``) concatenate as ``[B@0``;
  Dates print in UTC. Opaque values (binary, list, map, decimal32/64/128) never compare equal.
* ``__AMQ_CID`` (connection id), broker "extra" properties and ``AMQAddress`` set by routing are
  not in the encoded message: they read NULL / the ``to`` field. ``AMQSize`` is the encoded length.
* TTL-based JMSExpiration needs the arrival time: pass ``MessageView(..., received_ms=)``
  (Artemis uses ``System.currentTimeMillis()`` when it first scans the message).
"""

from __future__ import annotations

import math
import re
import struct
import uuid as _uuid
from datetime import datetime, timezone
from decimal import Decimal
from typing import Any, Callable

from broker.wire.codec import (
    Byte,
    Char,
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
)
from broker.wire.errors import DecodeError, RemoteProtocolError
from broker.wire.frames import MAX_SELECTOR_BYTES

__all__ = [
    "SelectorError",
    "Selector",
    "MessageView",
    "parse_selector",
    "compile_filter",
    "SELECTOR_FILTER_NAME",
    "SELECTOR_FILTER_CODE",
    "MAX_SELECTOR_BYTES",
    "MAX_DEPTH",
]

#: The filter's symbolic and numeric descriptors (Artemis ``AmqpSupport.JMS_SELECTOR_*``).
SELECTOR_FILTER_NAME = Symbol("apache.org:selector-filter:string")
SELECTOR_FILTER_CODE = ULong(0x0000468C00000004)
#: Deepest expression tree (and parser nesting) accepted.
MAX_DEPTH = 200


class SelectorError(RemoteProtocolError):
    """The peer sent a selector we cannot parse; Artemis refuses the attach with invalid-field."""

    condition = "amqp:invalid-field"


class _Abort(Exception):
    """A Java RuntimeException during evaluation: Artemis's FilterImpl.match returns false."""


# ---------------------------------------------------------------------------------------------
# Java numeric helpers
# ---------------------------------------------------------------------------------------------

_f32 = struct.Struct(">f")


def _wrap32(v: int) -> int:
    return ((v + 0x80000000) & 0xFFFFFFFF) - 0x80000000


def _wrap64(v: int) -> int:
    return ((v + 0x8000000000000000) & 0xFFFFFFFFFFFFFFFF) - 0x8000000000000000


def _to_f32(x: float) -> float:
    try:
        return _f32.unpack(_f32.pack(x))[0]
    except OverflowError:  # beyond float32 range: Java rounds to infinity
        return math.copysign(math.inf, x)


def _cmp_double(a: float, b: float) -> int:
    """``Double.compare``: a total order with -0.0 < 0.0 and NaN above everything, equal to NaN."""
    if a < b:
        return -1
    if a > b:
        return 1
    an, bn = a != a, b != b
    if an or bn:
        return an - bn
    if a == 0.0:
        sa, sb = math.copysign(1.0, a), math.copysign(1.0, b)
        return (sa > sb) - (sa < sb)
    return 0


def _java_float_str(x: float, single: bool) -> str:
    """``Double.toString`` / ``Float.toString`` (shortest repr, Java's layout)."""
    if x != x:
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    if x == 0.0:
        return "-0.0" if math.copysign(1.0, x) < 0 else "0.0"
    if single:
        for p in range(1, 10):
            s = f"{x:.{p}g}"
            if _to_f32(float(s)) == x:
                break
    else:
        s = repr(x)
    sign, digits, exp = Decimal(s).normalize().as_tuple()
    ds = "".join(map(str, digits))
    e10 = len(ds) + exp - 1  # exponent of the first digit
    neg = "-" if sign else ""
    if -3 <= e10 < 7:
        if e10 >= 0:
            ip, fp = ds[: e10 + 1].ljust(e10 + 1, "0"), ds[e10 + 1 :]
        else:
            ip, fp = "0", "0" * (-e10 - 1) + ds
        return f"{neg}{ip}.{fp or '0'}"
    return f"{neg}{ds[0]}.{ds[1:] or '0'}E{e10}"


def _java_str(v: Any) -> str:
    """Java ``String.valueOf`` of an evaluated value, for ``'text' + value``."""
    t = type(v)
    if t is str or t is Symbol or t is Char:
        return str(v)
    if t is bool:
        return "true" if v else "false"
    if t is float:
        return _java_float_str(v, False)
    if t is Float:
        return _java_float_str(v, True)
    if t is Timestamp:
        # java.util.Date.toString in the JVM's zone; we print UTC.
        try:
            d = datetime.fromtimestamp(int(v) / 1000, timezone.utc)
            return d.strftime("%a %b %d %H:%M:%S UTC %Y")
        except (OverflowError, OSError, ValueError):
            return str(int(v))
    if isinstance(v, int):
        return str(int(v))
    if t is Decimal or t is _uuid.UUID:
        return str(v)
    if t is bytes:
        return "[B@0"  # Java prints an identity hash here: not reproducible
    return str(v)


# Java class tags used by ComparisonExpression.compare.
_BYTE, _SHORT, _INT, _LONG, _FLOAT, _DOUBLE = range(6)
_KIND = {
    Byte: _BYTE, Short: _SHORT, Int: _INT, Long: _LONG, Float: _FLOAT, float: _DOUBLE,
    Decimal: "bigdecimal", str: "string", Symbol: "symbol", Char: "char", bool: "boolean",
    Timestamp: "date", _uuid.UUID: "uuid", UByte: "ubyte", UShort: "ushort", UInt: "uint",
    ULong: "ulong",
}
_INTEGRAL = frozenset({_BYTE, _SHORT, _INT, _LONG, "ubyte", "ushort", "uint", "ulong", "date",
                       "boolean"})
_TEXT = frozenset({"string", "symbol", "char"})
# compare(): for lc != rc, which right classes the left class widens to (or the right widens to).
_WIDEN = {
    _BYTE: frozenset({_SHORT, _INT, _LONG, _FLOAT, _DOUBLE}),
    _SHORT: frozenset({_INT, _LONG, _FLOAT, _DOUBLE}),
    _INT: frozenset({_LONG, _FLOAT, _DOUBLE}),
    _LONG: frozenset({_INT, _FLOAT, _DOUBLE}),
    _FLOAT: frozenset({_INT, _LONG, _DOUBLE}),
    _DOUBLE: frozenset({_INT, _LONG, _FLOAT}),
}
_NUMBER_KINDS = frozenset({_BYTE, _SHORT, _INT, _LONG, _FLOAT, _DOUBLE, "bigdecimal", "ubyte",
                           "ushort", "uint", "ulong"})


def _utf16(s: str) -> bytes:
    # Java's String.compareTo orders UTF-16 code units; big-endian bytes order the same way.
    return s.encode("utf-16-be", "surrogatepass")


def _uuid_key(u: _uuid.UUID) -> tuple[int, int]:
    # java.util.UUID.compareTo compares the two halves as *signed* longs.
    i = u.int
    return _wrap64(i >> 64), _wrap64(i & 0xFFFFFFFFFFFFFFFF)


def _compare(lv: Any, rv: Any) -> int | None:
    """``ComparisonExpression.compare`` on two non-null Comparables: -1/0/1, or None for FALSE."""
    lk = _KIND.get(type(lv))
    rk = _KIND.get(type(rv))
    if lk != rk:
        if lk not in _WIDEN or rk not in _WIDEN[lk]:
            return None
        if lk == _FLOAT and rk in (_INT, _LONG):
            return _cmp_double(lv, _to_f32(float(rv)))
        if rk == _FLOAT and lk in (_BYTE, _SHORT, _INT, _LONG):
            return _cmp_double(_to_f32(float(lv)), rv)
        if lk in (_FLOAT, _DOUBLE) or rk in (_FLOAT, _DOUBLE):
            return _cmp_double(float(lv), float(rv))
        return (lv > rv) - (lv < rv)
    if lk in _INTEGRAL or lk == "bigdecimal":
        return (lv > rv) - (lv < rv)
    if lk == _FLOAT or lk == _DOUBLE:
        return _cmp_double(lv, rv)
    if lk in _TEXT:
        if lv == rv:
            return 0
        a, b = _utf16(lv), _utf16(rv)
        return (a > b) - (a < b)
    if lk == "uuid":
        a, b = _uuid_key(lv), _uuid_key(rv)
        return (a > b) - (a < b)
    return None  # not reached: callers check comparability first


def _equal(lv: Any, rv: Any) -> bool | None:
    """Artemis ``=`` (doCreateEqual.evaluate), including its NULL asymmetry."""
    if lv is None:
        return None if rv is not None else True
    if rv is None:
        return False
    if type(lv) in _KIND and type(rv) in _KIND:
        return _compare(lv, rv) == 0
    return False  # binary, lists, maps: Java equals is identity (or never met in practice)


# ---------------------------------------------------------------------------------------------
# Arithmetic (ArithmeticExpression / UnaryExpression.negate)
# ---------------------------------------------------------------------------------------------


def _as_number(v: Any) -> Any:
    if type(v) in _KIND and _KIND[type(v)] in _NUMBER_KINDS:
        return v
    raise _Abort(f"cannot convert {v!r} into a number")


def _number_type(a: Any, b: Any) -> int:
    ta, tb = type(a), type(b)
    if ta is float or ta is Float or tb is float or tb is Float:
        return _DOUBLE
    if ta is Long or tb is Long:
        return _LONG
    return _INT


def _div(a: float, b: float) -> float:
    try:
        return a / b
    except ZeroDivisionError:
        if a == 0.0 or a != a:
            return math.nan
        return math.copysign(math.inf, a) * math.copysign(1.0, b)


def _mod(a: float, b: float) -> float:
    try:
        return math.fmod(a, b)
    except ValueError:  # x % 0.0 and Infinity % y are NaN in Java
        return math.nan


def _arith(op: str, a: Any, b: Any) -> Any:
    if op == "+" and type(a) is str:
        return a + _java_str(b)
    a = _as_number(a)
    b = _as_number(b)
    if op == "/":
        return _div(float(a), float(b))
    if op == "%":
        return _mod(float(a), float(b))
    nt = _number_type(a, b)
    if nt == _DOUBLE:
        x, y = float(a), float(b)
        return x + y if op == "+" else x - y if op == "-" else x * y
    # Java: left.intValue() op right.intValue() (or longValue()), wrapping on overflow.
    wrap = _wrap64 if nt == _LONG else _wrap32
    x, y = wrap(int(a)), wrap(int(b))
    r = wrap(x + y if op == "+" else x - y if op == "-" else x * y)
    return Long(r) if nt == _LONG else Int(r)


def _negate(v: Any) -> Any:
    t = type(v)
    if v is None:
        return None
    if t is Int:
        return Int(_wrap32(-v))
    if t is Long:
        return Long(_wrap64(-v))
    if t is Float:
        return Float(-v)
    if t is float:
        return -v
    if t is Decimal:
        r = -v
        return Long(int(r)) if r == -(1 << 63) else r
    if t in _KIND and _KIND[t] in _NUMBER_KINDS:
        raise _Abort(f"don't know how to negate {v!r}")
    return None


# ---------------------------------------------------------------------------------------------
# LIKE
# ---------------------------------------------------------------------------------------------

_ANY1 = object()


def _like_matcher(pattern: str, escape: str | None) -> Callable[[str], bool]:
    """Compile a LIKE pattern into a linear-time matcher with Artemis's escape rules."""
    # Items: a literal character, _ANY1 for `_`, None for `%`.
    items: list[Any] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if escape is not None and c == escape and i + 1 < n and pattern[i + 1] in ("_", "%", escape):
            items.append(pattern[i + 1])
            i += 2
            continue
        items.append(None if c == "%" else _ANY1 if c == "_" else c)
        i += 1
    # Split on `%` into fixed-length segments; each becomes an anchored-free regex of literals
    # and `.`. Matching: first segment at 0, last at the end, middle ones leftmost in between.
    # A `%` absorbs anything, so leftmost placement is always optimal: no backtracking.
    segs: list[list[Any]] = [[]]
    for it in items:
        if it is None:
            segs.append([])
        else:
            segs[-1].append(it)

    def rx(seg):
        return re.compile("".join("." if x is _ANY1 else re.escape(x) for x in seg), re.DOTALL)

    if len(segs) == 1:
        whole = rx(segs[0])
        return lambda s: whole.fullmatch(s) is not None
    first, last, mids = segs[0], segs[-1], [rx(s) for s in segs[1:-1] if s]
    first_rx, last_rx, nf, nl = rx(first), rx(last), len(first), len(last)

    def match(s: str) -> bool:
        n = len(s)
        if n < nf + nl or not first_rx.match(s, 0, nf) or not last_rx.match(s, n - nl, n):
            return False
        pos, stop = nf, n - nl
        for m_rx in mids:
            m = m_rx.search(s, pos, stop)
            if m is None:
                return False
            pos = m.end()
        return True

    return match


# ---------------------------------------------------------------------------------------------
# Message view
# ---------------------------------------------------------------------------------------------

_HEADER, _DANN, _MANN, _PROPS, _APP = 0x70, 0x71, 0x72, 0x73, 0x74
_SECTION_SYMBOLS = {
    "amqp:header:list": 0x70, "amqp:delivery-annotations:map": 0x71,
    "amqp:message-annotations:map": 0x72, "amqp:properties:list": 0x73,
    "amqp:application-properties:map": 0x74, "amqp:data:binary": 0x75,
    "amqp:amqp-sequence:list": 0x76, "amqp:amqp-value:*": 0x77, "amqp:footer:map": 0x78,
}
_FIXED_WIDTH = {
    0x40: 0, 0x41: 0, 0x42: 0, 0x43: 0, 0x44: 0, 0x45: 0, 0x50: 1, 0x51: 1, 0x52: 1, 0x53: 1,
    0x54: 1, 0x55: 1, 0x56: 1, 0x60: 2, 0x61: 2, 0x70: 4, 0x71: 4, 0x72: 4, 0x73: 4, 0x74: 4,
    0x80: 8, 0x81: 8, 0x82: 8, 0x83: 8, 0x84: 8, 0x94: 16, 0x98: 16,
}
_SIZE1 = frozenset({0xA0, 0xA1, 0xA3, 0xC0, 0xC1, 0xE0})
_SIZE4 = frozenset({0xB0, 0xB1, 0xB3, 0xD0, 0xD1, 0xF0})


def _skip(buf: memoryview, pos: int, end: int) -> int:
    """Offset just past the value at ``pos`` without building it (iterative: no depth bomb)."""
    pending = 1
    while pending:
        if pos >= end:
            raise DecodeError(f"truncated value at offset {pos}")
        code = buf[pos]
        pos += 1
        if code == 0x00:
            pending += 1  # a descriptor value, then the described value
            continue
        if code in _FIXED_WIDTH:
            pos += _FIXED_WIDTH[code]
        elif code in _SIZE1:
            if pos >= end:
                raise DecodeError(f"truncated size at offset {pos}")
            pos += 1 + buf[pos]
        elif code in _SIZE4:
            if pos + 4 > end:
                raise DecodeError(f"truncated size at offset {pos}")
            pos += 4 + int.from_bytes(buf[pos : pos + 4], "big")
        else:
            raise DecodeError(f"unknown format code 0x{code:02x} at offset {pos - 1}")
        pending -= 1
    if pos > end:
        raise DecodeError("value overruns the message")
    return pos


def _field(lst: list | None, i: int, *types: type) -> Any:
    if lst is None or i >= len(lst):
        return None
    v = lst[i]
    return v if isinstance(v, types) else None


def _app_value(v: Any) -> Any:
    # AMQPMessage.getApplicationObjectProperty: unsigned numbers become Long (longValue()).
    t = type(v)
    if t is UByte or t is UShort or t is UInt or t is ULong:
        return Long(_wrap64(int(v)))
    return v


def _binary_str(b: bytes) -> str:
    # proton-j Binary.toString
    return "".join(chr(c) if 31 < c < 127 and c != 0x5C else f"\\x{c:02x}" for c in b)


_ID_PREFIXES = ("AMQP_BINARY:", "AMQP_UUID:", "AMQP_ULONG:", "AMQP_STRING:", "AMQP_NO_PREFIX:")


class MessageView:
    """A lazy, read-only view of one encoded AMQP message (bare or annotated, §3.2).

    Nothing is decoded until asked; each section is decoded at most once and cached. Malformed
    input never raises: a section that cannot be decoded reads as absent. ``received_ms`` is the
    broker's arrival time (ms since the epoch), needed only for TTL-based JMSExpiration.
    """

    __slots__ = ("data", "received_ms", "_bounds", "_cache")

    def __init__(self, data: bytes, *, received_ms: int | None = None):
        self.data = data
        self.received_ms = received_ms
        self._bounds: dict[int, tuple[int, int]] | None = None
        self._cache: dict[int, Any] = {}

    # -- scanning and decoding ------------------------------------------------------------

    def _scan(self) -> dict[int, tuple[int, int]]:
        bounds: dict[int, tuple[int, int]] = {}
        buf = memoryview(self.data)
        n = len(buf)
        pos = 0
        try:
            while pos < n:
                if buf[pos] != 0x00:
                    break  # not a section: the rest is unusable
                desc, vpos = decode(buf, pos + 1, n)
                code = _SECTION_SYMBOLS.get(desc) if type(desc) is Symbol else desc
                if type(code) not in (ULong, int) or not 0x70 <= code <= 0x78:
                    break
                vend = _skip(buf, vpos, n)
                if code >= 0x75:
                    break  # body or footer: Artemis stops scanning here too
                bounds.setdefault(int(code), (vpos, vend))
                pos = vend
        except DecodeError:
            pass  # keep the sections found before the damage
        return bounds

    def _section(self, code: int, want: type) -> Any:
        try:
            return self._cache[code]
        except KeyError:
            pass
        if self._bounds is None:
            self._bounds = self._scan()
        value = None
        b = self._bounds.get(code)
        if b is not None:
            try:
                v, _ = decode(memoryview(self.data), b[0], b[1])
                value = v if isinstance(v, want) else None
            except DecodeError:
                value = None
        if value is not None and code == _APP:
            # Only string keys are application properties (Map<String, Object> in Artemis).
            value = {k: _app_value(v) for k, v in value.items() if type(k) is str}
        elif value is not None and code == _MANN:
            value = {k: v for k, v in value.items() if type(k) is Symbol}
        self._cache[code] = value
        return value

    def _header(self) -> list | None:
        return self._section(_HEADER, list)

    def _props(self) -> list | None:
        return self._section(_PROPS, list)

    # -- what the broker needs --------------------------------------------------------------

    @property
    def durable(self) -> bool:
        """Header ``durable`` (default false)."""
        return _field(self._header(), 0, bool) is True

    @property
    def priority(self) -> int:
        """Header ``priority`` as sent (0..255, default 4). Artemis clamps it to 9 internally."""
        p = _field(self._header(), 1, int)
        return 4 if p is None or isinstance(p, bool) or not 0 <= p <= 255 else int(p)

    @property
    def ttl(self) -> int | None:
        """Header ``ttl`` in milliseconds, or None."""
        t = _field(self._header(), 2, int)
        return None if t is None or isinstance(t, bool) or t < 0 else int(t)

    @property
    def absolute_expiry_time(self) -> int | None:
        """Properties ``absolute-expiry-time`` (field 8), ms since the epoch, or None."""
        t = _field(self._props(), 8, Timestamp)
        return None if t is None else int(t)

    @property
    def creation_time(self) -> int | None:
        """Properties ``creation-time`` (field 9), ms since the epoch, or None."""
        t = _field(self._props(), 9, Timestamp)
        return None if t is None else int(t)

    @property
    def expiration(self) -> int:
        """Artemis's expiration in ms (0 = never): absolute-expiry-time when > 0, else
        ``received_ms + ttl`` when both are known."""
        a = self.absolute_expiry_time
        if a is not None and a > 0:
            return a
        t = self.ttl
        if t is not None and self.received_ms is not None:
            return self.received_ms + t
        return 0

    # -- selector identifiers -----------------------------------------------------------------

    def application_property(self, name: str) -> Any:
        app = self._section(_APP, dict)
        return None if app is None else app.get(name)

    def annotation(self, key: str) -> Any:
        """``AMQPMessage.getMessageAnnotation(String)``: ``_AMQ_X_Y`` also tries ``x-opt-X-Y``."""
        ann = self._section(_MANN, dict)
        if ann is None:
            return None
        if key.startswith("_AMQ_") and not key.startswith("x-opt-"):
            v = ann.get("x-opt-" + key[5:].replace("_", "-"))
            if v is not None:
                return v
        return ann.get(key)


# Identifier resolvers: (view) -> Java-typed value or None. See the module docstring.

def _id_amq_user_id(m: MessageView) -> Any:
    mid = _field(m._props(), 0, object)
    if mid is None:
        native = m.application_property("NATIVE_MESSAGE_ID")
        if native is not None and type(native) is not str:
            raise _Abort("NATIVE_MESSAGE_ID is not a string")  # (String) cast in Artemis
        return native
    if type(mid) is str:
        s = mid
    elif type(mid) is bytes:
        s = _binary_str(mid)
    else:
        s = _java_str(mid)
    return s if s.startswith("ID:") else "ID:" + s


def _id_correlation(m: MessageView) -> Any:
    cid = _field(m._props(), 5, object)
    if cid is None:
        return None
    t = type(cid)
    if t is str:
        if cid.startswith("ID:") and cid.startswith(_ID_PREFIXES, 3):
            return "ID:AMQP_STRING:" + cid
        return cid
    if t is bytes:
        return cid  # byte[]: opaque
    if t is _uuid.UUID:
        return "ID:AMQP_UUID:" + str(cid)
    if t is ULong:
        return "ID:AMQP_ULONG:" + str(int(cid))
    raise _Abort(f"unsupported correlation-id type {t.__name__}")


def _id_user(m: MessageView) -> Any:
    u = _field(m._props(), 1, bytes)
    return None if u is None else u.decode("utf-8", "replace")


def _prop_str(i: int) -> Callable[[MessageView], Any]:
    # proton-j types these fields as String: a symbol or anything else there counts as absent.
    def get(m: MessageView) -> Any:
        v = _field(m._props(), i, str)
        return v if type(v) is str else None

    return get


def _id_group_seq(m: MessageView) -> Any:
    g = _field(m._props(), 11, UInt)
    return Int(0 if g is None else _wrap32(int(g)))


def _id_durable(m: MessageView) -> Any:
    return "DURABLE" if m.durable else "NON_DURABLE"


#: FilterImpl.getHeaderFieldValue (names starting with "AMQ"); a None answer falls through to
#: getObjectPropertyForFilter, i.e. to the application property of the same name.
_AMQ_FIELDS: dict[str, Callable[[MessageView], Any]] = {
    "AMQUserID": _id_amq_user_id,
    "AMQPriority": lambda m: Int(min(m.priority, 9)),
    "AMQTimestamp": lambda m: Long(m.creation_time or 0),
    "AMQDurable": _id_durable,
    "AMQExpiration": lambda m: Long(m.expiration),
    "AMQSize": lambda m: Int(len(m.data)),
    "AMQAddress": _prop_str(2),
    "AMQGroupID": _prop_str(10),
}
#: AMQPMessage.getObjectProperty's special names: these never fall through.
_OBJECT_FIELDS: dict[str, Callable[[MessageView], Any]] = {
    "JMSType": _prop_str(3),
    "__AMQ_CID": lambda m: None,
    "JMSXGroupID": _prop_str(10),
    "JMSXGroupSeq": _id_group_seq,
    "JMSXUserID": _id_user,
    "JMSCorrelationID": _id_correlation,
}
#: SelectorTranslator.convertToActiveMQFilterString renames.
_TRANSLATED = {
    "JMSDeliveryMode": "AMQDurable", "JMSPriority": "AMQPriority", "JMSTimestamp": "AMQTimestamp",
    "JMSMessageID": "AMQUserID", "JMSExpiration": "AMQExpiration", "JMSXGroupID": "AMQGroupID",
}
_TRANSLATED_LITERALS = {"PERSISTENT": "DURABLE", "NON_PERSISTENT": "NON_DURABLE"}


def _resolver(name: str) -> Callable[[MessageView], Any]:
    """Compile the lookup of one identifier (FilterableServerMessage.getProperty)."""
    name = _TRANSLATED.get(name, name)
    if name.startswith("m."):
        key = name[2:]
        return lambda m: m.annotation(key)
    if name in _OBJECT_FIELDS:
        return _OBJECT_FIELDS[name]
    special = _AMQ_FIELDS.get(name)
    if special is not None:
        def lookup(m: MessageView) -> Any:
            v = special(m)
            return v if v is not None else m.application_property(name)

        return lookup
    return lambda m: m.application_property(name)


# ---------------------------------------------------------------------------------------------
# Lexer
# ---------------------------------------------------------------------------------------------

_KEYWORDS = frozenset({"NOT", "AND", "OR", "BETWEEN", "LIKE", "ESCAPE", "IN", "IS", "TRUE",
                       "FALSE", "NULL", "XPATH", "XQUERY"})
_RE_DECIMAL = re.compile(r"[1-9][0-9]*[lL]?")
_RE_HEX = re.compile(r"0[xX][0-9a-fA-F]+")
_RE_OCTAL = re.compile(r"0[0-7]*")
_RE_FLOAT = re.compile(
    r"[0-9]+\.[0-9]*(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+"
)
_RE_ID = re.compile(r"[A-Za-z_$][A-Za-z0-9_$]*")
_WS = " \t\n\r\f"
_OPS2 = ("<>", "<=", ">=")
_OPS1 = "=<>(),+-*/%"

# Token: (kind, value, start, end). Kinds: KW (value upper-cased), ID, STR, NUM, OP, EOF.
_Tok = tuple


def _tokenize(text: str, err: Callable[[str, int], SelectorError]) -> list[_Tok]:
    toks: list[_Tok] = []
    i, n = 0, len(text)
    # Where the next end of line / "*/" is: cached so that 64 KiB of "--" or "/*" without an
    # end costs one scan, not one per occurrence (n is "none left").
    eol = eoc = -1
    while i < n:
        c = text[i]
        if c in _WS:
            i += 1
            continue
        if c == "-" and text.startswith("--", i):
            # JavaCC LINE_COMMENT needs its end of line; without one the dashes are operators.
            if eol < i:
                ends = [j for j in (text.find("\n", i), text.find("\r", i)) if j >= 0]
                eol = min(ends) if ends else n
            if eol < n:
                i = eol + 1
                continue
        if c == "/" and text.startswith("/*", i):
            if eoc < i + 2:
                eoc = text.find("*/", i + 2)
                eoc = n if eoc < 0 else eoc
            if eoc < n:
                i = eoc + 2
                continue
        if c == "'" or c == '"':
            j, parts = i + 1, []
            while True:
                k = text.find(c, j)
                if k < 0:
                    what = "string literal" if c == "'" else "quoted identifier"
                    raise err(f"unterminated {what}", i)
                parts.append(text[j:k])
                if text.startswith(c, k + 1):  # doubled quote = one quote character
                    parts.append(c)
                    j = k + 2
                    continue
                break
            toks.append(("STR" if c == "'" else "ID", "".join(parts), i, k + 1))
            i = k + 1
            continue
        if c.isdigit() and c.isascii() or (c == "." and i + 1 < n and text[i + 1] in "0123456789"):
            # JavaCC takes the longest match; on a tie the first declared kind wins.
            best, kind = 0, None
            for k_name, rx in (("DEC", _RE_DECIMAL), ("HEX", _RE_HEX), ("OCT", _RE_OCTAL),
                               ("FLT", _RE_FLOAT)):
                m = rx.match(text, i)
                if m and m.end() - i > best:
                    best, kind = m.end() - i, k_name
            if kind is None:
                raise err(f"unexpected character {c!r}", i)
            toks.append(("NUM", _number(kind, text[i : i + best], i, err), i, i + best))
            i += best
            continue
        m = _RE_ID.match(text, i)
        if m:
            word = m.group()
            up = word.upper()
            toks.append(("KW" if up in _KEYWORDS else "ID", up if up in _KEYWORDS else word, i, m.end()))
            i = m.end()
            continue
        if text.startswith(_OPS2, i):
            toks.append(("OP", text[i : i + 2], i, i + 2))
            i += 2
            continue
        if c in _OPS1:
            toks.append(("OP", c, i, i + 1))
            i += 1
            continue
        raise err(f"unexpected character {c!r}", i)
    toks.append(("EOF", None, n, n))
    return toks


def _number(kind: str, s: str, pos: int, err) -> Any:
    """ConstantExpression.createFromDecimal/Hex/Octal/createFloat."""
    if kind == "FLT":
        return float(s)
    if kind == "DEC":
        digits = s.rstrip("lL")
        if len(digits) > 19:
            # Too big for a long: BigDecimal, then `longValue()` (the low 64 bits) decides
            # whether it is an int. Reduced chunk by chunk: int() refuses > 4300 digits.
            low = 0
            for k in range(0, len(digits), 18):
                chunk = digits[k : k + 18]
                low = (low * 10 ** len(chunk) + int(chunk)) & 0xFFFFFFFFFFFFFFFF
            if -0x80000000 <= _wrap64(low) <= 0x7FFFFFFF:
                return Int(_wrap32(low))
            return Decimal(digits)
        v = int(digits)
        if v > 0x7FFFFFFFFFFFFFFF:
            return Decimal(digits)  # 19 digits beyond the long range (wraps outside int)
    else:
        v = int(s[2:], 16) if kind == "HEX" else int(s, 8)
        if v > 0x7FFFFFFFFFFFFFFF:
            raise err(f"number {s} does not fit a long", pos)
    return Int(v) if v <= 0x7FFFFFFF else Long(v)


# ---------------------------------------------------------------------------------------------
# Parser + compiler
# ---------------------------------------------------------------------------------------------

_BOOL, _PROP, _CONST, _EXPR = "boolean", "identifier", "constant", "expression"


class _N:
    """A compiled node. ``kind`` drives Artemis's parse-time checks; TRUE/FALSE/NULL are both
    constants and booleans (``BooleanConstantExpression``), so they carry ``bconst``.

    An AND/OR node keeps its operands in ``children`` and grows in place while the parser reads
    a chain (``a OR b OR c ...``, as LogicExpression.addExpression does); its closure is built
    on first use of ``fn``, so a chain of n operands costs O(n), not O(n**2)."""

    __slots__ = ("kind", "_fn", "value", "bconst", "depth", "logic", "children")

    def __init__(self, kind, fn, depth, value=None, bconst=False):
        self.kind = kind
        self._fn = fn
        self.depth = depth
        self.value = value
        self.bconst = bconst
        self.logic = None
        self.children = None

    @property
    def fn(self) -> Callable[[Any], Any]:
        if self._fn is None:
            make = _or_fn if self.logic == "OR" else _and_fn
            self._fn = make([c.fn for c in self.children])
        return self._fn

    def is_const(self) -> bool:
        return self.kind == _CONST or self.bconst


def _const_node(value, boolean=False) -> _N:
    return _N(_BOOL if boolean else _CONST, lambda m, v=value: v, 1, value, boolean)


def _junction_fn(fns, decisive: bool):
    """SQL three-valued AND (``decisive`` False) or OR (``decisive`` True): the first operand
    equal to ``decisive`` decides; otherwise UNKNOWN if any operand was, else ``not decisive``."""
    fns = tuple(fns)
    otherwise = not decisive

    def f(m):
        unknown = False
        for g in fns:
            v = g(m)
            if v is decisive:
                return decisive
            if v is None:
                unknown = True
        return None if unknown else otherwise

    return f


def _and_fn(fns):
    return _junction_fn(fns, False)


def _or_fn(fns):
    return _junction_fn(fns, True)


# Binary precedence levels (StrictParser.jj): OR 1, AND 2, equality 3, comparison 4, add 5, mult 6
_PREC_OP = {"=": 3, "<>": 3, "<": 4, ">": 4, "<=": 4, ">=": 4, "+": 5, "-": 5, "*": 6, "/": 6,
            "%": 6}
_PREC_KW = {"OR": 1, "AND": 2, "IS": 3, "LIKE": 4, "BETWEEN": 4, "IN": 4, "NOT": 4}
_ORDER = {"<": lambda c: c < 0, ">": lambda c: c > 0, "<=": lambda c: c <= 0,
          ">=": lambda c: c >= 0}


class _Parser:
    def __init__(self, text: str):
        self.text = text
        self.toks = _tokenize(text, self.err)
        self.i = 0
        self.nesting = 0

    # -- errors -----------------------------------------------------------------------------

    def err(self, what: str, pos: int) -> SelectorError:
        shown = self.text if len(self.text) <= 120 else self.text[:117] + "..."
        return SelectorError(f'selector: {what} at column {pos + 1} in "{shown}"')

    def _tok_text(self, tok) -> str:
        if tok[0] == "EOF":
            return "end of input"
        src = self.text[tok[2] : tok[3]]
        return f"token {src if len(src) <= 40 else src[:37] + '...'!r}"

    def unexpected(self, expected: str | None = None) -> SelectorError:
        tok = self.toks[self.i]
        what = f"unexpected {self._tok_text(tok)}"
        if expected:
            what += f" (expected {expected})"
        return self.err(what, tok[2])

    # -- token helpers ----------------------------------------------------------------------

    def peek(self, k: int = 0):
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def accept(self, kind: str, value=None) -> bool:
        t = self.toks[self.i]
        if t[0] == kind and (value is None or t[1] == value):
            self.i += 1
            return True
        return False

    def expect(self, kind: str, value=None, what: str | None = None):
        t = self.toks[self.i]
        if t[0] == kind and (value is None or t[1] == value):
            self.i += 1
            return t
        raise self.unexpected(what or (value if value else kind))

    def string_literal(self) -> str:
        t = self.expect("STR", what="a string literal")
        return _TRANSLATED_LITERALS.get(t[1], t[1])

    # -- node construction with Artemis's checks -------------------------------------------

    def node(self, kind, fn, *children, pos) -> _N:
        depth = 1 + max((c.depth for c in children), default=0)
        if depth > MAX_DEPTH:
            raise self.err(f"expression nested deeper than {MAX_DEPTH} levels", pos)
        return _N(kind, fn, depth)

    def as_bool(self, n: _N, pos: int) -> _N:
        """StrictParser.asBooleanExpression (+ UnaryExpression.createBooleanCast)."""
        if n.kind == _BOOL:
            return n
        if n.kind == _PROP:
            g = n.fn

            def cast(m):
                v = g(m)
                if v is None:
                    return None
                return v if type(v) is bool else False

            return self.node(_BOOL, cast, n, pos=pos)
        raise self.err(f"{n.kind} will not result in a boolean value", pos)

    def logic(self, op: str, left: _N, right: _N, pos: int) -> _N:
        left = self.as_bool(left, pos)
        right = self.as_bool(right, pos)
        if left.logic == op and left._fn is None:  # flatten a left-nested chain in place
            if right.depth + 1 > MAX_DEPTH:
                raise self.err(f"expression nested deeper than {MAX_DEPTH} levels", pos)
            left.children.append(right)
            left.depth = max(left.depth, right.depth + 1)
            return left
        n = self.node(_BOOL, None, left, right, pos=pos)
        n.logic, n.children = op, [left, right]
        return n

    def equal(self, left: _N, right: _N, negate: bool, pos: int) -> _N:
        for x in (left, right):
            if x.is_const() and x.value is None:
                raise self.err("NULL cannot be compared with '=' or '<>' (use IS NULL)", pos)
        if left.is_const() and right.is_const() and left.bconst and not right.bconst:
            raise self.err("a boolean constant cannot be compared with a non-boolean", pos)
        lf, rf = left.fn, right.fn
        if negate:
            def fn(m):
                r = _equal(lf(m), rf(m))
                return None if r is None else not r
        else:
            def fn(m):
                return _equal(lf(m), rf(m))
        return self.node(_BOOL, fn, left, right, pos=pos)

    def check_order_operand(self, x: _N, pos: int) -> None:
        """ComparisonExpression.checkLessThanOperand."""
        if x.is_const():
            v = x.value
            if isinstance(v, (int, float, Decimal)) and not isinstance(v, bool):
                return
            raise self.err(f"value {self._show_const(v)} cannot be compared with < > <= >=", pos)
        if x.kind == _BOOL:
            raise self.err("a boolean expression cannot be compared with < > <= >=", pos)

    @staticmethod
    def _show_const(v) -> str:
        if v is None:
            return "NULL"
        if isinstance(v, bool):
            return "TRUE" if v else "FALSE"
        if isinstance(v, str):
            return "'" + v.replace("'", "''") + "'"
        return str(v)

    def order(self, op: str, left: _N, right: _N, pos: int) -> _N:
        self.check_order_operand(left, pos)
        self.check_order_operand(right, pos)
        lf, rf, test = left.fn, right.fn, _ORDER[op]

        def fn(m):
            lv = lf(m)
            if lv is not None and type(lv) not in _KIND:
                raise _Abort("not Comparable")  # the (Comparable) cast in Artemis
            if lv is None:
                return None
            rv = rf(m)
            if rv is not None and type(rv) not in _KIND:
                raise _Abort("not Comparable")
            if rv is None:
                return None
            c = _compare(lv, rv)
            return False if c is None else test(c)

        return self.node(_BOOL, fn, left, right, pos=pos)

    def not_(self, n: _N, pos: int) -> _N:
        n = self.as_bool(n, pos)
        g = n.fn

        def fn(m):
            v = g(m)
            return None if v is None else not v

        return self.node(_BOOL, fn, n, pos=pos)

    def arith(self, op: str, left: _N, right: _N, pos: int) -> _N:
        lf, rf = left.fn, right.fn

        def fn(m):
            a = lf(m)
            if a is None:
                return None
            b = rf(m)
            if b is None:
                return None
            return _arith(op, a, b)

        return self.node(_EXPR, fn, left, right, pos=pos)

    # -- grammar ---------------------------------------------------------------------------

    def parse(self) -> _N:
        if self.toks[0][0] == "EOF":
            raise self.err("empty selector", 0)
        n = self.expr(1)
        if self.peek()[0] != "EOF":
            raise self.unexpected()
        return self.as_bool(n, 0)

    def expr(self, min_prec: int) -> _N:
        left = self.unary()
        while True:
            kind, value, pos, _ = self.peek()
            if kind == "OP":
                prec = _PREC_OP.get(value)
            elif kind == "KW":
                prec = _PREC_KW.get(value)
            else:
                prec = None
            if prec is None or prec < min_prec:
                return left
            self.i += 1
            if kind == "KW" and value in ("OR", "AND"):
                left = self.logic(value, left, self.expr(prec + 1), pos)
            elif value in ("=", "<>"):
                left = self.equal(left, self.expr(prec + 1), value == "<>", pos)
            elif value in _ORDER:
                left = self.order(value, left, self.expr(prec + 1), pos)
            elif kind == "OP":
                left = self.arith(value, left, self.expr(prec + 1), pos)
            elif value == "IS":
                negate = self.accept("KW", "NOT")
                self.expect("KW", "NULL", what="NULL or NOT NULL after IS")
                g = left.fn
                fn = (lambda m: g(m) is not None) if negate else (lambda m: g(m) is None)
                left = self.node(_BOOL, fn, left, pos=pos)
            else:
                negate = False
                if value == "NOT":
                    nxt = self.peek()
                    if not (nxt[0] == "KW" and nxt[1] in ("LIKE", "BETWEEN", "IN")):
                        self.i -= 1
                        raise self.unexpected()
                    self.i += 1
                    value, negate = nxt[1], True
                if value == "LIKE":
                    left = self.like(left, negate, pos)
                elif value == "BETWEEN":
                    left = self.between(left, negate, pos)
                else:
                    left = self.in_(left, negate, pos)

    def like(self, left: _N, negate: bool, pos: int) -> _N:
        pattern = self.string_literal()
        escape = None
        if self.accept("KW", "ESCAPE"):
            epos = self.peek()[2]
            escape = self.string_literal()
            if len(escape) != 1:
                raise self.err(f"ESCAPE must be one character, not {escape!r}", epos)
        match = _like_matcher(pattern, escape)
        g = left.fn

        def fn(m):
            v = g(m)
            if v is None:
                return None
            return type(v) is str and match(v)

        n = self.node(_BOOL, fn, left, pos=pos)
        return self.not_(n, pos) if negate else n

    def between(self, left: _N, negate: bool, pos: int) -> _N:
        low = self.expr(5)
        self.expect("KW", "AND", what="AND in BETWEEN")
        high = self.expr(5)
        # Artemis: BETWEEN = (v >= low AND v <= high); NOT BETWEEN = (v < low OR v > high)
        if negate:
            return self.logic("OR", self.order("<", left, low, pos), self.order(">", left, high, pos), pos)
        return self.logic("AND", self.order(">=", left, low, pos), self.order("<=", left, high, pos), pos)

    def in_(self, left: _N, negate: bool, pos: int) -> _N:
        if left.kind != _PROP:
            raise self.err(f"IN needs an identifier on its left, got a {left.kind}", pos)
        self.expect("OP", "(", what="'(' after IN")
        values = {self.string_literal()}
        while self.accept("OP", ","):
            values.add(self.string_literal())
        self.expect("OP", ")", what="',' or ')' in the IN list")
        frozen, g = frozenset(values), left.fn

        def fn(m):
            v = g(m)
            if v is None or type(v) is not str:
                return None
            return (v in frozen) ^ negate

        return self.node(_BOOL, fn, left, pos=pos)

    def unary(self) -> _N:
        """unaryExpr and primaryExpr in one function: one Python frame fewer per nesting level."""
        kind, value, pos, _ = self.peek()
        self.i += 1
        if kind == "STR":
            return _const_node(_TRANSLATED_LITERALS.get(value, value))
        if kind == "NUM":
            return _const_node(value)
        if kind == "ID":
            return _N(_PROP, _resolver(value), 1)
        if kind == "KW" and value in ("TRUE", "FALSE", "NULL"):
            return _const_node({"TRUE": True, "FALSE": False, "NULL": None}[value], boolean=True)
        if kind == "KW" and value in ("XPATH", "XQUERY"):
            raise self.err(f"{value} selectors are not supported", pos)
        if kind not in ("OP", "KW") or value not in ("+", "-", "NOT", "("):
            self.i -= 1
            raise self.unexpected("an identifier, a literal or '('")
        self.nesting += 1
        if self.nesting > MAX_DEPTH:
            raise self.err(f"expression nested deeper than {MAX_DEPTH} levels", pos)
        try:
            if value == "(":
                n = self.expr(1)
                self.expect("OP", ")", what="')'")
                return n
            if value == "+":
                return self.unary()  # Artemis returns the operand unchanged
            n = self.unary()
            if value == "-":
                g = n.fn
                return self.node(_EXPR, lambda m: _negate(g(m)), n, pos=pos)
            return self.not_(n, pos)
        finally:
            self.nesting -= 1


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


class Selector:
    """A compiled selector. ``text`` is the original string (echoed in the attach reply)."""

    __slots__ = ("text", "_fn")

    def __init__(self, text: str, fn: Callable[[MessageView], Any]):
        self.text = text
        self._fn = fn

    def evaluate(self, msg: MessageView) -> bool | None:
        """The three-valued result: True, False or None (UNKNOWN). A runtime error that makes
        Artemis reject the message (e.g. arithmetic on a string) also gives None."""
        try:
            return self._fn(msg)
        except _Abort:
            return None

    def matches(self, msg: MessageView) -> bool:
        """True only when the selector evaluates to TRUE. Never raises."""
        try:
            return self._fn(msg) is True
        except Exception:  # noqa: BLE001 - FilterImpl.match: any exception means "no match"
            return False

    def __repr__(self) -> str:
        return f"Selector({self.text!r})"


def parse_selector(text: str) -> Selector:
    """Parse and compile ``text``; raise ``SelectorError`` (``amqp:invalid-field``) if invalid.

    As on Artemis's AMQP attach path, an empty or blank selector is invalid; see
    ``compile_filter`` for the queue-filter rule where blank means "no filter".
    """
    if not isinstance(text, str):
        raise SelectorError(f"selector: expected a string, got {type(text).__name__}")
    if len(text) > MAX_SELECTOR_BYTES // 4 and len(text.encode("utf-8", "surrogatepass")) > MAX_SELECTOR_BYTES:
        raise SelectorError(f"selector: longer than {MAX_SELECTOR_BYTES} bytes")
    for prefix in ("hyphenated_props:", "no_hyphenated_props:", "convert_string_expressions:",
                   "no_convert_string_expressions:"):
        if text.startswith(prefix):
            raise SelectorError(f"selector: the Artemis prefix {prefix!r} is not supported")
    try:
        root = _Parser(text).parse()
    except RecursionError:
        raise SelectorError("selector: expression nested too deeply") from None
    return Selector(text, root.fn)


def compile_filter(text: str | None) -> Selector | None:
    """Queue-filter rule (``FilterImpl.createFilter``): None or blank text is no filter (None);
    anything else is trimmed and parsed with ``parse_selector``."""
    if text is None:
        return None
    text = text.strip(_JAVA_TRIM)  # Java String.trim(): code points <= U+0020 only
    return parse_selector(text) if text else None


_JAVA_TRIM = "".join(map(chr, range(0x21)))
