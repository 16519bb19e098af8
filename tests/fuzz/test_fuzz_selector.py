"""Fuzz broker.core.selector: any text parses or raises SelectorError (never anything else, never
RecursionError); selectors generated from the grammar always parse; evaluation on arbitrary,
garbled or real proton-encoded messages never raises and is three-valued. Profiles: ``fast``
(default) and ``deep`` (HYPOTHESIS_PROFILE=deep), registered in tests/conftest.py."""

from __future__ import annotations

import proton
from hypothesis import example, given
from hypothesis import strategies as st
from proton import Message

from broker.core.selector import MessageView, SelectorError, parse_selector

KEYWORDS = {"NOT", "AND", "OR", "BETWEEN", "LIKE", "ESCAPE", "IN", "IS", "TRUE", "FALSE", "NULL",
            "XPATH", "XQUERY"}

# ---------------------------------------------------------------------------------------------
# Arbitrary text
# ---------------------------------------------------------------------------------------------

TOKENS = ["a", "b", "i", "s", "JMSPriority", "JMSMessageID", '"m.x-opt-foo"', "'x'", "'%_'",
          "''''", "1", "0x1F", "017", "1.5e3", ".5", "5L", "NULL", "TRUE", "FALSE", "NOT", "AND",
          "OR", "BETWEEN", "LIKE", "ESCAPE", "IN", "IS", "(", ")", ",", "=", "<>", "<", ">", "<=",
          ">=", "+", "-", "*", "/", "%", "--", "/*", "*/", "\n", "'", '"', "XPATH", "é", "!"]

token_soup = st.lists(st.sampled_from(TOKENS), max_size=30).map(" ".join)
texts = st.one_of(st.text(max_size=200), token_soup,
                  st.text(alphabet="()'\"-+*/=<>NOTANDOR a1%_.", max_size=100))


@given(text=texts)
@example(text="(" * 5000)
@example(text="NOT " * 5000)
@example(text="a = '")
@example(text="a BETWEEN")
def test_any_text_parses_or_raises_selector_error(text):
    try:
        sel = parse_selector(text)
    except SelectorError as e:
        assert str(e).startswith("selector: ")
        assert e.condition == "amqp:invalid-field"
    else:
        assert sel.text == text


# ---------------------------------------------------------------------------------------------
# Grammar-generated selectors
# ---------------------------------------------------------------------------------------------

plain_ids = st.from_regex(r"\A[a-zA-Z_$][a-zA-Z0-9_$]{0,6}\Z").filter(lambda s: s.upper() not in KEYWORDS)
known_ids = st.sampled_from(["i", "l", "d", "f", "s", "t", "n", "u", "bin", "sym", "JMSPriority",
                             "JMSMessageID", "JMSTimestamp", "JMSType", "JMSDeliveryMode",
                             "JMSExpiration", "JMSCorrelationID", "JMSXGroupSeq", "JMSXUserID",
                             "AMQSize", '"m.x-opt-foo"', '"m.k"', '"weird ""name"""'])
idents = st.one_of(known_ids, plain_ids)


def quote(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


str_lits = st.text(max_size=8).map(quote)
num_lits = st.one_of(
    st.integers(0, 2**70).map(str),
    st.integers(0, 2**63 - 1).map(lambda n: hex(n)),
    st.integers(0, 2**63 - 1).map(lambda n: "0" + oct(n)[2:]),
    st.floats(allow_nan=False, allow_infinity=False, min_value=0).map(repr),
    st.integers(1, 2**31).map(lambda n: f"{n}L"),
)
num_exprs = st.recursive(
    st.one_of(idents, num_lits),
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["+", "-", "*", "/", "%"]), inner).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"),
        inner.map(lambda x: f"(- {x})"),
        inner.map(lambda x: f"(+ {x})"),
    ),
    max_leaves=8,
)
like_pats = st.text(alphabet="ab%_!.*(\\", max_size=6).map(quote)
bool_atoms = st.one_of(
    st.tuples(num_exprs, st.sampled_from(["=", "<>", "<", ">", "<=", ">="]), num_exprs).map(" ".join),
    st.tuples(idents, st.sampled_from(["=", "<>"]), str_lits).map(" ".join),
    st.tuples(idents, st.sampled_from(["LIKE", "NOT LIKE"]), like_pats,
              st.sampled_from(["", " ESCAPE '!'", " ESCAPE '\\'"])).map(lambda t: f"{t[0]} {t[1]} {t[2]}{t[3]}"),
    st.tuples(idents, st.sampled_from(["IN", "NOT IN"]), st.lists(str_lits, min_size=1, max_size=6)).map(
        lambda t: f"{t[0]} {t[1]} ({', '.join(t[2])})"),
    st.tuples(num_exprs, st.sampled_from(["BETWEEN", "NOT BETWEEN"]), num_exprs, num_exprs).map(
        lambda t: f"{t[0]} {t[1]} {t[2]} AND {t[3]}"),
    st.tuples(idents, st.sampled_from(["IS NULL", "IS NOT NULL"])).map(" ".join),
    idents,
    st.sampled_from(["TRUE", "FALSE", "NULL"]),
)
selectors = st.recursive(
    bool_atoms,
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["AND", "OR", "and", "Or"]), inner).map(
            lambda t: f"({t[0]}) {t[1]} ({t[2]})"),
        inner.map(lambda x: f"NOT ({x})"),
    ),
    max_leaves=10,
)

# ---------------------------------------------------------------------------------------------
# Messages: real proton encodings, garbled ones and arbitrary bytes
# ---------------------------------------------------------------------------------------------

prop_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(),
    st.integers(-(2**31), 2**31 - 1).map(proton.int32), st.integers(0, 2**64 - 1).map(proton.ulong),
    st.integers(0, 2**32 - 1).map(proton.uint), st.integers(-(2**15), 2**15 - 1).map(proton.short),
    st.floats(width=32).map(proton.float32), st.text(max_size=8), st.binary(max_size=8),
    st.text(alphabet="abc", min_size=1, max_size=3).map(proton.symbol),
    st.integers(0, 2**40).map(proton.timestamp),
)
prop_names = st.one_of(st.sampled_from(["i", "l", "d", "f", "s", "t", "n", "u", "bin", "sym"]), plain_ids)


@st.composite
def proton_messages(draw) -> bytes:
    optional = {  # proton-python refuses None for these: leave them out instead
        "ttl": st.integers(0, 10**6).map(lambda n: n / 1000),
        "creation_time": st.integers(0, 2**40).map(lambda n: n / 1000),
        "group_sequence": st.integers(0, 2**31 - 1),
        "subject": st.text(max_size=6),
        "id": st.one_of(st.text(max_size=6), st.integers(0, 2**64 - 1).map(proton.ulong),
                        st.uuids(), st.binary(max_size=6)),
        "correlation_id": st.one_of(st.text(max_size=6), st.uuids(), st.binary(max_size=4)),
    }
    kw = {k: draw(v) for k, v in optional.items() if draw(st.booleans())}
    m = Message(
        body=draw(st.one_of(st.none(), st.text(max_size=5), st.binary(max_size=5))),
        properties=draw(st.dictionaries(prop_names, prop_values, max_size=6)),
        annotations={proton.symbol("x-opt-foo"): draw(prop_values), proton.symbol("k"): draw(prop_values)},
        user_id=draw(st.binary(max_size=6)),
        priority=draw(st.integers(0, 255)),
        durable=draw(st.booleans()),
        **kw,
    )
    return m.encode()


@st.composite
def garbled(draw) -> bytes:
    data = bytearray(draw(proton_messages()))
    for _ in range(draw(st.integers(1, 6))):
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[i] = draw(st.sampled_from([0x00, 0xFF, 0x7F, 0x80, 0x40, 0xA1, 0xB0, 0xC1, 0xD1, 0xF0]))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[i : i + draw(st.integers(1, 8))]
        else:
            del data[i:]
    return bytes(data)


messages = st.one_of(proton_messages(), garbled(), st.binary(max_size=200))


@given(text=selectors, data=messages)
@example(text="i + s = 1", data=Message(properties={"i": 1, "s": "x"}).encode())
@example(text="- sh = 1", data=Message(properties={"sh": proton.short(1)}).encode())
@example(text="bin < 1", data=Message(properties={"bin": b"x"}).encode())
def test_generated_selectors_parse_and_never_raise(text, data):
    sel = parse_selector(text)  # must not raise: the grammar only makes valid selectors
    view = MessageView(data)
    # evaluate() lets internal bugs through (only Artemis's "reject the message" is caught) ...
    result = sel.evaluate(view)
    assert result in (True, False, None)
    # ... matches() never raises and agrees with it.
    assert sel.matches(view) is (result is True)
    # NOT flips TRUE/FALSE and keeps UNKNOWN.
    negated = parse_selector(f"NOT ({text})").evaluate(MessageView(data))
    assert negated is (None if result is None else not result)
