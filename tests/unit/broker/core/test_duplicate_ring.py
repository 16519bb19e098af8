"""The duplicate-id ring (broker/core/duplicates.py, used per origin node by the cluster bridge and
per address for ``_AMQ_DUPL_ID``): a bound of ``size``
ids, the oldest leaving first and handed back with its token (so the journal can forget its
record); ``seen`` counts duplicates; ``restore`` rebuilds from the journal and hands back what no
longer fits."""

from __future__ import annotations

import pytest

from broker.core.duplicates import DuplicateCache


def _id(i: int) -> bytes:
    return b"dup-%d" % i


def test_the_oldest_id_leaves_first_with_its_token():
    c = DuplicateCache(3)
    assert [c.add(_id(i), f"t{i}") for i in range(3)] == [[], [], []]
    assert len(c) == 3
    assert c.add(_id(3), "t3") == [(_id(0), "t0")]
    assert c.add(_id(4), "t4") == [(_id(1), "t1")]
    assert c.items() == [(_id(2), "t2"), (_id(3), "t3"), (_id(4), "t4")]
    assert _id(0) not in c and _id(1) not in c
    assert all(_id(i) in c for i in (2, 3, 4))


def test_a_cache_of_one_keeps_only_the_last_id():
    c = DuplicateCache(1)
    assert c.add(b"a", 1) == []
    assert c.add(b"b", 2) == [(b"a", 1)]
    assert c.items() == [(b"b", 2)]


def test_tokens_may_be_none_and_are_returned_as_given():
    c = DuplicateCache(1)
    c.add(b"a")
    assert c.add(b"b") == [(b"a", None)]


def test_adding_an_id_again_replaces_its_token_and_keeps_its_place():
    """(The receiving node only adds ids it has not seen; a re-add keeps the ring order.)"""
    c = DuplicateCache(2)
    c.add(b"a", 1)
    c.add(b"b", 2)
    assert c.add(b"a", 3) == []
    assert c.items() == [(b"a", 3), (b"b", 2)]
    assert c.add(b"c", 4) == [(b"a", 3)]


def test_set_token_updates_a_remembered_id_only():
    c = DuplicateCache(2)
    c.add(b"a")
    c.set_token(b"a", 7)
    c.set_token(b"zz", 8)  # not remembered: nothing happens
    assert c.items() == [(b"a", 7)]


def test_seen_counts_duplicates_only():
    c = DuplicateCache(2)
    assert not c.seen(b"a") and c.dropped == 0
    c.add(b"a")
    assert c.seen(b"a") and c.seen(b"a")
    assert not c.seen(b"b")
    assert c.dropped == 2
    c.add(b"b")
    c.add(b"c")  # pushes b"a" out: no longer a duplicate
    assert not c.seen(b"a")
    assert c.seen(b"c")
    assert c.dropped == 3


def test_restore_within_the_size_keeps_everything_in_order():
    c = DuplicateCache(4)
    assert c.restore([(_id(i), i) for i in range(4)]) == []
    assert c.items() == [(_id(i), i) for i in range(4)]
    assert c.dropped == 0  # restoring is not seeing duplicates


def test_restore_beyond_the_size_returns_the_overflow_oldest_first():
    """The journal kept more ids than ``id-cache-size`` allows now (it was lowered): the oldest
    come back, with their tokens, so their records can be removed."""
    c = DuplicateCache(3)
    out = c.restore([(_id(i), f"t{i}") for i in range(7)])
    assert out == [(_id(i), f"t{i}") for i in range(4)]
    assert c.items() == [(_id(i), f"t{i}") for i in range(4, 7)]
    assert c.seen(_id(6)) and not c.seen(_id(3))


def test_restore_after_adds_counts_the_bound_over_both():
    c = DuplicateCache(2)
    c.add(b"new", "n")
    assert c.restore([(b"old1", 1), (b"old2", 2)]) == [(b"new", "n")]
    assert c.items() == [(b"old1", 1), (b"old2", 2)]


@pytest.mark.parametrize("size", [0, -1])
def test_a_size_below_one_is_refused(size):
    with pytest.raises(ValueError, match="id-cache-size"):
        DuplicateCache(size)
