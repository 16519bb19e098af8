"""JMS/Artemis selectors (broker.core.selector), table-driven, on messages encoded by the real
python-qpid-proton. Expected results follow Artemis's ``artemis-selector`` and ``AMQPMessage``
(several cases are ported from Artemis's SelectorTest / UnknownHandlingSelectorTest); each row
gives the three-valued result: True, False or None (UNKNOWN)."""

from __future__ import annotations

import uuid

import proton
import pytest
from proton import Message

import broker.core.selector as selmod
from broker.core.selector import (
    MAX_DEPTH,
    MessageView,
    Selector,
    SelectorError,
    compile_filter,
    parse_selector,
)
from broker.wire.errors import RemoteProtocolError

PROPS = {
    "i": proton.int32(5),
    "l": 10,  # python int -> AMQP long
    "d": 2.5,
    "f": proton.float32(1.5),
    "sh": proton.short(3),
    "by": proton.byte(2),
    "u": proton.uint(7),
    "ul": proton.ulong(2**64 - 1),
    "s": "hello",
    "s2": "world",
    "empty": "",
    "trueProp": True,
    "falseProp": False,
    "nullProp": None,
    "sym": proton.symbol("sym"),
    "bin": b"\x01\x02",
    "ch": proton.char("c"),
    "ts": proton.timestamp(5000),
    "pct": "50%",
    "meta": "a.b*c(d)",
    "under": "x_y",
    "quote": "'In God We Trust'",
    "big": proton.int32(2**31 - 1),
    "neg0": -0.0,
    "nan": float("nan"),
    "JMSType": "app-type-is-shadowed",
    "AMQGroupID": "app-group",
    "Command": "Other",
    "bang": "a!b",
    "bmp": "\uffff",
    "astral": "\U00010000",
    "f24": proton.float32(16777216.0),
}


def msg(**kw) -> MessageView:
    kw.setdefault("body", "payload")
    return MessageView(Message(**kw).encode())


M = msg(
    properties=PROPS,
    annotations={proton.symbol("x-opt-foo"): "bar", proton.symbol("k"): proton.uint(3)},
    id="ID:msg-1",
    user_id=b"alice",
    address="orders",
    subject="order.created",
    correlation_id="corr-7",
    creation_time=1700000000.5,  # seconds in proton-python: 1700000000500 ms
    expiry_time=1700000060.0,
    group_id="grp",
    group_sequence=4,
    priority=7,
    durable=True,
)


def ev(text: str, view: MessageView = M):
    return parse_selector(text).evaluate(view)


# ---------------------------------------------------------------------------------------------
# Operators, three-valued results
# ---------------------------------------------------------------------------------------------

CASES = [
    # equality on numbers, with int/long/float/double widening
    ("i = 5", True), ("i = 6", False), ("i <> 6", True), ("i <> 5", False),
    ("i = 5.0", True), ("l = 10", True), ("l = 10.0", True), ("d = 2.5", True),
    ("f = 1.5", True), ("sh = 3", True), ("by = 2", True), ("u = 7", True),
    ("ul = -1", True),  # ulong 2**64-1 becomes Long -1 (Number.longValue) as in Artemis
    ("5 = i", True), ("10 = l", True),
    ("f24 = 16777217", True), ("16777217 = f24", True),  # Integer vs Float: rounded to float32
    ("f24 = 16777217.0", False),  # Float vs Double: the float widens exactly
    ("3 = sh", False),  # Artemis widens only from the left class: Integer vs Short is FALSE
    # ordering
    ("i > 4", True), ("i > 5", False), ("i >= 5", True), ("i < 5", False), ("i <= 5", True),
    ("d > 2", True), ("d < 2.6", True), ("f < 2", True), ("l > 9.5", True),
    ("s < s2", True), ("s2 > s", True),  # two string properties do order (compareTo)
    ("falseProp < trueProp", True),
    ("astral < bmp", True),  # UTF-16 code-unit order (Java), not code-point order
    ("neg0 < 0.0", True), ("neg0 = 0.0", False),  # Double.compare: -0.0 < 0.0
    ("nan = nan", True), ("nan > 1e308", True),  # NaN equals itself and sorts last
    # strings and booleans
    ("s = 'hello'", True), ("s = 'Hello'", False), ("s <> 'x'", True), ("empty = ''", True),
    ("trueProp = TRUE", True), ("falseProp = FALSE", True), ("trueProp = FALSE", False),
    ("trueProp", True), ("falseProp", False), ("s", False),  # non-boolean used as boolean
    ("TRUE", True), ("FALSE", False), ("NULL", None),
    # type mismatch is FALSE in Artemis (not UNKNOWN), so NOT(...) of it is TRUE
    ("s = 5", False), ("NOT (s = 5)", True), ("i = '5'", False), ("i = TRUE", False),
    ("sym = 'sym'", False),  # a Symbol is not a String
    ("ch = 'c'", False), ("ts = 5000", False), ("bin = 'x'", False),
    ("s > s2 OR i > s", False), ("NOT (i > s)", True),
    # NULL handling
    ("missing = 1", None), ("missing <> 1", None), ("missing > 1", None), ("1 < missing", None),
    ("nullProp = 0", None), ("i = missing", False),  # only a NULL *left* side gives UNKNOWN
    ("missing = other", True),  # both NULL: Java's lv == rv
    ("missing IS NULL", True), ("nullProp IS NULL", True), ("i IS NULL", False),
    ("missing IS NOT NULL", False), ("i IS NOT NULL", True), ("NOT (missing IS NULL)", False),
    ("missing", None), ("NOT missing", None), ("- missing = 1", None), ("missing + 1 = 1", None),
    # arithmetic
    ("i + 1 = 6", True), ("i - 1 = 4", True), ("i * 2 = 10", True), ("i / 2 = 2.5", True),
    ("i % 3 = 2", True), ("l * l = 100", True), ("-i = -5", True), ("+i = 5", True),
    ("- -i = 5", True), ("d * 2 = 5", True), ("i / 0 > 1000000", True),  # Java: Infinity
    ("0 / 0 = 0 / 0", True),  # NaN compares equal to NaN (Double.compare)
    ("big + 1 < 0", True),  # Integer arithmetic wraps as in Java
    ("big + 1L < 0", True),  # Artemis drops the L: 1L is still an Integer
    ("i + 2147483648 = 2147483653", True),  # long literal -> LONG math
    ("s + 1 = 'hello1'", True), ("s + 1.5 = 'hello1.5'", True), ("s + trueProp = 'hellotrue'", True),
    ("s + 1e7 = 'hello1.0E7'", True),  # Java Double.toString
    ("s + missing = 'hello'", None),
    ("i + s = 1", None),  # Artemis throws -> the whole selector is rejected
    ("i + s = 1 OR TRUE", None),
    ("-s = 1", None),  # negating a non-number is NULL
    ("-sh = -3", None),  # negating a Short throws in Artemis
    # LIKE
    ("s LIKE 'he%'", True), ("s LIKE 'h_llo'", True), ("s LIKE 'h_lo'", False),
    ("s LIKE '%'", True), ("empty LIKE '%'", True), ("empty LIKE '_'", False),
    ("s LIKE 'HELLO'", False), ("s NOT LIKE 'he%'", False), ("s NOT LIKE 'x%'", True),
    ("s LIKE '%l%l%'", True), ("s LIKE '%l%l%l%'", False), ("s LIKE 'h%o'", True),
    ("s LIKE 'h%%o'", True), ("s LIKE 'hello%'", True), ("s LIKE '%hello'", True),
    ("meta LIKE 'a.b*c(d)'", True), ("meta LIKE 'a_b_c_d_'", True), ("meta LIKE 'a.b.c(d)'", False),
    ("meta LIKE 'aXb*c(d)'", False),  # '.' is literal
    ("meta LIKE 'a.b*%'", True), ("meta LIKE '%(d)'", True), ("meta LIKE '.*'", False),
    ("pct LIKE '50!%' ESCAPE '!'", True), ("pct LIKE '5!%' ESCAPE '!'", False),
    ("under LIKE 'x!_y' ESCAPE '!'", True), ("s LIKE 'h!_llo' ESCAPE '!'", False),
    ("pct LIKE '50\\%' ESCAPE '\\'", True),
    ("s LIKE 'h!ello' ESCAPE '!'", False),
    ("bang LIKE 'a!!b' ESCAPE '!'", True), ("bang LIKE 'a!b' ESCAPE '!'", True),  # '!' before a plain char stays a literal '!'
    ("quote LIKE '''In G_d We Trust'''", True), ("quote LIKE '''In Gd_ We Trust'''", False),
    ("i LIKE '5'", False),  # a non-string operand is FALSE
    ("missing LIKE 'x'", None), ("missing NOT LIKE 'x'", None),
    # IN
    ("s IN ('hello', 'world')", True), ("s IN ('a', 'b')", False), ("s NOT IN ('a')", True),
    ("s NOT IN ('hello')", False), ("missing IN ('a')", None), ("missing NOT IN ('a')", None),
    ("nullProp IN ('a')", None), ("i IN ('5')", None),  # non-string: UNKNOWN
    ("s IN ('a', 'b', 'c', 'd', 'e', 'hello')", True),
    ("Command NOT IN ('MirrorLobbyRequest', 'MirrorLobbyReply')", True),
    # BETWEEN
    ("i BETWEEN 1 AND 10", True), ("i BETWEEN 5 AND 5", True), ("i BETWEEN 6 AND 10", False),
    ("i NOT BETWEEN 6 AND 10", True), ("i NOT BETWEEN 1 AND 10", False),
    ("d BETWEEN 2 AND 3", True), ("d BETWEEN 2.6 AND 3", False), ("f BETWEEN 1.5 AND 1.5", True),
    ("l BETWEEN 9.5 AND 10.5", True), ("i BETWEEN 1 + 3 AND 2 * 3", True),
    ("missing BETWEEN 1 AND 2", None), ("missing NOT BETWEEN 1 AND 2", None),
    ("s BETWEEN 1 AND 10", False),  # mismatched classes: FALSE
]


@pytest.mark.parametrize("text,expected", CASES, ids=[c[0] for c in CASES])
def test_operator_table(text, expected):
    assert ev(text) is expected
    assert parse_selector(text).matches(M) is (expected is True)


# ---------------------------------------------------------------------------------------------
# Three-valued logic (ported from Artemis UnknownHandlingSelectorTest)
# ---------------------------------------------------------------------------------------------

T, F, U = "trueProp", "falseProp", "unknownProp"
AND_TABLE = [(T, T, True), (T, F, False), (F, T, False), (F, F, False), (F, U, False),
             (U, F, False), (T, U, None), (U, T, None), (U, U, None)]
OR_TABLE = [(T, T, True), (T, F, True), (F, T, True), (T, U, True), (U, T, True),
            (F, F, False), (F, U, None), (U, F, None), (U, U, None)]


@pytest.mark.parametrize("a,b,expected", AND_TABLE)
def test_and_truth_table(a, b, expected):
    assert ev(f"{a} AND {b}") is expected
    # NOT flips TRUE/FALSE and keeps UNKNOWN, so neither side matches for UNKNOWN
    assert ev(f"NOT ({a} AND {b})") is (None if expected is None else not expected)


@pytest.mark.parametrize("a,b,expected", OR_TABLE)
def test_or_truth_table(a, b, expected):
    assert ev(f"{a} OR {b}") is expected
    assert ev(f"not({a} OR {b})") is (None if expected is None else not expected)


@pytest.mark.parametrize("a,expected", [(T, False), (F, True), (U, None)])
def test_not_truth_table(a, expected):
    assert ev(f"NOT {a}") is expected


def test_n_ary_logic_short_circuits_in_order():
    # AND stops at the first FALSE, so a later runtime error is never reached ...
    assert ev("falseProp AND i + s = 1") is False
    # ... but an error before it rejects the message, as Artemis's exception does.
    assert ev("i + s = 1 AND falseProp") is None
    assert ev("trueProp OR i + s = 1") is True
    assert ev("a1 OR a2 OR a3 OR trueProp") is True
    assert ev("a1 OR a2 OR falseProp") is None


# ---------------------------------------------------------------------------------------------
# Precedence and associativity
# ---------------------------------------------------------------------------------------------

PRECEDENCE = [
    ("trueProp OR falseProp AND falseProp", True),  # AND binds tighter than OR
    ("(trueProp OR falseProp) AND falseProp", False),
    ("falseProp AND falseProp OR trueProp", True),
    ("i + 2 * 3 = 11", True), ("(i + 2) * 3 = 21", True),
    ("i - 2 - 1 = 2", True),  # left-associative
    ("20 / 2 / 5 = 2", True), ("i - -1 = 6", True),
    ("2 + 3 * 4 - 6 / 2 = 11", True), ("10 % 4 * 2 = 4", True),
    ("i = 5 = TRUE", True),  # equality chains left to right: (i = 5) = TRUE
    ("i > 4 = TRUE", True),  # comparison binds tighter than equality
    ("1 + 1 BETWEEN 2 AND 2", True),
    # Artemis's StrictParser: NOT is unary and binds tighter than comparisons
    ("NOT i = 5", False), ("NOT (i = 5)", False), ("NOT i = 6", False), ("NOT (i = 6)", True),
    ("NOT falseProp = TRUE", True),  # (NOT falseProp) = TRUE
    ("NOT NOT trueProp", True),
    ("-i * 2 = -10", True), ("- (i + 1) = -6", True),
]


@pytest.mark.parametrize("text,expected", PRECEDENCE, ids=[c[0] for c in PRECEDENCE])
def test_precedence(text, expected):
    assert ev(text) is expected


# ---------------------------------------------------------------------------------------------
# Lexical details
# ---------------------------------------------------------------------------------------------

LEXICAL = [
    ("i = 0x5", True), ("i = 0X5", True), ("i = 05", True), ("l = 012", True),  # hex, octal
    ("l = 10L", True), ("l = 10l", True), ("i = 5.", True), ("d = .25E1", True),
    ("d = 25e-1", True), ("i = 5.0E0", True), ("i = 00", False),
    ("s = 'it''s'", False), ("quote = '''In God We Trust'''", True),
    ("i = 5 AnD s = 'hello'", True), ("trueProp = true", True),  # keywords ignore case
    ("I = 5", None),  # identifiers do not: I is another (missing) property
    ('"s" = \'hello\'', True), ('"with space" IS NULL', True),  # quoted identifier
    ("i = 5 -- a comment\n", True), ("i /* inline */ = 5", True),
    ("\ti\n=\r5\f", True), ("$x IS NULL AND _y IS NULL", True),
    ("s = 'PERSISTENT' OR s = 'hello'", True),
]


@pytest.mark.parametrize("text,expected", LEXICAL, ids=[c[0] for c in LEXICAL])
def test_lexical(text, expected):
    assert ev(text) is expected


def test_literal_types_follow_artemis():
    # Values of literals: Integer when they fit 32 bits, else Long; floats are Double.
    v = MessageView(b"")
    assert parse_selector("2147483647 + 1 < 0").evaluate(v) is True  # Integer wraps
    assert parse_selector("2147483648 + 1 > 0").evaluate(v) is True  # a Long
    assert parse_selector("9223372036854775807 + 1 < 0").evaluate(v) is True  # Long wraps
    assert parse_selector("-9223372036854775808 < 0").evaluate(v) is True  # BigDecimal negated
    assert parse_selector("0.1 + 0.2 = 0.30000000000000004").evaluate(v) is True


# ---------------------------------------------------------------------------------------------
# JMS header identifiers as Artemis maps them for AMQP messages
# ---------------------------------------------------------------------------------------------

HEADERS = [
    ("JMSPriority = 7", True), ("AMQPriority = 7", True),
    ("JMSDeliveryMode = 'PERSISTENT'", True), ("JMSDeliveryMode = 'NON_PERSISTENT'", False),
    ("AMQDurable = 'DURABLE'", True),
    ("JMSMessageID = 'ID:msg-1'", True), ("AMQUserID = 'ID:msg-1'", True),
    ("JMSCorrelationID = 'corr-7'", True),
    ("JMSType = 'order.created'", True),  # the subject, not the application property
    ("JMSTimestamp = 1700000000500", True), ("AMQTimestamp > 0", True),
    ("JMSExpiration = 1700000060000", True),
    ("JMSXGroupID = 'grp'", True), ("AMQGroupID = 'grp'", True),
    ("JMSXGroupSeq = 4", True), ("JMSXUserID = 'alice'", True),
    ("AMQAddress = 'orders'", True),
    ('"m.x-opt-foo" = \'bar\'', True), ('"m.k" = 3', False),  # annotations keep uint: FALSE
    ('"m.k" IS NOT NULL', True), ('"m._AMQ_foo" = \'bar\'', True),  # _AMQ_x -> x-opt-x
    ('"m.missing" IS NULL', True),
    ("JMSRedelivered IS NULL", True),  # not mapped by Artemis: an (absent) application property
    ("AMQSize > 100", True),
]


@pytest.mark.parametrize("text,expected", HEADERS, ids=[c[0] for c in HEADERS])
def test_jms_header_identifiers(text, expected):
    assert ev(text) is expected


def test_header_defaults_on_a_bare_message():
    bare = msg()
    assert ev("JMSPriority = 4", bare) is True
    assert ev("JMSDeliveryMode = 'NON_PERSISTENT'", bare) is True
    assert ev("JMSTimestamp = 0", bare) is True
    assert ev("JMSExpiration = 0", bare) is True
    assert ev("JMSXGroupSeq = 0", bare) is True
    assert ev("JMSMessageID IS NULL", bare) is True
    assert ev("JMSType IS NULL", bare) is True
    # AMQ* names that have no value fall through to the application property of that name
    assert ev("AMQGroupID = 'app-group'", MessageView(Message(properties=PROPS).encode())) is True


def test_priority_is_clamped_to_nine_for_jmspriority():
    v = msg(priority=200)
    assert v.priority == 200
    assert ev("JMSPriority = 9", v) is True


@pytest.mark.parametrize(
    "mid,expected",
    [
        ("abc", "ID:abc"),
        ("ID:abc", "ID:abc"),
        (proton.ulong(42), "ID:42"),
        (uuid.UUID(int=1), "ID:00000000-0000-0000-0000-000000000001"),
        (b"a\x00\\", "ID:a\\x00\\x5c"),  # proton-j Binary.toString
    ],
)
def test_message_id_as_amquserid(mid, expected):
    assert parse_selector("JMSMessageID = " + "'" + expected.replace("'", "''") + "'").evaluate(
        msg(id=mid)
    ) is True


@pytest.mark.parametrize(
    "cid,expected",
    [
        ("plain", "plain"),
        ("ID:AMQP_UUID:x", "ID:AMQP_STRING:ID:AMQP_UUID:x"),
        (proton.ulong(7), "ID:AMQP_ULONG:7"),
        (uuid.UUID(int=2), "ID:AMQP_UUID:00000000-0000-0000-0000-000000000002"),
    ],
)
def test_correlation_id(cid, expected):
    assert ev(f"JMSCorrelationID = '{expected}'", msg(correlation_id=cid)) is True


def test_binary_correlation_id_is_opaque():
    v = msg(correlation_id=b"\x01")
    assert ev("JMSCorrelationID IS NOT NULL", v) is True
    assert ev("JMSCorrelationID = 'x'", v) is False


def test_native_message_id_fallback():
    v = MessageView(Message(properties={"NATIVE_MESSAGE_ID": "n-1"}).encode())
    assert ev("JMSMessageID = 'n-1'", v) is True


def test_view_accessors_hand_computed():
    v = msg(ttl=1.5, expiry_time=100.0, creation_time=50.25, durable=True, priority=0)
    # proton-python takes seconds; AMQP carries milliseconds
    assert (v.ttl, v.absolute_expiry_time, v.creation_time) == (1500, 100000, 50250)
    assert (v.durable, v.priority) == (True, 0)
    assert v.expiration == 100000  # absolute-expiry-time wins over ttl
    w = MessageView(Message(ttl=2.0).encode(), received_ms=1000)
    assert w.expiration == 3000 and ev("JMSExpiration = 3000", w) is True
    assert MessageView(Message(ttl=2.0).encode()).expiration == 0  # arrival time unknown
    bare = MessageView(b"")
    assert (bare.priority, bare.ttl, bare.durable, bare.creation_time, bare.expiration) == (
        4, None, False, None, 0)


def test_hand_encoded_message():
    # header [durable=true, priority=9] + application-properties {"k": "v"} + amqp-value "x",
    # written byte by byte from AMQP 1.0 §3.2 to check the view does not rely on proton.
    data = (b"\x00\x53\x70\xc0\x04\x02\x41\x50\x09"
            b"\x00\x53\x74\xc1\x07\x02\xa1\x01k\xa1\x01v"
            b"\x00\x53\x77\xa1\x01x")
    v = MessageView(data)
    assert (v.durable, v.priority) == (True, 9)
    assert ev("k = 'v' AND JMSPriority = 9 AND JMSDeliveryMode = 'PERSISTENT'", v) is True


# ---------------------------------------------------------------------------------------------
# Laziness and damaged messages
# ---------------------------------------------------------------------------------------------


def test_sections_are_decoded_lazily_and_once(monkeypatch):
    calls = []
    real = selmod.decode

    def counting(data, offset=0, end=None):
        calls.append(offset)
        return real(data, offset, end)

    monkeypatch.setattr(selmod, "decode", counting)
    v = MessageView(M.data)
    sel = parse_selector("s = 'hello' AND i = 5 AND s LIKE 'h%'")
    assert sel.matches(v) and sel.matches(v)
    scanned = len(calls)
    assert set(v._cache) == {0x74}  # only application-properties was decoded
    assert sel.matches(v) and len(calls) == scanned


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00",
        b"\xff" * 10,
        M.data[:20],
        M.data[: len(M.data) // 2],
        b"\x00\x53\x74\xc1\x05\x02\xa1\x01k\xa1",  # truncated map
        b"\x00\x53\x74\xc1\x07\x02\xa1\x01k\xa1\x01\xff",  # invalid UTF-8 value
        b"\x00\x53\x74\xc0\x03\x01\x41",  # a list where a map belongs
        b"\x00\x53\x70\xc0\x03\x02\x41\xa1",  # header with a broken field
        b"\x00" * 100000,  # a descriptor bomb
    ],
)
def test_damaged_messages_give_null_never_raise(data):
    v = MessageView(data)
    for text in ("k = 'v'", "k IS NULL", "JMSPriority = 4", "JMSType IS NULL", "s LIKE '%'",
                 "JMSMessageID IS NULL", '"m.x" IS NULL', "JMSExpiration = 0"):
        sel = parse_selector(text)
        assert sel.evaluate(v) in (True, False, None)
        assert sel.matches(v) in (True, False)
    assert parse_selector("k IS NULL").matches(v)


def test_sections_before_damage_stay_usable():
    good = b"\x00\x53\x70\xc0\x04\x02\x41\x50\x09"
    v = MessageView(good + b"\x00\x53\x74\xc1\xff")
    assert ev("JMSPriority = 9", v) is True and ev("k IS NULL", v) is True


def test_matches_never_raises_even_on_internal_errors():
    sel = Selector("boom", lambda m: 1 / 0)
    assert sel.matches(M) is False


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

ERRORS = [
    ("", "empty selector"),
    ("   ", "empty selector"),
    ("a = 1 AND AND b", "unexpected token 'AND' (expected an identifier, a literal or '(') at column 11"),
    ("a =", "unexpected end of input"),
    ("a = 1)", "unexpected token ')'"),
    ("(a = 1", "expected ')'"),
    ("a == 1", "unexpected token '='"),
    ("a != 1", "unexpected character '!'"),
    ("a = 'abc", "unterminated string literal at column 5"),
    ('"abc = 1', "unterminated quoted identifier"),
    ("a # 1", "unexpected character '#'"),
    ("a = 1 b", "unexpected token 'b'"),
    ("1 + 2", "will not result in a boolean value"),
    ("'abc'", "will not result in a boolean value"),
    ("a AND 1", "will not result in a boolean value"),
    ("NOT 5", "will not result in a boolean value"),
    ("a = NULL", "NULL cannot be compared"),
    ("a <> NULL", "NULL cannot be compared"),
    ("TRUE = 1", "boolean constant cannot be compared"),
    ("a < 'x'", "value 'x' cannot be compared"),
    ("a > TRUE", "value TRUE cannot be compared"),
    ("a BETWEEN 'a' AND 'z'", "cannot be compared"),
    ("(a = 1) < 2", "boolean expression cannot be compared"),
    ("'x' IN ('x')", "IN needs an identifier"),
    ("a IN ()", "expected a string literal"),
    ("a IN (1, 2)", "expected a string literal"),
    ("a IN ('x' 'y')", "expected ',' or ')'"),
    ("a LIKE b", "expected a string literal"),
    ("a LIKE 'x' ESCAPE ''", "ESCAPE must be one character"),
    ("a LIKE 'x' ESCAPE 'ab'", "ESCAPE must be one character"),
    ("a IS 5", "expected NULL or NOT NULL after IS"),
    ("a NOT 5", "unexpected token 'NOT'"),
    ("a BETWEEN 1 OR 2", "expected AND in BETWEEN"),
    ("a = 08", "unexpected token '8'"),
    ("a = 0x", "unexpected token 'x'"),
    ("a = 1.2.3", "unexpected token '.3'"),
    ("a = 0xFFFFFFFFFFFFFFFF", "does not fit a long"),
    ("a = 1.5F", "unexpected token 'F'"),  # Artemis has no F/D suffixes
    ("a = 1.5D", "unexpected token 'D'"),
    ("a = 0L", "unexpected token 'L'"),  # 0 is an octal literal: no L suffix
    ("a = 1 -- no newline", "unexpected token 'newline'"),
    ("XPATH '//x'", "XPATH selectors are not supported"),
    ("hyphenated_props:a-b = 1", "prefix 'hyphenated_props:' is not supported"),
    ("é = 1", "unexpected character 'é'"),
]


@pytest.mark.parametrize("text,needle", ERRORS, ids=[e[0] or "<empty>" for e in ERRORS])
def test_errors_name_what_and_where(text, needle):
    with pytest.raises(SelectorError) as ei:
        parse_selector(text)
    e = ei.value
    assert needle in str(e), str(e)
    assert str(e).startswith("selector: ")
    assert e.condition == "amqp:invalid-field"
    assert isinstance(e, RemoteProtocolError)


def test_error_message_format_from_the_brief():
    with pytest.raises(SelectorError, match=r'at column 11 in "a = 1 AND AND b"$'):
        parse_selector("a = 1 AND AND b")


def test_non_string_selector():
    with pytest.raises(SelectorError):
        parse_selector(b"a = 1")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Bounds: size and depth (no RecursionError ever escapes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "(" * 100000 + "a" + ")" * 100000,
        "NOT " * 50000 + "a",
        "-" * 50000 + "a = 1",
        "a" + " + a" * 1000 + " = 1",
        "(" * 300 + "a" + ")" * 300,
    ],
    ids=["parens", "nots", "minus", "long-chain", "300-parens"],
)
def test_deep_or_huge_selectors_are_refused_cleanly(text):
    with pytest.raises(SelectorError, match="nested deeper than|longer than"):
        parse_selector(text)


def test_length_limit():
    ok = "a IN (" + ", ".join(["'x'"] * 10000) + ")"  # ~50 KiB, flat: accepted
    assert len(ok.encode()) < 64 * 1024
    parse_selector(ok)
    with pytest.raises(SelectorError, match="longer than 65536 bytes"):
        parse_selector("a = '" + "x" * 70000 + "'")


def test_depth_just_inside_the_limit_works():
    depth = MAX_DEPTH - 5
    sel = parse_selector("(" * depth + "i = 5" + ")" * depth)
    assert sel.matches(M)
    sel = parse_selector("NOT " * (depth - 2) + "trueProp")
    assert sel.evaluate(M) is ((depth - 2) % 2 == 0)


def test_deepest_selector_fits_a_busy_stack():
    # ~3 Python frames per nesting level when parsing, 1 when evaluating: a selector just
    # inside MAX_DEPTH must still work when the caller already sits 250 frames deep.
    text = "i = (" * (MAX_DEPTH - 1) + "5" + ")" * (MAX_DEPTH - 1)

    def at_depth(n):
        if n:
            return at_depth(n - 1)
        return parse_selector(text).evaluate(M)

    assert at_depth(250) is False  # (i = (5 = (5 = ...))): Integer vs Boolean is FALSE


def test_long_flat_or_chain_is_fine():
    text = " OR ".join(f"i = {n}" for n in range(5000))  # built in O(n): was O(n**2)
    assert parse_selector(text).matches(M)
    assert parse_selector("(i = 1 OR i = 2) OR (i = 5 OR i = 3) AND TRUE").matches(M)


def test_huge_literals_and_unclosed_comments():
    # int() refuses more than 4300 decimal digits: the literal must still parse (BigDecimal)
    assert ev("i = " + "9" * 60000) is False
    assert ev("i < 1" + "0" * 5000 + ".5") is True
    assert ev("i = 18446744073709551621") is True  # BigDecimal whose low 64 bits are 5 -> Int 5
    # many comment openers without a closer: one scan each, then a clean SelectorError
    for text in ("i = 1 " + "--" * 30000, "/*" * 30000):
        with pytest.raises(SelectorError):
            parse_selector(text)


# ---------------------------------------------------------------------------------------------
# API details
# ---------------------------------------------------------------------------------------------


def test_text_is_kept_and_compile_filter_treats_blank_as_no_filter():
    assert parse_selector(" i = 5 ").text == " i = 5 "
    assert compile_filter(None) is None
    assert compile_filter("") is None
    assert compile_filter(" \t\n") is None
    f = compile_filter("  i = 5 ")
    assert f is not None and f.text == "i = 5" and f.matches(M)
    with pytest.raises(SelectorError):
        compile_filter("i = ")


def test_filter_descriptor_constants():
    assert selmod.SELECTOR_FILTER_CODE == 0x0000468C00000004
    assert selmod.SELECTOR_FILTER_NAME == "apache.org:selector-filter:string"
