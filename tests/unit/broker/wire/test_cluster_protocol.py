"""The cluster link's wire format (broker/wire/cluster.py): every kind round-trips, every rule
of ``decode_forward`` / ``decode_note`` is enforced with the right AMQP condition, and the byte
layout is pinned by golden hex so that changing the wire format is a conscious decision.

Values that break a rule are built with the codec directly (``_fwd_fields``, ``_binding`` and
``_hello`` start from a valid field list and change one field; ``_note`` takes the fields as
given), because the encoders only write valid values.
"""

from __future__ import annotations

import pytest

from broker.wire.codec import Described, Long, Symbol, Timestamp, UByte, UInt, ULong, encode
from broker.wire.cluster import (FORWARD_DESCRIPTOR, MAX_BACKUPS, MAX_DESCRIPTION, MAX_FILTER, MAX_FILTERS,
                                     MAX_MEMBERS, MAX_NAME, MAX_TARGETS, NOTIFY_DESCRIPTOR, AddressNote, BackupsNote,
                                     BindingNote, ElectionNote, Forwarded, Hello,
                                     ProtocolError, Reset, Unbinding, decode_forward, decode_note, encode_forward,
                                     encode_note)
from broker.core.selector import MAX_SELECTOR_BYTES, parse_selector

DECODE = "amqp:decode-error"
INVALID = "amqp:invalid-field"

# an encoded AMQP message (a data section): the forward carries it as opaque bytes
MESSAGE = b"\x00Sw\xa1\x02hi"
FORWARD = Forwarded(b"\x01" * 16, "node-a", "orders", (("node-b", "orders"),), 0, True, 4, 1_700_000_000_000,
                    MESSAGE)
BINDING = BindingNote("node-b", "orders", "orders", "anycast", None, 2, ("color = 'red'",), 0)


# -- round trips ----------------------------------------------------------------------------------

@pytest.mark.parametrize("f", [
    FORWARD,
    Forwarded(b"\xff", "a", "b", (("n1", "q1"), ("n2", "q2"), ("n1", "q3")), 255, False, 0, 0, b"\x00"),
    Forwarded(b"d" * 256, "\u00e9\u2603", "x" * MAX_NAME, (("n" * MAX_NAME, "q" * MAX_NAME),), 1, True, 9,
              (1 << 63) - 1, b"\x00" * 70000),
    Forwarded(b"r", "a", "b", (("n1", "q1"),), 0, True, 4, 0, b"\x00", moved=True),
    Forwarded(b"s", "a", "b", (("n1", "q1"),), 0, True, 4, 0, b"\x00", ("multicast", "a = 1"), moved=True),
    Forwarded(b"s", "a", "b", (("n1", "q1"),), 0, True, 4, 0, b"\x00", ("anycast", None)),
], ids=["typical", "many-targets", "limits", "moved", "moved-with-create", "create"])
def test_forwarded_round_trips(f):
    assert decode_forward(encode_forward(f)) == f


def test_moved_is_an_eleventh_field_after_create_or_null():
    """Redistribution and scale-down mark their forwards ``moved`` (the receiving node does not
    check their ``_AMQ_DUPL_ID`` again); an older ten-field forward with a null create is plain."""
    plain = encode(Described(FORWARD_DESCRIPTOR, _fwd_fields() + [None]))
    assert decode_forward(plain) == decode_forward(_fwd())
    moved = encode(Described(FORWARD_DESCRIPTOR, _fwd_fields() + [None, True]))
    assert decode_forward(moved).moved is True and decode_forward(moved).create is None
    assert decode_forward(encode(Described(FORWARD_DESCRIPTOR, _fwd_fields() + [None, False]))).moved is False


@pytest.mark.parametrize("note", [
    Hello("node-a", "cluster-1", "amqp://127.0.0.1:5672", "http://127.0.0.1:8161", 1_700_000_000_000,
          (("node-b", "amqp://127.0.0.1:5673", ""), ("node-c", "amqps://h:5671", "http://h:1"))),
    Hello("node-a", "c", "amqp://h:1", "", 0),
    Reset(),
    BINDING,
    BindingNote("n", "q", "a", "multicast", "color = 'blue'", 0, (), 255),
    BindingNote("n", "q", "a", "anycast", None, 3, ("a = 1", "a = 1", "b = 2"), 1),
    Unbinding("node-b", "orders"),
    BackupsNote("node-a", (("amqp://127.0.0.1:5675", "http://127.0.0.1:8164", True),)),
    BackupsNote("node-a", (("amqps://h:5671", "", False), ("amqp://h2:5672", "http://h2:1", True))),
    BackupsNote("node-a", ()),
    AddressNote("work", ("anycast",), None, 5, "node-a", False, True),
    ElectionNote("node-a", "primary", "active", 1_700_000_000_000, "node-a", True),
    ElectionNote("node-b", "primary", "starting", 5, None, False),
    ElectionNote("node-c", "secondary", "active", 0, None, False),
], ids=["hello", "hello-alone", "reset", "binding", "binding-filtered", "binding-filters", "unbinding",
        "backups", "backups-two", "backups-none", "address-shared", "election-root", "election-starting", "election-secondary"])
def test_notifications_round_trip(note):
    assert decode_note(encode_note(note)) == note


def test_decoded_fields_have_the_python_types_the_encoder_takes():
    f = decode_forward(encode_forward(FORWARD))
    assert type(f.dup_id) is bytes and type(f.message) is bytes and type(f.targets) is tuple
    assert all(type(t) is tuple for t in f.targets)
    n = decode_note(encode_note(BINDING))
    assert type(n.consumer_filters) is tuple


def test_a_selector_the_broker_accepts_fits_in_a_binding_notification():
    """Any selector a client may attach with (and any queue filter) must reach the other nodes:
    a binding the receiving node refuses cuts the cluster link off on every reconnect."""
    text = "a = '" + "x" * (MAX_SELECTOR_BYTES - 7) + "'"
    assert len(text.encode()) <= MAX_SELECTOR_BYTES
    parse_selector(text)  # the broker accepts it from a client
    note = BindingNote("node-b", "q", "a", "multicast", text, 1, (text,), 0)
    assert decode_note(encode_note(note)) == note


def test_a_name_the_journal_stores_fits_in_a_binding_notification():
    """Queue and address names are limited by the journal (65535 bytes of UTF-8): any such name
    must reach the other nodes (tests/integration/test_cluster_long_names.py is the real case)."""
    note = BindingNote("node-b", "q" * 0xFFFF, "\u00e9" * (0xFFFF // 2), "anycast", None, 0, (), 0)
    assert len(note.address.encode()) <= 0xFFFF
    assert decode_note(encode_note(note)) == note
    assert decode_note(encode_note(Unbinding("node-b", note.queue))) == Unbinding("node-b", note.queue)


# -- rules: forwarded messages ---------------------------------------------------------------------

def _fwd_fields(**change) -> list:
    """A valid forwarded message's fields (as the codec sees them), with ``change`` applied."""
    fields = {"dup": b"\x01" * 16, "origin": "node-a", "address": "orders", "targets": [["node-b", "orders"]],
              "hops": UInt(0), "durable": True, "priority": UByte(4), "expires": Timestamp(0), "message": MESSAGE}
    for k, v in change.items():
        assert k in fields, k
        fields[k] = v
    return list(fields.values())


def _fwd(**change) -> bytes:
    return encode(Described(FORWARD_DESCRIPTOR, _fwd_fields(**change)))


TOO_LONG = "x" * (MAX_NAME + 1)


def test_the_valid_base_of_the_rule_tables_decodes():
    assert decode_forward(_fwd()).targets == (("node-b", "orders"),)
    assert decode_note(_binding()) == BindingNote("node-b", "q", "a", "anycast", None, 1, (), 0)


FORWARD_BREAKS = {
    # field count
    "8 fields": (_fwd_fields()[:8], "9"),
    "12 fields": (_fwd_fields() + [["anycast", None], True, None], "9 to 11"),
    "moved as null": (_fwd_fields() + [None, None], "moved"),
    "moved as a uint": (_fwd_fields() + [["anycast", None], UInt(1)], "moved"),
    "moved as a string": (_fwd_fields() + [None, "true"], "moved"),
    "create with a bad routing type": (_fwd_fields() + [["topic", None]], "create"),
    "create with a symbol routing type": (_fwd_fields() + [[Symbol("anycast"), None]], "create"),
    "create of one field": (_fwd_fields() + [["anycast"]], "create"),
    "no fields": ([], "9"),
    # dup-id: 1..256 bytes of binary
    "empty dup-id": (_fwd_fields(dup=b""), "dup-id"),
    "dup-id of 257 bytes": (_fwd_fields(dup=b"d" * 257), "dup-id"),
    "dup-id as a string": (_fwd_fields(dup="abc"), "dup-id"),
    "null dup-id": (_fwd_fields(dup=None), "dup-id"),
    # origin and address: strings of 1..MAX_NAME characters
    "empty origin": (_fwd_fields(origin=""), "origin"),
    "too-long origin": (_fwd_fields(origin=TOO_LONG), "origin"),
    "origin as a symbol": (_fwd_fields(origin=Symbol("node-a")), "origin"),
    "origin as binary": (_fwd_fields(origin=b"node-a"), "origin"),
    "null origin": (_fwd_fields(origin=None), "origin"),
    "empty address": (_fwd_fields(address=""), "address"),
    "too-long address": (_fwd_fields(address=TOO_LONG), "address"),
    "address as a uint": (_fwd_fields(address=UInt(7)), "address"),
    # targets: a list of 1..MAX_TARGETS [node, queue] pairs
    "no targets": (_fwd_fields(targets=[]), "targets"),
    "targets as a map": (_fwd_fields(targets={"node-b": "orders"}), "targets"),
    "targets as a string": (_fwd_fields(targets="node-b"), "targets"),
    "too many targets": (_fwd_fields(targets=[["n", "q"]] * (MAX_TARGETS + 1)), "targets"),
    "a target of one": (_fwd_fields(targets=[["node-b"]]), "pair"),
    "a target of three": (_fwd_fields(targets=[["node-b", "orders", "x"]]), "pair"),
    "a target as a string": (_fwd_fields(targets=["node-b"]), "pair"),
    "empty target node": (_fwd_fields(targets=[["", "orders"]]), "target node id"),
    "empty target queue": (_fwd_fields(targets=[["node-b", ""]]), "target queue"),
    "too-long target queue": (_fwd_fields(targets=[["node-b", TOO_LONG]]), "target queue"),
    "target node as a symbol": (_fwd_fields(targets=[[Symbol("node-b"), "orders"]]), "target node id"),
    "a bad target after a good one": (_fwd_fields(targets=[["n", "q"], ["n", None]]), "target queue"),
    # hops: uint <= 255
    "256 hops": (_fwd_fields(hops=UInt(256)), "hops"),
    "negative hops": (_fwd_fields(hops=Long(-1)), "hops"),
    "hops as a boolean": (_fwd_fields(hops=True), "hops"),
    "hops as a string": (_fwd_fields(hops="0"), "hops"),
    "null hops": (_fwd_fields(hops=None), "hops"),
    # durable: boolean
    "durable as a uint": (_fwd_fields(durable=UInt(1)), "durable"),
    "durable as a string": (_fwd_fields(durable="true"), "durable"),
    "null durable": (_fwd_fields(durable=None), "durable"),
    # priority: 0..9
    "priority 10": (_fwd_fields(priority=UByte(10)), "priority"),
    "priority 255": (_fwd_fields(priority=UByte(255)), "priority"),
    "negative priority": (_fwd_fields(priority=Long(-1)), "priority"),
    "priority as a boolean": (_fwd_fields(priority=False), "priority"),
    "priority as a double": (_fwd_fields(priority=4.0), "priority"),
    # expires: a timestamp >= 0
    "negative expiry": (_fwd_fields(expires=Timestamp(-1)), "expires"),
    "expiry as a double": (_fwd_fields(expires=1.5), "expires"),
    "expiry as a boolean": (_fwd_fields(expires=True), "expires"),
    "null expiry": (_fwd_fields(expires=None), "expires"),
    # message: non-empty binary
    "empty message": (_fwd_fields(message=b""), "message"),
    "message as a string": (_fwd_fields(message="hello"), "message"),
    "message as a list": (_fwd_fields(message=[b"x"]), "message"),
    "null message": (_fwd_fields(message=None), "message"),
}


@pytest.mark.parametrize("fields, says", FORWARD_BREAKS.values(), ids=FORWARD_BREAKS.keys())
def test_forwarded_message_rule_breaks_are_invalid_field(fields, says):
    with pytest.raises(ProtocolError) as e:
        decode_forward(encode(Described(FORWARD_DESCRIPTOR, fields)))
    assert e.value.condition == INVALID
    assert says in e.value.description


def _not_the_format(valid: bytes, descriptor: Symbol, other: Symbol, fields: list) -> dict:
    """Inputs that are not the format at all: ``amqp:decode-error``."""
    return {
        "nothing": b"",
        "one byte": b"\x00",
        "truncated": valid[:-1],
        "cut in the descriptor": valid[:5],
        "a trailing byte": valid + b"\x40",
        "two values": valid + valid,
        "unknown format code": b"\x00\xa3\x01x\xff",
        "the other descriptor": encode(Described(other, fields)),
        "a newer version": encode(Described(Symbol(str(descriptor)[:-1] + "2"), fields)),
        "a numeric descriptor": encode(Described(ULong(0x77), fields)),
        "a string descriptor": encode(Described(str(descriptor), fields)),
        "not described": encode(fields),
        "a described map": encode(Described(descriptor, {"a": 1})),
        "a described string": encode(Described(descriptor, "binding")),
        "an AMQP message": MESSAGE,
        "invalid UTF-8 in a string": valid.replace(b"\xa1\x06node-", b"\xa1\x06\xff\xfede-", 1),
        "a list size beyond the data": valid[:22] + b"\xc0\xff" + valid[24:],
    }


NOT_A_FORWARD = _not_the_format(encode_forward(FORWARD), FORWARD_DESCRIPTOR, NOTIFY_DESCRIPTOR, _fwd_fields())


@pytest.mark.parametrize("data", NOT_A_FORWARD.values(), ids=NOT_A_FORWARD.keys())
def test_bytes_that_are_not_a_forwarded_message_are_decode_error(data):
    with pytest.raises(ProtocolError) as e:
        decode_forward(data)
    assert e.value.condition == DECODE


def test_a_notification_on_the_forward_link_is_decode_error():
    with pytest.raises(ProtocolError) as e:
        decode_forward(encode_note(BINDING))
    assert e.value.condition == DECODE


# -- rules: notifications -------------------------------------------------------------------------------

def _binding(**change) -> bytes:
    fields = {"node": "node-b", "queue": "q", "address": "a", "rtype": "anycast", "filter": None,
              "consumers": UInt(1), "cfilters": [], "distance": UInt(0)}
    for k, v in change.items():
        assert k in fields, k
        fields[k] = v
    return encode(Described(NOTIFY_DESCRIPTOR, ["binding", *fields.values()]))


def _note(*fields) -> bytes:
    return encode(Described(NOTIFY_DESCRIPTOR, list(fields)))


HELLO = ["hello", "node-a", "c", "amqp://h:1", "http://h:2", Timestamp(5), [["node-b", "amqp://h:3", ""]], None]


def _hello(i: int, value) -> bytes:
    fields = list(HELLO)
    fields[i] = value
    return _note(*fields)


NOTE_BREAKS = {
    # kind
    "no fields": (_note(), "kind"),
    "kind as a uint": (_note(UInt(1), "n", "q"), "kind"),
    "null kind": (_note(None), "kind"),
    "kind as a symbol": (_note(Symbol("reset")), "kind"),
    "kind as binary": (_note(b"reset"), "kind"),
    "unknown kind": (_note("bind", "n", "q"), "unknown notification kind"),
    "kind in capitals": (_note("RESET"), "unknown notification kind"),
    "a very long unknown kind": (_note("k" * 100_000), "unknown notification kind"),
    # reset
    "reset with a field": (_note("reset", None), "reset"),
    # unbinding: node id, queue
    "unbinding of 1 field": (_note("unbinding", "n"), "2 fields"),
    "unbinding of 3 fields": (_note("unbinding", "n", "q", "x"), "2 fields"),
    "unbinding with an empty node": (_note("unbinding", "", "q"), "node id"),
    "unbinding with a too-long queue": (_note("unbinding", "n", TOO_LONG), "queue"),
    "unbinding with a symbol queue": (_note("unbinding", "n", Symbol("q")), "queue"),
    # binding: field count
    "binding of 7 fields": (_note("binding", "n", "q", "a", "anycast", None, UInt(0), []), "8 fields"),
    "binding of 9 fields": (_note("binding", "n", "q", "a", "anycast", None, UInt(0), [], UInt(0), None),
                            "8 fields"),
    # binding: names
    "binding with an empty node": (_binding(node=""), "node id"),
    "binding with a too-long node": (_binding(node=TOO_LONG), "node id"),
    "binding with a null node": (_binding(node=None), "node id"),
    "binding with an empty queue": (_binding(queue=""), "queue"),
    "binding with a too-long queue": (_binding(queue=TOO_LONG), "queue"),
    "binding with a binary queue": (_binding(queue=b"q"), "queue"),
    "binding with an empty address": (_binding(address=""), "address"),
    "binding with a too-long address": (_binding(address=TOO_LONG), "address"),
    # binding: routing type
    "routing type other": (_binding(rtype="other"), "routing type"),
    "routing type in capitals": (_binding(rtype="ANYCAST"), "routing type"),
    "routing type as a symbol": (_binding(rtype=Symbol("anycast")), "routing type"),
    "null routing type": (_binding(rtype=None), "routing type"),
    "routing type as a list": (_binding(rtype=["anycast"]), "routing type"),
    # binding: filter (null or a string)
    "empty filter": (_binding(filter=""), "filter"),
    "too-long filter": (_binding(filter="x" * (MAX_FILTER + 1)), "filter"),
    "filter as a symbol": (_binding(filter=Symbol("a = 1")), "filter"),
    "filter as a map": (_binding(filter={"selector": "a = 1"}), "filter"),
    # binding: consumers (uint <= 2**31)
    "negative consumers": (_binding(consumers=Long(-1)), "consumers"),
    "too many consumers": (_binding(consumers=ULong((1 << 31) + 1)), "consumers"),
    "consumers as a boolean": (_binding(consumers=True), "consumers"),
    "consumers as a string": (_binding(consumers="1"), "consumers"),
    "null consumers": (_binding(consumers=None), "consumers"),
    # binding: consumer filters
    "consumer filters as a string": (_binding(cfilters="a = 1"), "consumer filters"),
    "null consumer filters": (_binding(cfilters=None), "consumer filters"),
    "an empty consumer filter": (_binding(cfilters=[""]), "consumer filter"),
    "a too-long consumer filter": (_binding(cfilters=["x" * (MAX_FILTER + 1)]), "consumer filter"),
    "a consumer filter as a uint": (_binding(cfilters=[UInt(1)]), "consumer filter"),
    "a nested consumer filter": (_binding(cfilters=[["a = 1"]]), "consumer filter"),
    "more consumer filters than consumers": (_binding(consumers=UInt(1), cfilters=["a = 1", "b = 2"]),
                                             "more consumer filters than consumers"),
    "consumer filters and no consumers": (_binding(consumers=UInt(0), cfilters=["a = 1"]),
                                          "more consumer filters than consumers"),
    "too many consumer filters": (_binding(consumers=UInt(MAX_FILTERS + 1), cfilters=["a"] * (MAX_FILTERS + 1)),
                                  "consumer filters"),
    # binding: distance (uint <= 255)
    "distance 256": (_binding(distance=UInt(256)), "distance"),
    "negative distance": (_binding(distance=Long(-1)), "distance"),
    "null distance": (_binding(distance=None), "distance"),
    # hello
    "hello of 6 fields": (_note(*HELLO[:-1]), "7 fields"),
    "hello of 8 fields": (_note(*HELLO, None), "7 fields"),
    "hello with an empty group": (_hello(7, ""), "group"),
    "hello with a group as a number": (_hello(7, 5), "group"),
    "hello with an empty node": (_hello(1, ""), "node id"),
    "hello with a too-long cluster name": (_hello(2, TOO_LONG), "cluster name"),
    "hello with an empty connector": (_hello(3, ""), "connector"),
    "hello with a too-long management URL": (_hello(4, TOO_LONG), "management URL"),
    "hello with a negative start time": (_hello(5, Timestamp(-1)), "start time"),
    "hello with a start time as a string": (_hello(5, "now"), "start time"),
    "hello with a boolean start time": (_hello(5, True), "start time"),
    "hello with members as a map": (_hello(6, {"node-b": "amqp://h:3"}), "members"),
    "hello with too many members": (_hello(6, [["n", "c", ""]] * (MAX_MEMBERS + 1)), "members"),
    "hello with a member of two": (_hello(6, [["node-b", "amqp://h:3"]]), "member"),
    "hello with a member as a string": (_hello(6, ["node-b"]), "member"),
    "hello with an empty member node": (_hello(6, [["", "amqp://h:3", ""]]), "member node id"),
    "hello with an empty member connector": (_hello(6, [["n", "", ""]]), "member connector"),
    "hello with a too-long member URL": (_hello(6, [["n", "c", TOO_LONG]]), "member management URL"),
    # backups
    "backups of 1 field": (_note("backups", "node-a"), "2 fields"),
    "backups of 3 fields": (_note("backups", "node-a", [], None), "2 fields"),
    "backups with an empty node": (_note("backups", "", []), "node id"),
    "backups as a map": (_note("backups", "n", {"amqp://h:1": True}), "backups must be a list"),
    "too many backups": (_note("backups", "n", [["amqp://h:1", "", True]] * (MAX_BACKUPS + 1)),
                         "backups must be a list"),
    "a backup of two": (_note("backups", "n", [["amqp://h:1", ""]]), "a backup must be"),
    "a backup as a string": (_note("backups", "n", ["amqp://h:1"]), "a backup must be"),
    "a backup in sync as a string": (_note("backups", "n", [["amqp://h:1", "", "yes"]]), "a backup must be"),
    "a backup with an empty connector": (_note("backups", "n", [["", "", True]]), "backup connector"),
    "a backup connector as a symbol": (_note("backups", "n", [[Symbol("amqp://h:1"), "", True]]),
                                       "backup connector"),
    "a backup with a too-long management URL": (_note("backups", "n", [["amqp://h:1", TOO_LONG, True]]),
                                                "backup management URL"),
    # shared addresses
    "address of 8 fields": (_note("address", "a", ["anycast"], None, Timestamp(1), "n", False, True, True),
                            "6 or 7 fields"),
    "address shared as a string": (_note("address", "a", ["anycast"], None, Timestamp(1), "n", False, "yes"),
                                   "shared must be a boolean"),
    "a shared address with routing types as a number": (
        _note("address", "a", 5, None, Timestamp(1), "n", False, True), "routing types must be a non-empty list"),
    "a shared multicast address": (_note("address", "a", ["multicast"], None, Timestamp(1), "n", False, True),
                                   "a shared address needs the anycast routing type"),
    # election
    "election of 5 fields": (_note("election", "n", "primary", "active", Timestamp(1), None), "6 fields"),
    "election with an empty node": (_note("election", "", "primary", "active", Timestamp(1), None, False), "node id"),
    "election of another partition": (_note("election", "n", "tertiary", "active", Timestamp(1), None, False),
                                      "partition 'tertiary'"),
    "election partition as a symbol": (_note("election", "n", Symbol("primary"), "active", Timestamp(1), None, False),
                                       "partition"),
    "election state unknown": (_note("election", "n", "primary", "broken", Timestamp(1), None, False), "state 'broken'"),
    "election start time negative": (_note("election", "n", "primary", "active", -1, None, False), "start time"),
    "election start time a boolean": (_note("election", "n", "primary", "active", True, None, False), "start time"),
    "election root as a string": (_note("election", "n", "primary", "active", Timestamp(1), "n", "yes"),
                                  "root must be a boolean"),
    "election vote empty": (_note("election", "n", "primary", "active", Timestamp(1), "", False), "vote"),
    "a secondary that votes": (_note("election", "n", "secondary", "active", Timestamp(1), "p", False),
                               "a secondary neither votes nor is root"),
    "a secondary that is root": (_note("election", "n", "secondary", "active", Timestamp(1), None, True),
                                 "a secondary neither votes nor is root"),
    "a starting root": (_note("election", "n", "primary", "starting", Timestamp(1), None, True),
                        "a root must be active"),
}


@pytest.mark.parametrize("data, says", NOTE_BREAKS.values(), ids=NOTE_BREAKS.keys())
def test_notification_rule_breaks_are_invalid_field(data, says):
    with pytest.raises(ProtocolError) as e:
        decode_note(data)
    assert e.value.condition == INVALID
    assert says in e.value.description


@pytest.mark.parametrize("data", [
    _note("k" * 100_000),
    _binding(rtype="r" * 100_000),
    _binding(rtype=["r" * 60_000, "s" * 60_000]),
], ids=["unknown kind", "routing type", "routing type as a list"])
def test_descriptions_quote_what_the_peer_sent_but_stay_short(data):
    """The description goes into the Close we send: 64 KiB of quoted name would make a frame
    larger than the peer's max-frame-size, and it would see a framing error instead."""
    with pytest.raises(ProtocolError) as e:
        decode_note(data)
    assert len(e.value.description) <= MAX_DESCRIPTION
    assert str(e.value) == e.value.description


def test_a_long_description_is_cut_in_the_error_itself():
    e = ProtocolError(INVALID, "binding of node " + repr("n" * MAX_NAME) + " at distance 0")
    assert len(e.description) == MAX_DESCRIPTION and e.description.endswith("...")
    assert ProtocolError(INVALID, "short").description == "short"


NOT_A_NOTE = _not_the_format(encode_note(BINDING), NOTIFY_DESCRIPTOR, FORWARD_DESCRIPTOR,
                             ["binding", "n", "q", "a", "anycast", None, UInt(0), [], UInt(0)])


@pytest.mark.parametrize("data", NOT_A_NOTE.values(), ids=NOT_A_NOTE.keys())
def test_bytes_that_are_not_a_notification_are_decode_error(data):
    with pytest.raises(ProtocolError) as e:
        decode_note(data)
    assert e.value.condition == DECODE


def test_a_forwarded_message_on_the_notification_link_is_decode_error():
    with pytest.raises(ProtocolError) as e:
        decode_note(encode_forward(FORWARD))
    assert e.value.condition == DECODE


# -- golden bytes -------------------------------------------------------------------------------------
# Never edit these to make a test pass: a difference is a change of the wire format, which nodes
# of two versions in one cluster would not agree on (bump the descriptor's version instead).

GOLDEN_FORWARD = (
    "00a3146c6f646573746f6e653a666f72776172643a7631"   # described, sym8 "lodestone:forward:v1"
    "c04f09"                                           # list8, 79 bytes, 9 fields
    "a01001010101010101010101010101010101"             # dup-id: vbin8 16 bytes
    "a1066e6f64652d61"                                 # origin: str8 "node-a"
    "a1066f7264657273"                                 # address: str8 "orders"
    "c01401c01102a1066e6f64652d62a1066f7264657273"     # targets: [["node-b", "orders"]]
    "43"                                               # hops: uint0
    "41"                                               # durable: true
    "5004"                                             # priority: ubyte 4
    "830000018bcfe56800"                               # expires: timestamp 1700000000000
    "a007005377a1026869"                               # message: vbin8, the producer's bytes
)
GOLDEN_BINDING = (
    "00a3136c6f646573746f6e653a6e6f746966793a7631"     # described, sym8 "lodestone:notify:v1"
    "c04109"                                           # list8, 65 bytes, 9 fields
    "a10762696e64696e67"                               # kind: str8 "binding"
    "a1066e6f64652d62"                                 # node id: "node-b"
    "a1066f7264657273"                                 # queue: "orders"
    "a1066f7264657273"                                 # address: "orders"
    "a107616e7963617374"                               # routing type: "anycast"
    "40"                                               # filter: null
    "5202"                                             # consumers: smalluint 2
    "c01001a10d636f6c6f72203d202772656427"             # consumer filters: ["color = 'red'"]
    "43"                                               # distance: uint0
)


def test_golden_forwarded_message():
    data = encode_forward(FORWARD)
    assert data.hex() == GOLDEN_FORWARD
    assert decode_forward(bytes.fromhex(GOLDEN_FORWARD)) == FORWARD


def test_golden_binding_notification():
    data = encode_note(BINDING)
    assert data.hex() == GOLDEN_BINDING
    assert decode_note(bytes.fromhex(GOLDEN_BINDING)) == BINDING
