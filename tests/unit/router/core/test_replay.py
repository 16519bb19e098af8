"""Decision replay (``router.core.replay``): logged decisions against a candidate config, with
hand-computed expectations (FIRST_ELEMENT: the first target in pool order; pins; a warm cache;
filters); CONSISTENT_HASH against the dry run's own ``--remove`` answer."""

from __future__ import annotations

import json

import pytest

from router.core.dryrun import change_pool, dry_run
from router.core.keys import KeyType
from router.core.pins import parse_pins
from router.core.policies.base import Target
from router.core.replay import (DEGRADED, NOT_DETERMINISTIC, TRUNCATED, candidate_router,
                                decisions_from_routing_log, replay, skew)

T = [Target(f"n{i}", "127.0.0.1", 5670 + i, name=f"t{i}") for i in range(3)]


def line(cid, target, *, outcome="OK", cache="miss", policy="FIRST_ELEMENT", ready=3, pin=None,
         router="main", **extra) -> str:
    """A route line as router.routelog.route_line writes it (the fields replay reads)."""
    rec = {"v": 1, "event": "route", "router": router, "key_type": "CLIENT_ID", "key_raw": cid,
           "key_filtered": cid, "key_transformed": cid, "client_address": "10.0.0.1",
           "client_port": 40000, "sni": None, "user": "app", "roles": ["app"],
           "container_id": cid, "target_name": target,
           "target_node_id": None if target is None else "n" + target[1:], "local": False,
           "policy": policy, "cache": cache, "cache_hit": cache == "hit", "pin": pin,
           "ready_targets": ready, "outcome": outcome}
    rec.update(extra)
    return json.dumps(rec)


def router(policy="FIRST_ELEMENT", targets=T, **kw):
    return candidate_router("main", key_type=kw.pop("key_type", KeyType.CLIENT_ID), policy=policy,
                            targets=targets, **kw)


def run(lines, cand, **kw):
    return replay(decisions_from_routing_log(lines).decisions, cand, **kw)


def test_unchanged_first_element_reproduces_every_decision():
    log = [line(f"c{i}", "t0") for i in range(4)]
    rep = run(log, router())
    assert (rep.replayed, rep.reproduced, rep.moved, rep.total_keys) == (4, 4, (), 4)
    assert rep.logged == {"t0": 4} and rep.candidate == {"t0": 4}
    assert rep.deterministic and rep.not_replayable == {} and rep.refused_in_log == {}


def test_removing_the_first_target_moves_every_key_to_the_next():
    log = [line("a", "t0"), line("b", "t0"), line("a", "t0")]
    rep = run(log, router(targets=T[1:]))
    assert [(m.key, m.before_name, m.after_name, m.decisions) for m in rep.moved] == \
        [("a", "t0", "t1", 2), ("b", "t0", "t1", 1)]
    assert rep.moved_count == 2 and rep.total_keys == 2 and rep.moved_fraction == 1.0
    assert rep.candidate == {"t1": 3}


def test_a_logged_cache_hit_keeps_its_target_while_it_is_in_the_pool():
    # FIRST_ELEMENT would pick t0; the warm cache says t2
    log = [line("k", "t2", cache="hit")]
    assert run(log, router(cache=True)).reproduced == 1
    moved = run(log, router(cache=True, targets=[T[0], T[1]])).moved
    assert [(m.before_name, m.after_name) for m in moved] == [("t2", "t0")]
    # a candidate without a cache has no warm entry: the policy decides
    assert [m.after_name for m in run(log, router()).moved] == ["t0"]


def test_pins_come_before_the_policy_and_follow_the_key_filter():
    pins = parse_pins('{"key": "a", "node_id": "n2"}\n{"pattern": "b-.*", "node_id": "t1"}')
    log = [line("a", "t2", pin="a", cache="skipped"), line("b-1", "t1", pin="/b-.*/", cache="skipped"),
           line("a.x", "t0")]
    rep = run(log, router(pins=pins))
    # a.x was not pinned; with the candidate's key filter its key is "a": pinned to n2 (t2)
    assert rep.reproduced == 3
    rep = run(log, router(pins=pins, key_filter="^[^.]+"))
    assert [(m.key, m.before_name, m.after_name) for m in rep.moved] == [("a.x", "t0", "t2")]


def test_round_robin_is_not_replayable_and_says_why():
    log = [line(f"c{i}", f"t{i % 3}", policy="ROUND_ROBIN") for i in range(6)]
    rep = run(log, router("ROUND_ROBIN"))
    assert rep.replayed == 0 and rep.not_replayable == {NOT_DETERMINISTIC["ROUND_ROBIN"]: 6}
    assert not rep.deterministic and rep.candidate == {} and rep.candidate_skew is None
    assert rep.logged == {"t0": 2, "t1": 2, "t2": 2} and rep.logged_skew == 1.0
    # ... but a logged RR decision replays against a key-deterministic candidate
    rep = run(log, router("FIRST_ELEMENT"))
    assert rep.replayed == 6 and rep.reproduced == 2 and rep.moved_count == 4


def test_least_connections_and_a_bounded_load_are_not_replayable():
    log = [line("c", "t0", policy="LEAST_CONNECTIONS")]
    assert run(log, router("LEAST_CONNECTIONS")).not_replayable == {NOT_DETERMINISTIC["LEAST_CONNECTIONS"]: 1}
    rep = run(log, router("CONSISTENT_HASH", properties={"LOAD_FACTOR": "1.25"}))
    assert rep.not_replayable == {NOT_DETERMINISTIC["CONSISTENT_HASH"]: 1}


def test_refusals_in_the_log_are_counted_apart_and_bad_lines_skipped():
    log = [line("a", None, outcome="REFUSED_UNAVAILABLE"), line("b", None, outcome="REFUSED_USE_ANOTHER"),
           line("c", "t0"), "not json", "[1]", json.dumps({"event": "close", "connection_id": "x"}),
           json.dumps({"event": "route", "router": "main"})]
    read = decisions_from_routing_log(log)
    assert (len(read.decisions), read.bad_lines, read.other_lines) == (3, 3, 1)
    rep = replay(read.decisions, router())
    assert rep.refused_in_log == {"REFUSED_UNAVAILABLE": 1, "REFUSED_USE_ANOTHER": 1}
    assert rep.decisions == 3 and rep.replayed == rep.reproduced == 1


def test_a_decision_made_on_a_degraded_pool_is_not_replayed_by_a_policy():
    log = [line("a", "t1", ready=2), line("b", "t0", ready=3)]
    rep = run(log, router(), full_pool=3)
    assert rep.not_replayable == {DEGRADED: 1} and rep.reproduced == 1
    # full_pool defaults to the most the log shows
    assert run(log, router()).not_replayable == {DEGRADED: 1}


def test_a_truncated_key_is_not_replayable():
    long = "x" * 20 + "...[truncated, 5000 chars]"
    rep = run([line(long, "t0")], router())
    assert rep.not_replayable == {TRUNCATED: 1}


def test_local_target_filter_and_candidate_refusals():
    local = Target("n-local", "127.0.0.1", 5600, name="local")
    log = [line("local-1", "t0"), line("x" * 20, "t0")]
    rep = run(log, router(local_target=local, local_filter="local-.*", max_key_length=10))
    assert sorted((m.key, m.after_name) for m in rep.moved) == [("local-1", "local"), ("x" * 20, None)]
    assert rep.candidate == {"local": 1, None: 1}
    assert rep.distribution()[-1] == {"target": None, "logged": 0, "logged_share": 0.0,
                                      "candidate": 1, "candidate_share": 0.5}


def test_below_quorum_the_candidate_refuses():
    rep = run([line("a", "t0")], router(targets=T[:1], quorum_size=2))
    assert [(m.before_name, m.after_name) for m in rep.moved] == [("t0", None)]


def test_ha_backup_names_compare_as_their_pair():
    pair = [Target("n0", "h", 1, name="p", pair="p"), Target(None, "h", 2, name="p-b", pair="p", backup=True)]
    rep = run([line("a", "p-b")], router(targets=pair), aliases={"p-b": "p"})
    assert rep.reproduced == 1 and rep.candidate_targets == ("p",)


def test_other_routers_lines_are_the_callers_to_filter():
    read = decisions_from_routing_log([line("a", "t0", router="other"), line("b", "t0")])
    assert [d.router for d in read.decisions] == ["other", "main"]


def test_skew_is_max_share_over_mean_share():
    assert skew({"t0": 3, "t1": 1}, ["t0", "t1", "t2"]) == pytest.approx(2.25)
    assert skew({"t0": 2, "t1": 2, None: 7}, ["t0", "t1"]) == 1.0
    assert skew({}, ["t0"]) is None


def test_consistent_hash_removal_moves_the_keys_the_dry_run_moves():
    keys = [f"client-{i}" for i in range(300)]
    placed = {t.identity: t.name for t in T}
    before = dry_run("CONSISTENT_HASH", {}, keys, T, T)  # nothing moves: a sanity check
    assert before.moved_count == 0
    from router.core.policies.registry import create_policy
    ch = create_policy("CONSISTENT_HASH", {})
    log = [line(k, placed[ch.select_target(T, k).identity], policy="CONSISTENT_HASH") for k in keys]
    assert run(log, router("CONSISTENT_HASH")).reproduced == 300
    after = change_pool(T, remove=["t1"])
    want = dry_run("CONSISTENT_HASH", {}, keys, T, after)
    rep = run(log, router("CONSISTENT_HASH", targets=after))
    assert {(m.key, m.before_name, m.after_name) for m in rep.moved} == \
        {(m.key, m.before_name, m.after_name) for m in want.moved}
    assert rep.moved_count == want.moved_count > 0
