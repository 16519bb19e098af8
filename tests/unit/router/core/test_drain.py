"""A drained pool target (``Pool.drain``; the shell in router/drain.py moves its clients): no new
connection and no cached key goes to it while another target is ready; with nothing else ready it
serves rather than nothing; a pair is drained as one; followers take the drains they are given.
Plus the pure helpers of router/drain.py (a broker connection's key, the redirect address)."""

from __future__ import annotations

import pytest

from router.core.cache import StickyCache
from router.core.decide import Outcome, Router
from router.core.keys import ConnectionInfo, KeyResolver, KeyType
from router.core.pool import Pool
from router.core.membership import host_port
from router.drain import Drain, key_of
from router.policies import Target, create_policy


def tgt(name, node_id=None, *, pair=None, backup=False, host="127.0.0.1"):
    return Target(node_id, host, 5000 + ord(name[-1]), False, f"http://m/{name}", name, pair, backup)


def names(targets):
    return [t.name for t in targets]


def three() -> Pool:
    pool = Pool([tgt("b1", "N1"), tgt("b2", "N2"), tgt("b3", "N3")])
    for n in ("b1", "b2", "b3"):
        pool.report_probe(n, True)
    return pool


def test_a_drained_target_takes_no_new_connection_and_no_cached_key():
    pool = three()
    assert pool.drain("b2") == "b2"
    assert names(pool.targets()) == ["b1", "b3"]
    assert pool.ready_target("N2") is None and pool.ready_target("b2") is None   # a cached key moves
    assert pool.snapshot()["draining"] == ["b2"]
    assert [st.draining for st in pool.members] == [False, True, False]
    assert pool.undrain("b2") == ("b2", True)
    assert names(pool.targets()) == ["b1", "b2", "b3"]
    assert pool.undrain("b2") == ("b2", False)
    assert "draining" not in pool.snapshot()


def test_cached_keys_on_a_drained_target_are_placed_again_elsewhere():
    pool = three()
    router = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy("CONSISTENT_HASH", {}),
                    pool=pool, cache=StickyCache(0))
    keys = [f"k{i}" for i in range(60)]
    before = {k: router.decide(ConnectionInfo("127.0.0.1:1", container_id=k), 0.0).target.name for k in keys}
    on_b2 = [k for k, t in before.items() if t == "b2"]
    assert on_b2
    pool.drain("b2")
    after = {k: router.decide(ConnectionInfo("127.0.0.1:1", container_id=k), 1.0) for k in keys}
    assert all(d.outcome is Outcome.OK for d in after.values())
    assert all(after[k].target.name != "b2" for k in keys)
    # keys on the other targets stay where they were (the cache keeps them)
    assert all(after[k].target.name == before[k] for k in keys if k not in on_b2)


def test_a_drain_that_would_leave_nothing_ready_is_refused_and_an_unknown_target_named():
    pool = Pool([tgt("b1", "N1"), tgt("b2", "N2")])
    pool.report_probe("b1", True)
    pool.report_probe("b2", False)
    with pytest.raises(ValueError, match="no other target of the pool is ready"):
        pool.drain("b1")
    with pytest.raises(ValueError, match="no target named 'nope'"):
        pool.drain("nope")
    assert not pool.draining


def test_a_drained_target_serves_when_nothing_else_is_ready_and_stops_when_one_is_again():
    pool = three()
    pool.drain("b1")
    pool.report_probe("b2", False)
    pool.report_probe("b3", False)
    assert names(pool.targets()) == ["b1"] and pool.drain_fallback      # rather than nothing
    pool.report_probe("b3", True)
    assert names(pool.targets()) == ["b3"] and not pool.drain_fallback
    assert pool.draining == {"b1"}                                       # the drain itself stays


def test_a_pair_is_drained_as_one_by_any_member_name():
    pool = Pool([tgt("p1", "N1", pair="pair-a"), tgt("p1b", "N1", pair="pair-a", backup=True), tgt("b2", "N2")])
    for n in ("p1", "p1b", "b2"):
        pool.report_probe(n, n != "p1b")
    assert pool.drain("p1b") == "pair-a"
    assert names(pool.targets()) == ["b2"]
    assert pool.ready_target("N1") is None


def test_a_target_is_found_by_its_address_too():
    pool = three()
    t = pool.members[1].target
    assert pool.drain(f"{t.host}:{t.port}") == "b2"


def test_a_follower_takes_the_drains_it_is_given():
    pool = three()
    pool.set_draining(["b3"])
    assert names(pool.targets()) == ["b1", "b2"]
    version = pool.version
    pool.set_draining(["b3"])
    assert pool.version == version          # unchanged: no rebuild, no listener call
    pool.set_draining([])
    assert names(pool.targets()) == ["b1", "b2", "b3"]


@pytest.mark.parametrize("key_type,conn,want", [
    (KeyType.CLIENT_ID, {"container_id": "c-1", "user": "u", "source": "10.0.0.1:5000"}, "c-1"),
    (KeyType.USER_NAME, {"container_id": "c-1", "user": "u", "source": "10.0.0.1:5000"}, "u"),
    (KeyType.SOURCE_IP, {"source": "10.0.0.1:5000"}, "10.0.0.1"),
    (KeyType.SOURCE_IP, {"source": "[::1]:5000"}, "::1"),
    (KeyType.SNI_HOST, {"container_id": "c-1", "source": "10.0.0.1:5000"}, None),
    (KeyType.ROLE_NAME, {"user": "u"}, None),
])
def test_the_key_of_a_broker_connection_comes_from_its_listing(key_type, conn, want):
    assert key_of(key_type, conn) == want


def test_the_redirect_address_brackets_v6_and_the_view_sums_what_is_left():
    assert host_port(tgt("b1").host, tgt("b1").port) == "127.0.0.1:5049"
    assert host_port("::1", 5049) == "[::1]:5049"
    d = Drain("b2", 5.0, 0.5)
    d.proxied_left, d.broker_left = 3, 4
    v = d.view()
    assert (v["left"], v["grace_ms"], v["phase"]) == (7, 500, "grace")


def test_a_drain_that_would_break_the_quorum_is_refused_and_one_broken_later_serves_again():
    pool = Pool([tgt("b1", "N1"), tgt("b2", "N2"), tgt("b3", "N3")], quorum_size=2)
    for n in ("b1", "b2", "b3"):
        pool.report_probe(n, True)
    pool.drain("b1")
    assert names(pool.targets()) == ["b2", "b3"]
    with pytest.raises(ValueError, match="below the quorum of 2"):
        pool.drain("b2")
    pool.report_probe("b3", False)             # quorum unmet without the drained one: it serves
    assert pool.drain_fallback and names(pool.targets()) == ["b1", "b2"]


def test_the_drain_of_a_target_that_left_the_pool_is_forgotten():
    pool = three()
    pool.drain("b3")
    pool.sync_members([tgt("b1", "N1"), tgt("b2", "N2")])
    assert pool.forget_drains() == ["b3"]
    assert not pool.draining and pool.forget_drains() == []
