"""Bounded load (CONSISTENT_HASH + LOAD_FACTOR) counts live assignments only (issue 8, item 5).

An assignment is live while the key's cache entry lives (with a cache) or while the connection
that got it is open (without one); management lookups never count. Pure core, ``now`` given.
"""

from __future__ import annotations

from router.core.cache import StickyCache
from router.core.decide import Outcome, Router
from router.core.keys import ConnectionInfo, KeyResolver, KeyType
from router.core.pool import Pool
from router.policies import Target, create_policy


def router(*, cache: StickyCache | None, factor: str = "1.0", n: int = 3) -> Router:
    pool = Pool([Target(f"node-{i}", "h", 5672 + i, name=f"t{i}") for i in range(n)])
    for i in range(n):
        pool.set_ready(f"t{i}", True)
    return Router("r", KeyResolver(KeyType.CLIENT_ID),
                  policy=create_policy("CONSISTENT_HASH", {"LOAD_FACTOR": factor}), pool=pool, cache=cache)


def conn(cid: str) -> ConnectionInfo:
    return ConnectionInfo(source="10.0.0.1:1", container_id=cid)


def live(r: Router) -> int:
    return sum(r.policy.loads.values())


def test_management_lookups_do_not_count():
    for cache in (None, StickyCache(0)):
        r = router(cache=cache)
        for i in range(50):
            assert r.decide_for_key(f"k{i}", 1.0).outcome is Outcome.OK
        assert live(r) == 0
        d = r.decide(conn("c1"), 2.0)
        assert d.ok and live(r) == 1


def test_without_cache_an_assignment_lives_as_long_as_its_connection():
    r = router(cache=None)
    ds = [r.decide(conn(f"c{i}"), 1.0) for i in range(9)]
    assert live(r) == 9 and max(r.policy.loads.values()) <= 3  # cap ceil(1.0 * 9 / 3)
    for d in ds[:6]:
        r.release(d)
        r.release(d)  # idempotent
    assert live(r) == 3
    for d in ds[6:]:
        r.release(d)
    assert live(r) == 0 and r.policy.loads == {}
    # released capacity is reusable: the cap follows live load, not history
    again = [r.decide(conn(f"c{i}"), 2.0) for i in range(3)]
    assert sorted(d.target.name for d in again) == ["t0", "t1", "t2"]


def test_with_cache_the_entry_holds_the_assignment_until_it_expires():
    cache = StickyCache(1000)
    r = router(cache=cache)
    ds = [r.decide(conn(f"c{i}"), 1.0) for i in range(6)]
    assert all(d.ok and d.hold is None for d in ds)
    for d in ds:
        r.release(d)  # connections closing: the cache entries still hold the keys
    assert live(r) == 6
    # a reconnect hits the cache: the same assignment, not a second one
    assert r.decide(conn("c0"), 1.5).explanation.cache == "hit"
    assert live(r) == 6
    cache.expire(2.2)  # c1..c5 idle 1.2 s > 1 s; c0 was touched at 1.5
    assert live(r) == 1
    cache.expire(3.0)
    assert live(r) == 0 and r.policy.loads == {}


def test_a_management_entry_becomes_live_when_a_connection_uses_it():
    cache = StickyCache(0)
    r = router(cache=cache)
    r.decide_for_key("k", 1.0)
    assert "k" in cache.entries and live(r) == 0
    d = r.decide(conn("k"), 2.0)
    assert d.explanation.cache == "hit" and live(r) == 1
    r.decide(conn("k"), 3.0)
    assert live(r) == 1
    cache.remove("k")
    assert live(r) == 0


def test_eviction_and_repointing_release():
    cache = StickyCache(0, max_entries=2)
    r = router(cache=cache)
    for i in range(5):
        r.decide(conn(f"c{i}"), float(i))
    assert len(cache) == 2 and live(r) == 2
    # the cached node goes away: the key is re-decided, its old assignment released
    key = next(iter(cache.entries))
    old = cache.entries[key][0]
    old_slot = "t" + old.split("-")[1]
    r.pool.set_ready(old_slot, False)
    d = r.decide(conn(key), 10.0)
    assert d.ok and d.target.identity != old and live(r) == 2
    still_old = sum(1 for e in cache.entries.values() if e[0] == old)
    assert r.policy.loads.get(old_slot, 0) == still_old


# -- LEAST_CONNECTIONS: no count, not ready (Artemis UPDATE_CONNECTION_COUNT_PROBE) ------------
def test_least_connections_makes_a_probe_without_count_fail():
    pool = Pool([Target(None, "h", 1, name="a"), Target(None, "h", 2, name="b")])
    Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy("LEAST_CONNECTIONS", {}), pool=pool)
    pool.report_probe("a", True, "node-a", 3, 1.0)
    pool.report_probe("b", True, "node-b", None, 1.0)
    assert [t.name for t in pool.targets()] == ["a"]
    assert pool.snapshot()["targets"][1]["last_error"] == \
        "probe gave no connection count (LEAST_CONNECTIONS needs one)"
    other = Pool([Target(None, "h", 2, name="b")])
    Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy("FIRST_ELEMENT", {}), pool=other)
    other.report_probe("b", True, "node-b", None, 1.0)
    assert [t.name for t in other.targets()] == ["b"]


def test_least_connections_count_rule_skips_a_local_target_outside_the_pool():
    local = Target("self", "h", 9, name="self")
    pool = Pool([Target(None, "h", 1, name="a")], local_target=local)
    Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy("LEAST_CONNECTIONS", {}), pool=pool)
    pool.report_probe("self", True, None, None, 1.0)  # a TCP probe: no count
    assert pool.local.ready
    inside = Pool([Target(None, "h", 1, name="a")], local_target=local, local_target_enabled=True)
    Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy("LEAST_CONNECTIONS", {}), pool=inside)
    inside.report_probe("self", True, None, None, 1.0)
    assert not inside.local.ready


def test_fail_back_return_keeps_the_entry_and_the_connection_holds_the_detour():
    cache = StickyCache(0)
    pool = Pool([Target(f"node-{i}", "h", 5672 + i, name=f"t{i}") for i in range(3)])
    for i in range(3):
        pool.set_ready(f"t{i}", True)
    r = Router("r", KeyResolver(KeyType.CLIENT_ID), pool=pool, cache=cache, fail_back="return",
               policy=create_policy("CONSISTENT_HASH", {"LOAD_FACTOR": "1.0"}))
    first = r.decide(conn("k"), 1.0)
    assert live(r) == 1 and first.hold is None  # the cache entry holds it
    pool.set_ready(first.target.name, False)
    detour = r.decide(conn("k"), 2.0)
    assert detour.ok and detour.target.name != first.target.name
    assert cache.entries["k"][0] == first.target.identity  # kept for the return
    assert detour.hold == (r.policy, detour.target.slot) and live(r) == 2
    r.release(detour)
    assert live(r) == 1 and r.policy.loads == {first.target.slot: 1}


def test_a_reloaded_policy_takes_over_and_the_old_assignments_are_forgotten():
    """``Router.replace_policy`` (a hot reload): the new policy decides new keys and observes the
    pool; a release of a decision the old policy made is a no-op for the new one; cached keys
    keep their target."""
    cache = StickyCache(0)
    r = router(cache=cache)
    before = {f"c{i}": r.decide(conn(f"c{i}"), 1.0) for i in range(6)}
    old = r.policy
    assert sum(old.loads.values()) == 6 and cache.on_drop is not None
    r.replace_policy(create_policy("FIRST_ELEMENT", {}))
    assert old.observe not in r.pool.observers and r.policy.observe in r.pool.observers
    assert cache.on_drop is None and r.assigned == {}
    for cid, d in before.items():                      # cached keys keep their target
        assert r.decide(conn(cid), 2.0).target.name == d.target.name
        r.release(d)                                   # with a cache, the entry holds it: no-op
    assert r.decide(conn("new"), 3.0).target.name == "t0"
    r.replace_policy(create_policy("CONSISTENT_HASH", {"LOAD_FACTOR": "1.0"}))
    assert cache.on_drop is not None                   # tracking again, from zero
    assert sum(r.policy.loads.values()) == 0
    r.decide(conn("newer"), 4.0)
    assert sum(r.policy.loads.values()) == 1


def test_a_reloaded_quorum_is_in_force_at_once():
    r = router(cache=None, n=3)
    pool = r.pool
    pool.set_ready("t2", False)
    assert pool.quorum_met
    pool.configure(quorum_size=3, local_target_enabled=False, allow_failback=True)
    assert not pool.quorum_met and r.decide(conn("c"), 1.0).outcome is Outcome.REFUSED_UNAVAILABLE
    pool.configure(quorum_size=2, local_target_enabled=False, allow_failback=True)
    assert pool.quorum_met and r.decide(conn("c"), 2.0).ok


def test_a_connection_placed_before_a_reload_releases_on_the_policy_that_placed_it():
    r = router(cache=None)
    old_ds = [r.decide(conn(f"c{i}"), 1.0) for i in range(3)]
    old = r.policy
    r.replace_policy(create_policy("CONSISTENT_HASH", {"LOAD_FACTOR": "1.5"}))
    new_ds = [r.decide(conn(f"n{i}"), 2.0) for i in range(3)]
    assert sum(old.loads.values()) == 3 and sum(r.policy.loads.values()) == 3
    for d in old_ds:
        r.release(d)                                   # the old policy's count goes down, not the new one's
    assert sum(old.loads.values()) == 0 and sum(r.policy.loads.values()) == 3
    for d in new_ds:
        r.release(d)
    assert r.policy.loads == {}
