"""Duplicate-id detection, pure (broker/core/duplicates.py, Broker.publish_once, transactions, and
the ``_AMQ_DUPL_ID`` reader of broker/amqp/engine.py): the key of an id, the per-address rings
and the node-wide cap, what goes to the store and in which group, recovery, the transaction
rules, and what the reader says about every type Artemis's cast would or would not take."""

from __future__ import annotations

import uuid

import pytest
from proton import Message as PMessage, int32, symbol, ubyte, uint, ulong

from broker.wire.codec import Described, Symbol, encode
from broker.amqp.message import message_duplicate_id
from broker.core.addresses import ANYCAST, MULTICAST, AddressSettings, Broker, SettingsResolver
from broker.core.duplicates import (ADDRESS_RECORDS, MISSING, ORIGIN_RECORDS, DuplicateIds, InvalidDuplicateId,
                                    duplicate_key)
from broker.core.queues import Subscription
from broker.core.transactions import TransactionTable
from broker.wire.errors import DecodeError


class RecordStore:
    """The store calls that matter here; inside begin_group/end_group they form one group."""

    def __init__(self):
        # ("add", queue, mid), ("record", name, mid, key), ("unrecord", name, mid), ("group", [...])
        self.ops = []
        self.records = {}          # (name, mid) -> key: what a journal would hold
        self._group = None

    def _op(self, op):
        (self._group if self._group is not None else self.ops).append(op)

    def add(self, queue, msg):
        self._op(("add", queue, msg.mid))

    def remove(self, queue, msg):
        self._op(("remove", queue, msg.mid))

    def delivery_count_changed(self, queue, msg):
        self._op(("count", queue, msg.mid))

    def queue_created(self, d):
        pass

    def queue_deleted(self, name):
        pass

    def add_record(self, name, mid, body):
        self._op(("record", name, mid, body))
        self.records[(name, mid)] = body

    def remove_record(self, name, mid):
        self._op(("unrecord", name, mid))
        del self.records[(name, mid)]

    def begin_group(self):
        assert self._group is None
        self._group = []

    def end_group(self):
        ops, self._group = self._group, None
        if ops:
            self.ops.append(("group", ops))
        return bool(ops)

    def recovered(self) -> dict:
        """The records as Node.recover hands them over: pseudo-queue -> [(mid, key)]."""
        out = {}
        for (name, mid), key in sorted(self.records.items(), key=lambda kv: kv[0][1]):
            out.setdefault(name, []).append((mid, key))
        return out


def make(size=3, max_ids=1000, persist=True, **settings):
    store = RecordStore()
    dups = DuplicateIds(size=size, persist=persist, max_ids=max_ids)
    b = Broker(SettingsResolver(AddressSettings(**settings)), store, duplicates=dups)
    b.declare_address("q", [ANYCAST])
    store.ops.clear()
    return b, store


def k(i) -> bytes:
    return duplicate_key(f"id-{i}".encode(), string=True)


def depth(b, name="q") -> int:
    return len(b.queues[name].messages)


# -- keys -------------------------------------------------------------------------------------------

def test_a_string_and_a_binary_id_with_the_same_bytes_are_different_ids():
    assert duplicate_key(b"abc", string=True) != duplicate_key(b"abc", string=False)
    # the key is the id's bytes behind a tag byte: S for a string id, B for a binary one
    assert duplicate_key(b"abc", string=True) == b"Sabc"
    assert duplicate_key(b"abc", string=False) == b"Babc"


@pytest.mark.parametrize("n", [0, 1, 64, 65, 1000, 70_000])
def test_any_length_is_accepted_and_a_key_never_exceeds_65_bytes(n):
    a = duplicate_key(b"x" * n, string=False)
    b = duplicate_key(b"x" * n + b"y", string=False)
    assert len(a) <= 65 and len(b) <= 65
    assert a != b
    assert duplicate_key(b"x" * n, string=False) == a


def test_a_short_id_is_kept_as_it_is_a_long_one_as_a_digest():
    assert duplicate_key(str(uuid.UUID(int=1)).encode(), string=True) == b"S" + str(uuid.UUID(int=1)).encode()
    assert duplicate_key(b"z" * 100, string=True)[:1] == b"H"


# -- the rings, per address ----------------------------------------------------------------------------

def test_a_resend_is_not_routed_and_the_first_copy_is_stored_once():
    b, store = make()
    assert b.publish_once("q", k(1), b"m1", True) == (False, True)
    assert b.publish_once("q", k(1), b"m1", True) == (True, True)    # answered after the fsync
    assert b.publish_once("q", k(1), b"other body", False) == (True, True)
    assert depth(b) == 1
    assert b.duplicates.dropped["q"] == 2
    # one group: the message and its id
    (group,) = [op[1] for op in store.ops if op[0] == "group"]
    assert [op[0] for op in group] == ["add", "record"]
    assert group[1][1] == ADDRESS_RECORDS + "q" and group[1][3] == k(1)


def test_a_non_durable_message_s_id_is_remembered_in_memory_only():
    b, store = make()
    assert b.publish_once("q", k(1), b"m", False) == (False, False)
    assert store.ops == [] and store.records == {}
    assert b.publish_once("q", k(1), b"m", False) == (True, False)   # nothing journaled: answer at once
    assert depth(b) == 1


def test_ids_are_per_address():
    b, _ = make()
    b.declare_address("r", [ANYCAST])
    assert not b.publish_once("q", k(1), b"m", True)[0]
    assert not b.publish_once("r", k(1), b"m", True)[0]
    assert depth(b, "q") == depth(b, "r") == 1


def test_the_ring_forgets_the_oldest_id_and_its_record():
    b, store = make(size=3)
    for i in range(3):
        b.publish_once("q", k(i), b"m", True)
    assert {key for key in store.records.values()} == {k(0), k(1), k(2)}
    b.publish_once("q", k(3), b"m", True)
    last = [op[1] for op in store.ops if op[0] == "group"][-1]
    assert [op[0] for op in last] == ["add", "record", "unrecord"]   # the eviction is in the same group
    assert {key for key in store.records.values()} == {k(1), k(2), k(3)}
    assert b.publish_once("q", k(0), b"m", True)[0] is False          # forgotten: routed again
    assert b.publish_once("q", k(3), b"m", True)[0] is True
    assert b.duplicates.remembered("q") == 3


def test_a_per_address_id_cache_size_overrides_the_node_s():
    store = RecordStore()
    settings = SettingsResolver(AddressSettings(), (("small.#", AddressSettings(id_cache_size=1)),))
    b = Broker(settings, store, duplicates=DuplicateIds(size=5))
    b.declare_address("small.a", [ANYCAST])
    b.declare_address("big", [ANYCAST])
    for i in range(4):
        b.publish_once("small.a", k(i), b"m", True)
        b.publish_once("big", k(i), b"m", True)
    assert b.duplicates.remembered("small.a") == 1 and b.duplicates.remembered("big") == 4
    assert b.publish_once("small.a", k(2), b"m", True)[0] is False
    assert b.publish_once("big", k(2), b"m", True)[0] is True


def test_the_node_cap_takes_the_oldest_ids_of_the_least_recently_used_address():
    b, store = make(size=10, max_ids=5)
    for a in ("a", "b", "c"):
        b.declare_address(a, [ANYCAST])
    for i in range(2):
        b.publish_once("a", k(i), b"m", True)
    for i in range(2):
        b.publish_once("b", k(i), b"m", True)
    b.publish_once("c", k(0), b"m", True)
    assert b.duplicates.address_ids == 5 and b.duplicates.cap_evicted == 0
    b.publish_once("c", k(1), b"m", True)         # one over: "a" (least recent) loses its oldest
    assert b.duplicates.address_ids == 5 and b.duplicates.cap_evicted == 1
    assert b.duplicates.lookup("a", k(0)) is MISSING and b.duplicates.lookup("a", k(1)) is not MISSING
    b.publish_once("c", k(2), b"m", True)         # "a" gives up its last id: no cache left
    assert "a" not in b.duplicates.addresses
    assert b.duplicates.remembered("b") == 2 and b.duplicates.remembered("c") == 3
    assert len(store.records) == 5               # the journal follows


def test_the_cap_may_shrink_the_only_cache_to_the_cap():
    b, _ = make(size=10, max_ids=2)
    for i in range(5):
        b.publish_once("q", k(i), b"m", True)
    assert b.duplicates.remembered("q") == 2
    assert b.publish_once("q", k(4), b"m", True)[0] is True


def test_deleting_the_last_queue_of_an_address_forgets_its_ids_and_records():
    b, store = make()
    b.publish_once("q", k(1), b"m", True)
    b.duplicates.dropped["q"] += 0
    b.delete_address("q")
    assert store.records == {}
    assert b.duplicates.address_ids == 0 and "q" not in b.duplicates.dropped
    b.declare_address("q", [ANYCAST])
    assert b.publish_once("q", k(1), b"m", True)[0] is False


def test_a_multicast_address_keeps_its_ids_while_a_subscription_remains():
    b, _ = make()
    b.declare_address("t", [MULTICAST])
    q1 = b.subscription_queue("t", "s1", durable=True)
    q2 = b.subscription_queue("t", "s2", durable=True)
    assert b.publish_once("t", k(1), b"m", True) == (False, True)
    assert len(q1.messages) == len(q2.messages) == 1
    b.delete_queue("s1")
    assert b.publish_once("t", k(1), b"m", True)[0] is True
    b.delete_queue("s2")
    assert b.duplicates.remembered("t") == 0


def test_without_persistence_nothing_is_written():
    b, store = make(persist=False)
    b.publish_once("q", k(1), b"m", True)
    assert store.records == {}
    assert b.publish_once("q", k(1), b"m", True) == (True, False)


# -- recovery ----------------------------------------------------------------------------------------

def test_restore_rebuilds_every_cache_in_order():
    b, store = make(size=3)
    b.declare_address("r", [ANYCAST])
    for i in range(3):
        b.publish_once("q", k(i), b"m", True)
    b.publish_once("r", k(9), b"m", True)
    b.duplicates.remember_from("node-x", b"fwd-1", persist=True)
    records = store.recovered()
    fresh = DuplicateIds(size=3)
    fresh.store = RecordStore()
    assert fresh.restore(records) == 5
    assert records == {}                            # taken out of what the node recovered
    assert [key for key, _t in fresh.addresses["q"].items()] == [k(0), k(1), k(2)]
    assert fresh.lookup("r", k(9)) is not MISSING and fresh.address_ids == 4
    assert fresh.seen_from("node-x", b"fwd-1")
    assert list(fresh.addresses) == ["q", "r"]     # least recently written first


def test_restore_with_a_smaller_size_or_cap_removes_the_records_that_no_longer_fit():
    b, store = make(size=5)
    for i in range(5):
        b.publish_once("q", k(i), b"m", True)
    fresh = DuplicateIds(size=2)
    fresh.store = store
    fresh.restore(store.recovered())
    assert [key for key, _t in fresh.addresses["q"].items()] == [k(3), k(4)]
    assert sorted(store.records.values()) == [k(3), k(4)]
    capped = DuplicateIds(size=5, max_ids=1)
    capped.store = store
    capped.restore(store.recovered())
    assert capped.address_ids == 1 and list(store.records.values()) == [k(4)]


def test_records_of_other_kinds_are_left_alone():
    fresh = DuplicateIds()
    other = {"$lodestone.records.something": [(1, b"x")]}
    fresh.restore(other)
    assert other == {"$lodestone.records.something": [(1, b"x")]}


# -- per origin (the cluster bridge) --------------------------------------------------------------------

def test_origin_caches_use_the_cluster_s_size_and_are_not_capped():
    d = DuplicateIds(size=10, max_ids=1, origin_size=2)
    store = d.store = RecordStore()
    d.next_mid = iter(range(1, 100)).__next__
    for i in range(3):
        d.remember_from("n1", b"%d" % i, persist=True)
    assert len(d.origin("n1")) == 2 and d.address_ids == 0
    assert sorted(store.records) == [(ORIGIN_RECORDS + "n1", 2), (ORIGIN_RECORDS + "n1", 3)]
    assert d.seen_from("n1", b"2") and not d.seen_from("n1", b"0")
    assert d.dropped_from("n1") == 1 and d.dropped_from("n2") == 0


# -- transactions --------------------------------------------------------------------------------------

def test_a_committed_transaction_s_ids_go_in_its_group_and_are_remembered():
    b, store = make()
    table = TransactionTable("c1")
    t = table.declare()
    t.publish("q", b"a", True, dup_key=k(1))
    t.publish("q", b"b", True, dup_key=k(2))
    t.publish("q", b"c", True)
    r = table.discharge(t.txn_id, False, b)
    assert r.committed and r.stored
    (group,) = [op[1] for op in store.ops if op[0] == "group"]
    assert [op[0] for op in group] == ["add", "record", "add", "record", "add"]
    assert b.publish_once("q", k(2), b"x", True)[0] is True


def test_a_duplicate_in_a_transaction_rolls_it_back_at_the_discharge():
    b, _ = make()
    b.publish_once("q", k(1), b"m", True)
    table = TransactionTable("c1")
    t = table.declare()
    t.publish("q", b"a", True, dup_key=k(2))
    t.publish("q", b"b", True, dup_key=k(1))     # committed meanwhile by someone else
    r = table.discharge(t.txn_id, False, b)
    assert not r.committed and r.error is not None and r.error.condition == "amqp:transaction:rollback"
    assert "duplicate" in r.error.description
    assert depth(b) == 1 and b.duplicates.lookup("q", k(2)) is MISSING
    assert b.duplicates.dropped["q"] == 1


def test_one_id_twice_in_one_transaction_fails_it():
    b, _ = make()
    table = TransactionTable("c1")
    t = table.declare()
    t.publish("q", b"a", True, dup_key=k(1))
    t.publish("q", b"b", True, dup_key=k(1))
    r = table.discharge(t.txn_id, False, b)
    assert not r.committed and r.error is not None
    assert depth(b) == 0


def test_a_rolled_back_transaction_leaves_its_ids_unremembered():
    b, _ = make()
    table = TransactionTable("c1")
    t = table.declare()
    t.publish("q", b"a", True, dup_key=k(1))
    table.discharge(t.txn_id, True, b)
    assert b.publish_once("q", k(1), b"a", True)[0] is False


def test_the_duplicate_hook_hears_every_duplicate():
    b, _ = make()
    heard = []
    b.duplicates.on_duplicate = lambda address, tx: heard.append((address, tx))
    b.publish_once("q", k(1), b"m", True)
    b.publish_once("q", k(1), b"m", True)
    table = TransactionTable("c1")
    t = table.declare()
    t.publish("q", b"a", True, dup_key=k(1))
    table.discharge(t.txn_id, False, b)
    assert heard == [("q", False), ("q", True)]


# -- reading _AMQ_DUPL_ID from a message ------------------------------------------------------------------

def encoded(**kw) -> bytes:
    return PMessage(**kw).encode()


@pytest.mark.parametrize("props, expect", [
    ({"_AMQ_DUPL_ID": "abc"}, (b"abc", True)),
    ({"_AMQ_DUPL_ID": b"\x00\xff"}, (b"\x00\xff", False)),
    ({"_AMQ_DUPL_ID": ""}, (b"", True)),
    ({"_AMQ_DUPL_ID": "x" * 300}, (b"x" * 300, True)),          # str32
    ({"_AMQ_DUPL_ID": b"y" * 70_000}, (b"y" * 70_000, False)),  # vbin32, over 64 KiB
    ({"_AMQ_DUPL_ID": "\u00e9t\u00e9"}, ("\u00e9t\u00e9".encode(), True)),
    ({"a": 1, "b": [1, 2], "c": {"x": "y"}, "_AMQ_DUPL_ID": "late"}, (b"late", True)),
    ({"_AMQ_DUPL_ID": None}, None),
    ({"other": "x"}, None),
    ({"_AMQ_DUPL_ID_NOT": "x"}, None),
    (None, None),
], ids=["string", "binary", "empty", "str32", "vbin32", "utf8", "after-others", "null", "absent", "longer-key",
        "no-properties"])
def test_the_id_is_read_from_the_application_properties(props, expect):
    assert message_duplicate_id(encoded(body="b", durable=True, properties=props, subject="s", id=7,
                                        annotations={symbol("x-opt-a"): 1})) == expect


@pytest.mark.parametrize("value, name", [
    (5, "long"), (int32(5), "int"), (ulong(5), "ulong"), (uint(5), "uint"), (ubyte(5), "ubyte"), (True, "boolean"),
    (1.5, "double"),
    (uuid.UUID(int=5), "uuid"), (symbol("abc"), "symbol"), ([1, 2], "list"), ({"a": 1}, "map"),
], ids=lambda v: str(v))
def test_another_type_is_refused_naming_it(value, name):
    with pytest.raises(InvalidDuplicateId) as e:
        message_duplicate_id(encoded(body="b", properties={"_AMQ_DUPL_ID": value}))
    assert e.value.condition == "amqp:invalid-field" and name in e.value.description


def test_the_key_only_in_the_body_is_no_id():
    assert message_duplicate_id(encoded(body="_AMQ_DUPL_ID", properties={"a": "_AMQ_DUPL_ID"})) is None


def test_a_value_that_is_not_utf8_elsewhere_in_the_map_is_skipped_unread():
    bad = b"\x00\x53\x74" + encode({"k": "v", "_AMQ_DUPL_ID": "id"}).replace(b"\xa1\x01v", b"\xa1\x01\xff")
    assert message_duplicate_id(bad + b"\x00\x53\x77\xa1\x01x") == (b"id", True)


def test_a_described_value_before_the_id_is_skipped():
    data = b"\x00\x53\x74" + encode({"d": Described(Symbol("x:y"), [1, "two"]), "_AMQ_DUPL_ID": b"z"})
    assert message_duplicate_id(data) == (b"z", False)


@pytest.mark.parametrize("cut", [4, 10, 20, -3, -1])
def test_truncated_application_properties_are_a_decode_error(cut):
    data = b"\x00\x53\x74" + encode({"aaaa": "bbbb", "_AMQ_DUPL_ID": "abcdef"})
    with pytest.raises(DecodeError):
        message_duplicate_id(data[:cut])


def test_application_properties_that_are_not_a_map_are_a_decode_error():
    with pytest.raises(DecodeError):
        message_duplicate_id(b"\x00\x53\x74" + encode([1, 2]))


def test_deeply_nested_descriptors_are_walked_without_recursion():
    head = b"\x00\x53\x74\xd1"
    entries = b"\xa1\x01d" + b"\x00" * 5000 + b"\x40" * 5001 + b"\xa1\x0c_AMQ_DUPL_ID\xa1\x01z"
    data = head + (len(entries) + 4).to_bytes(4, "big") + (4).to_bytes(4, "big") + entries
    assert message_duplicate_id(data) == (b"z", True)


def test_the_cap_hook_hears_each_id_taken_early():
    b, _ = make(size=10, max_ids=2)
    heard = []
    b.duplicates.on_cap_evicted = heard.append
    for i in range(4):
        b.publish_once("q", k(i), b"m", True)
    assert heard == ["q", "q"] and b.duplicates.cap_evicted == 2


@pytest.mark.parametrize("size", [10, 4000, 5000, 70_000])
@pytest.mark.parametrize("props, expect", [({"_AMQ_DUPL_ID": "x"}, True), ({"a": "b"}, False), (None, False)])
def test_the_cheap_test_finds_the_key_in_the_application_properties_only(size, props, expect):
    from broker.amqp.message import may_carry_duplicate_id
    body = "y" * size
    assert may_carry_duplicate_id(encoded(body=body, properties=props, subject="s")) is expect
    if size > 4096:  # a large message's body is not searched
        assert may_carry_duplicate_id(encoded(body="_AMQ_DUPL_ID" + body, properties=props)) is expect


def test_a_large_message_that_cannot_be_walked_is_searched_whole():
    from broker.amqp.message import may_carry_duplicate_id
    assert may_carry_duplicate_id(b"\x00\x53\x70\xc0\xff" + b"_AMQ_DUPL_ID" * 500)
    assert not may_carry_duplicate_id(b"\x00\x53\x70\xc0\xff" + b"z" * 6000)


# -- with the real journal ------------------------------------------------------------------------------

def test_a_message_and_its_id_are_one_journal_record_torn_at_every_byte_both_or_neither(tmp_path):
    """``publish_once`` over the node's JournalStore: the message and its id are one GROUP record;
    a crash while it is written (a torn tail, cut at every byte) keeps neither, a whole one both."""
    from broker.node import JournalStore
    from broker.store.journal import SEG_HEADER_BYTES, Journal, JournalConfig, RecordType, _parse_at

    cfg = JournalConfig(compact_min_bytes=1 << 40)
    src = tmp_path / "src"
    j = Journal.open(src, cfg)
    b = Broker(SettingsResolver(), JournalStore(j, lambda: None), duplicates=DuplicateIds(size=3))
    b.declare_address("q", [ANYCAST])
    b.publish_once("q", k(1), b"first", True)
    b.publish_once("q", k(2), b"second", True)
    j.flush()
    j.close()
    seg = sorted(src.glob("journal-*.log"))[-1]
    data = seg.read_bytes()
    pos, starts = SEG_HEADER_BYTES, []
    while pos < len(data):
        starts.append(pos)
        pos = _parse_at(data, pos)[2]
    start = starts[-1]
    assert data[start + 4] == RecordType.GROUP

    def recovered(d):
        with Journal.open(d, cfg) as jj:
            live = jj.live_messages()
            return ([m.body for m in live.get("q", [])],
                    [m.body for m in live.get(ADDRESS_RECORDS + "q", [])])
    for cut in list(range(start, len(data), 7)) + [len(data)]:
        d = tmp_path / f"cut{cut}"
        d.mkdir()
        (d / seg.name).write_bytes(data[:cut])
        messages, ids = recovered(d)
        if cut == len(data):
            assert (messages, ids) == ([b"first", b"second"], [k(1), k(2)])
        else:
            assert (messages, ids) == ([b"first"], [k(1)]), cut


# -- which local queues hold a copy (a moved message is dropped only where its queue holds one) -------

def test_a_publish_holds_its_id_in_the_queues_that_got_a_copy():
    b, _ = make()
    b.publish_once("q", k(1), b"m", True)
    assert b.duplicates.holds("q", k(1), "q")
    assert not b.duplicates.holds("q", k(1), "other") and not b.duplicates.holds("q", k(2), "q")


def test_a_multicast_publish_holds_each_subscription_and_a_filtered_out_one_not():
    b, _ = make()
    b.declare_address("t", [MULTICAST])
    b.subscription_queue("t", "s1", durable=True)
    b.subscription_queue("t", "s2", durable=True)
    b.publish_once("t", k(1), b"m", True)
    assert b.duplicates.holds("t", k(1), "s1") and b.duplicates.holds("t", k(1), "s2")


def test_a_publish_without_a_queue_remembers_the_id_but_holds_nothing():
    b, _ = make()
    b.declare_address("t", [MULTICAST])      # no subscription: the message goes nowhere
    b.publish_once("t", k(1), b"m", True)
    assert b.duplicates.lookup("t", k(1)) is not MISSING
    assert not b.duplicates.holds("t", k(1), "t")


def test_consuming_keeps_the_hold_moving_away_releases_it():
    b, _ = make()
    b.publish_once("q", k(1), b"m", True)
    q = b.queues["q"]
    q.take(q.messages[0])                     # gone from the queue (consumed or moved): still held
    assert b.duplicates.holds("q", k(1), "q")
    b.duplicates.release("q", k(1), "q")      # the bridge moved it: the same copy may come back
    assert not b.duplicates.holds("q", k(1), "q")
    assert b.duplicates.lookup("q", k(1)) is not MISSING   # the id itself is still remembered
    b.duplicates.release("q", k(1), "q")      # twice, or for an id never held: nothing happens
    b.duplicates.release("q", k(9), "q")


def test_a_remembered_id_held_again_and_the_hold_goes_with_the_ring():
    b, _ = make(size=2)
    dups = b.duplicates
    dups.remember("q", k(1), persist=False)               # passed on: remembered, held nowhere
    assert not dups.holds("q", k(1), "q")
    dups.remember("q", k(1), persist=False, held=["q"])   # a moved copy stored here later
    assert dups.holds("q", k(1), "q")
    dups.hold("q", k(5), ["q"])                           # an id not remembered: not held either
    assert not dups.holds("q", k(5), "q")
    b.publish_once("q", k(2), b"m", True)
    b.publish_once("q", k(3), b"m", True)                 # k(1) leaves the ring of 2, its hold too
    assert dups.lookup("q", k(1)) is MISSING and not dups.holds("q", k(1), "q")
    assert k(1) not in dups.addresses["q"].held


def test_a_transaction_s_publish_holds_its_id():
    b, _ = make()
    table = TransactionTable("c1")
    t = table.declare()
    t.publish("q", b"m", True, dup_key=k(7))
    assert table.discharge(t.txn_id, False, b).committed
    assert b.duplicates.holds("q", k(7), "q")
