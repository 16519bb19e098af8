"""Unit tests of the five policies, the hashes and the registry (pure logic)."""

from __future__ import annotations

import random
from collections import Counter

import mmh3
import pytest
from hypothesis import given, strategies as st

from router.errors import PolicyError
from router.policies import (ARTEMIS_HASH_PROPERTIES, Policy, Target, create_policy, fnv1a_utf16,
                             murmur3, policy_names, register_policy)


def targets(n: int, prefix: str = "node") -> list[Target]:
    return [Target(f"{prefix}-{i}", "127.0.0.1", 5000 + i, name=f"t{i}") for i in range(n)]


def java_fnv_reference(s: str) -> int:  # the spec's reference implementation (§2.1)
    x = 0x811C9DC5
    b = s.encode("utf-16-be", "surrogatepass")
    for i in range(0, len(b), 2):
        x = ((x ^ (b[i] << 8 | b[i + 1])) * 0x01000193) & 0xFFFFFFFF
    return x - 2**32 if x >= 2**31 else x


@given(st.text())
def test_fnv1a_matches_reference_for_any_text(s):
    assert fnv1a_utf16(s) == java_fnv_reference(s)


def test_fnv1a_lone_surrogate_and_empty():
    assert fnv1a_utf16("") == -2128831035
    assert fnv1a_utf16("\ud800") == java_fnv_reference("\ud800")


def test_murmur3_is_mmh3_signed():
    assert murmur3("client-1") == mmh3.hash("client-1")


def test_registry_lists_builtins_and_rejects_unknown():
    assert policy_names()[:5] == ["FIRST_ELEMENT", "ROUND_ROBIN", "CONSISTENT_HASH",
                                  "LEAST_CONNECTIONS", "CONSISTENT_HASH_MODULO"]
    with pytest.raises(PolicyError, match="no policy named 'NOPE'.*FIRST_ELEMENT"):
        create_policy("NOPE", {})


@pytest.mark.parametrize("name,props,msg", [
    ("CONSISTENT_HASH_MODULO", {}, "MODULO is required"),
    ("CONSISTENT_HASH_MODULO", {"modulo": "2"}, "unknown property 'modulo'"),
    ("CONSISTENT_HASH_MODULO", {"MODULO": "two"}, "must be an integer"),
    ("CONSISTENT_HASH", {"HASH": "SHA1"}, "must be one of MURMUR3, FNV1A"),
    ("CONSISTENT_HASH", {"VIRTUAL_NODES": "0"}, "must be >= 1"),
    ("CONSISTENT_HASH", {"LOAD_FACTOR": "0.5"}, "must be >= 1.0"),
    ("LEAST_CONNECTIONS", {"CONNECTION_COUNT_THRESHOLD": "x"}, "must be an integer"),
    ("FIRST_ELEMENT", {"X": "1"}, "unknown property 'X'"),
])
def test_bad_properties(name, props, msg):
    with pytest.raises(PolicyError, match=msg):
        create_policy(name, props)


def test_custom_policy_plugs_in():
    class LongestName(Policy):
        name = "LONGEST"
        PROPERTIES = frozenset({"MIN"})

        def select_target(self, ts, key):
            return max(ts, key=lambda t: len(t.name), default=None)

    register_policy("LONGEST", LongestName)
    p = create_policy("LONGEST", {"MIN": "1"})
    ts = [Target(None, "h", 1, name="a"), Target(None, "h", 2, name="bbb")]
    assert p.select_target(ts, "k").name == "bbb"

    register_policy("FACTORY_FN", lambda props, rng: LongestName(props, rng))
    assert create_policy("FACTORY_FN", {}).select_target(ts, "k").name == "bbb"
    register_policy("BROKEN", lambda props, rng: object())
    with pytest.raises(PolicyError, match="not a router.policies.Policy"):
        create_policy("BROKEN", {})


@pytest.mark.parametrize("name", ["FIRST_ELEMENT", "ROUND_ROBIN", "CONSISTENT_HASH",
                                  "LEAST_CONNECTIONS"])
def test_empty_and_single(name):  # Artemis PolicyTestBase
    p = create_policy(name, {})
    assert p.select_target([], "k") is None
    t = targets(1)
    assert p.select_target(t, "k") is t[0]


def test_first_element():
    ts = targets(3)
    assert create_policy("FIRST_ELEMENT", {}).select_target(ts, "x") is ts[0]


def test_round_robin_distinct_and_random_start():
    ts = targets(10)
    p = create_policy("ROUND_ROBIN", {}, random.Random(1))
    assert len({p.select_target(ts, "k").name for _ in range(10)}) == 10
    starts = {create_policy("ROUND_ROBIN", {}, random.Random(s)).select_target(ts, "k").name
              for s in range(30)}
    assert len(starts) > 3


def test_least_connections_artemis_cases():
    ts = targets(10)
    p = create_policy("LEAST_CONNECTIONS", {}, random.Random(3))
    assert len({p.select_target(ts, "k").name for _ in range(10)}) == 10  # no counts yet
    for t in ts:
        p.observe(t, 3)
    assert len({p.select_target(ts, "k").name for _ in range(10)}) == 10  # all tied
    p.observe(ts[0], 2)
    assert {p.select_target(ts, "k").name for _ in range(10)} == {"t0"}
    p.observe(ts[0], 3)
    p.observe(ts[1], 1)
    p.observe(ts[2], 1)
    picks = [p.select_target(ts, "k").name for _ in range(10)]
    assert set(picks) == {"t1", "t2"} and all(a != b for a, b in zip(picks, picks[1:]))


def test_least_connections_threshold_and_unknown_last():
    ts = targets(3)
    p = create_policy("LEAST_CONNECTIONS", {"CONNECTION_COUNT_THRESHOLD": "30"})
    p.observe(ts[0], 29)
    p.observe(ts[1], 5)
    # both below the threshold count as 0 → tie between t0 and t1; t2 unknown ranks last
    assert {p.select_target(ts, "k").name for _ in range(6)} == {"t0", "t1"}
    p.observe(ts[0], None)  # failed probe forgets the count
    assert p.select_target(ts, "k").name == "t1"


def test_consistent_hash_sticky_and_removal_moves_only_removed_keys():
    ts = targets(5)
    p = create_policy("CONSISTENT_HASH", {})
    keys = [f"client-{i}" for i in range(3000)]
    before = {k: p.select_target(ts, k).name for k in keys}
    assert before == {k: p.select_target(ts, k).name for k in keys}
    gone = ts[2]
    rest = [t for t in ts if t is not gone]
    after = {k: p.select_target(rest, k).name for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == gone.name for k in moved)
    assert all(after[k] == before[k] for k in keys if before[k] != gone.name)


def test_consistent_hash_ring_is_even_with_default_virtual_nodes():
    ts = targets(5)
    p = create_policy("CONSISTENT_HASH", {})
    c = Counter(p.select_target(ts, f"k{i}").name for i in range(20000))
    assert max(c.values()) / min(c.values()) < 1.6


def test_artemis_ring_falls_back_to_smallest_point():
    ts = targets(3)
    p = create_policy("CONSISTENT_HASH", ARTEMIS_HASH_PROPERTIES)
    hashes = sorted((fnv1a_utf16(t.node_id), t.name) for t in ts)
    key = next(f"k{i}" for i in range(10000) if fnv1a_utf16(f"k{i}") < hashes[0][0])
    assert p.select_target(ts, key).name == hashes[0][1]  # smallest, not the largest
    ring = create_policy("CONSISTENT_HASH", {"HASH": "FNV1A", "VIRTUAL_NODES": "2"})
    assert ring.virtual_nodes == 2 and not ring.artemis_ring


def test_bounded_load_caps_every_target():
    ts = targets(5)
    p = create_policy("CONSISTENT_HASH", {"LOAD_FACTOR": "1.25"})
    assert not p.key_deterministic
    c = Counter()
    for i in range(10000):
        c[p.select_target(ts, f"key-{i}").name] += 1
        total = sum(c.values())
        assert max(c.values()) <= -(-1.25 * total // 5) + 1
    assert max(c.values()) / min(c.values()) < 1.3


def test_modulo_sign_bit_cleared_and_null_not_special_in_policy():
    p = create_policy("CONSISTENT_HASH_MODULO", {"MODULO": "7", "HASH": "FNV1A"})
    neg = next(f"k{i}" for i in range(100) if fnv1a_utf16(f"k{i}") < 0)
    h = fnv1a_utf16(neg)
    assert p.transform_key(neg) == str((h & 0x7FFFFFFF) % 7)
    for k in ("ONE", "TWO", "THREE", "FOUR", "AAA", "BBB"):
        assert 0 <= int(p.transform_key(k)) < 7
    assert create_policy("CONSISTENT_HASH_MODULO", {"MODULO": "0"}).transform_key("AA") == "AA"
    m = create_policy("CONSISTENT_HASH_MODULO", {"MODULO": "2", "HASH": "FNV1A"})
    assert (m.transform_key("AAA"), m.transform_key("BBB")) == ("0", "1")
    assert m.select_target(targets(3), "0") is None
    assert create_policy("CONSISTENT_HASH_MODULO", {"MODULO": "5"}).transform_key("x") == str(
        (mmh3.hash("x") & 0x7FFFFFFF) % 5)
