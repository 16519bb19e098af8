"""A pool with ``allow_failback = False`` (two sites; docs/site-failover.md): a target that went
down, had connections routed elsewhere meanwhile, and comes back is held while another serves,
until an operator readmits it; one that nobody was diverted from is admitted again; the pool is
never left without a target; pairs are held as one; followers take the holds they are given and
report their diversions."""

from __future__ import annotations

import pytest

from router.core.cache import StickyCache
from router.core.decide import Outcome, Router
from router.core.keys import ConnectionInfo, KeyResolver, KeyType
from router.core.pool import Pool
from router.policies import Target, create_policy


def tgt(name, node_id=None, *, pair=None, backup=False):
    return Target(node_id, "127.0.0.1", 5000 + len(name) + ord(name[-1]), False, f"http://m/{name}",
                  name, pair, backup)


def names(targets):
    return [t.name for t in targets]


def routed(pool: Pool, name: str) -> None:
    """A connection routed to ``name`` (what ``RouterService.route`` tells the pool)."""
    (t,) = [st.target for st in pool.members if st.target.name == name]
    pool.note_routed(t)


def sites(**kw) -> Pool:
    return Pool([tgt("site-1", "N1"), tgt("site-2", "N2")], allow_failback=False, **kw)


def test_both_up_at_start_are_admitted_and_the_first_serves_first_element():
    pool = sites()
    pool.report_probe("site-2", True)  # whichever answers first, neither went down
    pool.report_probe("site-1", True)
    assert names(pool.targets()) == ["site-1", "site-2"] and pool.held == {}
    r = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy("FIRST_ELEMENT", {}), pool=pool)
    assert r.decide(ConnectionInfo("127.0.0.1:1", container_id="c1"), 0.0).target.name == "site-1"


def test_a_site_that_comes_back_is_held_until_readmitted():
    pool = sites()
    pool.report_probe("site-1", True)
    pool.report_probe("site-2", True)
    pool.report_probe("site-1", False, error="refused")          # site 1 dies
    assert names(pool.targets()) == ["site-2"]
    routed(pool, "site-2")                                      # its clients reconnect to site 2
    for _ in range(3):                                          # it comes back: held, probed on
        pool.report_probe("site-1", True)
    assert names(pool.targets()) == ["site-2"]
    assert list(pool.held) == ["site-1"] and "routed to site-2 meanwhile" in pool.held["site-1"]
    assert pool.ready_target("N1") is None                      # a cache hit on it is stale
    snap = pool.snapshot()
    assert snap["allow_failback"] is False and list(snap["held"]) == ["site-1"]
    st = {t["name"]: t for t in snap["targets"]}
    assert st["site-1"]["ready"] and st["site-1"]["held"] and st["site-2"]["held"] is None
    # the operator fails back: it takes connections again (FIRST_ELEMENT: new clients go there)
    assert pool.readmit("N1") == ("site-1", True)             # by node id, name or pair
    assert names(pool.targets()) == ["site-1", "site-2"] and pool.held == {}
    assert pool.readmit("site-1") == ("site-1", False)


def test_an_upstream_failure_counts_as_going_down():
    pool = sites()
    pool.report_probe("site-1", True)
    pool.report_probe("site-2", True)
    assert pool.mark_not_ready("site-1", "upstream connect failed: refused")
    routed(pool, "site-2")
    pool.report_probe("site-1", True)
    assert list(pool.held) == ["site-1"]


def test_a_blip_nobody_was_diverted_by_is_not_a_failover():
    pool = sites()
    pool.report_probe("site-1", True)
    pool.report_probe("site-2", True)
    routed(pool, "site-1")                                      # both up: not a diversion
    pool.report_probe("site-1", False, error="timed out")       # one slow probe …
    pool.report_probe("site-1", True)                           # … and nobody connected meanwhile
    assert names(pool.targets()) == ["site-1", "site-2"] and pool.held == {}
    pool.report_probe("site-1", False, error="timed out")       # the next time someone did
    routed(pool, "site-2")
    pool.report_probe("site-1", True)
    assert list(pool.held) == ["site-1"]


def test_a_site_down_at_start_is_held_when_it_arrives():
    pool = sites()
    pool.report_probe("site-1", False, error="refused")
    pool.report_probe("site-2", True)
    routed(pool, "site-2")
    pool.report_probe("site-1", True)
    assert names(pool.targets()) == ["site-2"] and list(pool.held) == ["site-1"]


def test_the_pool_is_never_left_without_a_target():
    pool = sites()
    pool.report_probe("site-1", True)
    pool.report_probe("site-2", True)
    pool.report_probe("site-1", False)
    routed(pool, "site-2")
    pool.report_probe("site-1", True)                            # held
    pool.report_probe("site-2", False, error="refused")          # the serving site dies too
    assert names(pool.targets()) == ["site-1"] and pool.held == {}  # released: it serves now
    routed(pool, "site-1")
    pool.report_probe("site-2", True)                            # and the other one holds
    assert names(pool.targets()) == ["site-1"] and list(pool.held) == ["site-2"]


def test_both_down_then_back_the_first_in_pool_order_serves():
    pool = sites()
    pool.report_probe("site-1", True)
    pool.report_probe("site-2", True)
    pool.report_probe("site-1", False)
    pool.report_probe("site-2", False)
    pool.report_probe("site-2", True)                            # first back: serves
    routed(pool, "site-2")
    pool.report_probe("site-1", True)                            # then: held
    assert names(pool.targets()) == ["site-2"] and list(pool.held) == ["site-1"]


def test_holds_loaded_from_before_a_restart_wait_for_every_first_probe():
    pool = sites()
    pool.held = {"site-1": "held before the restart"}
    pool.report_probe("site-1", True)          # site 2 not probed yet: site 1 is not released
    assert pool.targets() == () and "site-1" in pool.held
    pool.report_probe("site-2", True)
    assert names(pool.targets()) == ["site-2"] and "site-1" in pool.held
    pool2 = sites()
    pool2.held = {"site-1": "held before the restart"}
    pool2.report_probe("site-1", True)
    pool2.report_probe("site-2", False, error="refused")   # every group probed, none serves
    assert names(pool2.targets()) == ["site-1"] and pool2.held == {}


def test_a_planned_hold_and_its_refusal():
    pool = sites()
    pool.report_probe("site-1", True)
    pool.report_probe("site-2", True)
    assert pool.hold("site-1") == "site-1"
    assert names(pool.targets()) == ["site-2"] and pool.held["site-1"] == "held by an operator"
    with pytest.raises(ValueError, match="no other target of the pool is ready"):
        pool.hold("site-2")
    with pytest.raises(ValueError, match="no target named 'site-9'"):
        pool.hold("site-9")
    with pytest.raises(ValueError, match="no target named"):
        pool.readmit("site-9")


def test_with_failback_allowed_a_returning_site_takes_connections_at_once():
    pool = Pool([tgt("site-1"), tgt("site-2")])
    pool.report_probe("site-1", True)
    pool.report_probe("site-2", True)
    pool.report_probe("site-1", False)
    pool.report_probe("site-1", True)
    assert names(pool.targets()) == ["site-1", "site-2"] and pool.held == {}
    assert "held" not in pool.snapshot()


def test_an_ha_pair_is_held_as_one_also_after_its_own_failover_if_connections_went_elsewhere():
    pool = Pool([tgt("s1", "N1", pair="s1"), tgt("s1b", pair="s1", backup=True), tgt("s2", "N2")],
                allow_failback=False)
    pool.report_probe("s1", True, node_id="N1")
    pool.report_probe("s1b", False, node_id="N1", error="not active")
    pool.report_probe("s2", True, node_id="N2")
    # the pair fails over inside itself: it is down between the primary's death and the backup's
    # activation; a connection sent to s2 meanwhile (a failover longer than quorum-timeout, or a
    # policy that does not follow pool order) makes that a return (docs/site-failover.md)
    pool.report_probe("s1", False, error="refused")
    routed(pool, "s2")
    pool.report_probe("s1b", True, node_id="N1")
    assert names(pool.targets()) == ["s2"] and list(pool.held) == ["s1"]
    assert pool.failing_over("N1") is None       # held, not failing over: its keys are re-placed
    assert pool.readmit("s1b") == ("s1", True)   # any member's name readmits the pair
    assert names(pool.targets()) == ["s1b", "s2"]


def test_a_pair_whose_backup_activates_before_the_primary_is_noticed_is_never_down():
    pool = Pool([tgt("s1", "N1", pair="s1"), tgt("s1b", pair="s1", backup=True), tgt("s2", "N2")],
                allow_failback=False)
    pool.report_probe("s1", True, node_id="N1")
    pool.report_probe("s2", True, node_id="N2")
    pool.report_probe("s1b", True, node_id="N1")  # split brain for a moment, then
    pool.report_probe("s1", False, error="refused")
    assert names(pool.targets()) == ["s1b", "s2"] and pool.held == {}


def test_a_follower_takes_the_holds_it_is_given_and_decides_none():
    pool = sites()
    pool.follow_holds = True
    pool.report_probe("site-1", True)
    pool.report_probe("site-2", True)
    reported = []
    pool.on_diverted = reported.append
    pool.report_probe("site-1", False)
    routed(pool, "site-2")
    routed(pool, "site-2")
    assert reported == ["site-1"]                                # once per time down
    pool.report_probe("site-1", True)
    assert pool.held == {} and names(pool.targets()) == ["site-1", "site-2"]
    pool.report_probe("site-1", False)
    routed(pool, "site-2")
    assert reported == ["site-1", "site-1"]
    pool.report_probe("site-1", True)
    pool.set_holds({"site-1": "from the supervisor"})
    assert names(pool.targets()) == ["site-2"]
    pool.set_holds({})
    assert names(pool.targets()) == ["site-1", "site-2"]


def test_a_cached_key_on_the_held_site_is_re_placed_and_stays_after_readmit():
    pool = sites()
    cache = StickyCache(0)
    r = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy("FIRST_ELEMENT", {}), pool=pool,
               cache=cache)
    pool.report_probe("site-1", True, node_id="N1")
    pool.report_probe("site-2", True, node_id="N2")
    conn = ConnectionInfo("127.0.0.1:1", container_id="c1")
    assert r.decide(conn, 0.0).target.name == "site-1"
    pool.report_probe("site-1", False)
    routed(pool, "site-2")
    pool.report_probe("site-1", True)
    d = r.decide(conn, 1.0)
    assert d.outcome is Outcome.OK and d.target.name == "site-2" and d.explanation.cache == "stale"
    assert r.decide(conn, 2.0).target.name == "site-2"
    pool.readmit("site-1")
    # fail-back = stay (the default): the cache keeps it on site 2 — why the sample has no cache
    assert r.decide(conn, 3.0).target.name == "site-2"
    assert r.decide(ConnectionInfo("127.0.0.1:1", container_id="new"), 3.0).target.name == "site-1"


def test_the_prober_records_a_followers_diversion_only_for_a_group_that_is_down():
    pool = sites()
    pool.report_probe("site-1", True)
    pool.report_probe("site-2", True)
    pool.note_diverted("site-1")                                 # not down: ignored
    pool.report_probe("site-1", False)
    pool.report_probe("site-1", True)
    assert pool.held == {}
    pool.report_probe("site-1", False)
    pool.note_diverted("site-1")                                 # a worker routed one elsewhere
    pool.report_probe("site-1", True)
    assert list(pool.held) == ["site-1"]


def test_a_hold_by_hand_with_failback_allowed_is_released_if_nothing_else_serves():
    pool = Pool([tgt("site-1"), tgt("site-2")])
    pool.report_probe("site-1", True)
    pool.report_probe("site-2", True)
    pool.hold("site-1")
    assert names(pool.targets()) == ["site-2"]
    pool.report_probe("site-2", False, error="refused")
    assert names(pool.targets()) == ["site-1"] and pool.held == {}
    pool.report_probe("site-2", True)                            # failback allowed: it serves again
    assert names(pool.targets()) == ["site-1", "site-2"] and pool.held == {}
