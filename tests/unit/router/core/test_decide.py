"""Pure tests of the pool, the sticky cache, pins, dry runs and the decision flow."""

from __future__ import annotations

import json

import pytest

from router.core.cache import StickyCache
from router.core.decide import Outcome, Router
from router.core.dryrun import change_pool, dry_run, keys_from_key_list, keys_from_routing_log
from router.core.filters import compile_key_filter, compile_local_filter
from router.core.keys import ConnectionInfo, KeyResolver, KeyType
from router.core.pins import parse_pins
from router.core.pool import Pool, create_membership_source
from router.errors import MembershipSourceError, PinFileError
from router.policies import Target, create_policy


def T(i: int, node: str | None = None) -> Target:
    return Target(node, "127.0.0.1", 6000 + i, name=f"t{i}", management_url=f"http://x/{i}")


def conn(cid: str | None = None, src: str = "10.0.0.1:5000") -> ConnectionInfo:
    return ConnectionInfo(source=src, container_id=cid)


def make(n=3, policy="CONSISTENT_HASH", props=None, quorum=1, cache_ms=0, cache=True,
         local=None, local_enabled=False, local_filter=None, key_filter=None, pins=None):
    pool = Pool([T(i) for i in range(n)], quorum_size=quorum, local_target=local,
                local_target_enabled=local_enabled)
    r = Router("r", KeyResolver(KeyType.CLIENT_ID, compile_key_filter(key_filter)),
               policy=create_policy(policy, props or {}) if policy else None, pool=pool,
               cache=StickyCache(cache_ms) if cache else None,
               local_filter=compile_local_filter(local_filter, from_config=True), pins=pins)
    return r, pool


def test_quorum_gate_artemis_pool_test():
    pool = Pool([T(i) for i in range(10)], quorum_size=2)
    for i in range(10):
        pool.report_probe(f"t{i}", True, node_id=f"n{i}", connection_count=0, now=1.0)
    assert len(pool.targets()) == 10
    for i in range(1, 10):
        pool.report_probe(f"t{i}", False, error="down")
    assert pool.targets() == () and not pool.quorum_met
    pool.report_probe("t1", True, node_id="n1")
    assert [t.node_id for t in pool.targets()] == ["n0", "n1"]
    pool.quorum_size = 3
    assert pool.targets() == ()


def test_probe_learns_node_id_and_notifies():
    pool = Pool([T(0)])
    seen = []
    pool.listeners.append(lambda p: seen.append(p.version))
    pool.report_probe("t0", True, node_id="uuid-0", connection_count=4, now=2.0)
    assert pool.ready_target("uuid-0").node_id == "uuid-0"
    assert pool.ready_target("t0") is pool.ready_target("uuid-0")
    assert seen == [1]
    pool.report_probe("t0", True, node_id="uuid-0", connection_count=5, now=3.0)
    assert seen == [1]  # nothing changed for readiness/membership
    pool.report_probe("t0", False, error="HTTP 503")
    snap = pool.snapshot()
    assert snap["targets"][0]["last_error"] == "HTTP 503" and not snap["quorum_met"]


def test_below_quorum_refuses_unavailable_but_cache_hit_ignores_quorum():
    r, pool = make(quorum=2)
    pool.set_ready("t0", True, "n0")
    d = r.decide(conn("c1"), 1.0)
    assert d.outcome is Outcome.REFUSED_UNAVAILABLE and "below quorum" in d.explanation.reason
    pool.set_ready("t1", True, "n1")
    d = r.decide(conn("c1"), 2.0)
    assert d.ok and d.explanation.cache == "miss"
    pool.set_ready("t0" if d.target.name == "t1" else "t1", False)
    d2 = r.decide(conn("c1"), 3.0)  # below quorum now, but the cached target is ready
    assert d2.ok and d2.target == d.target and d2.explanation.cache == "hit"
    assert d2.explanation.cache_age_s == pytest.approx(1.0)


def test_stale_cache_entry_is_replaced():
    r, pool = make(policy="FIRST_ELEMENT")
    for i in range(3):
        pool.set_ready(f"t{i}", True, f"n{i}")
    assert r.decide(conn("c"), 1.0).target.node_id == "n0"
    pool.set_ready("t0", False)
    d = r.decide(conn("c"), 2.0)
    assert d.target.node_id == "n1" and d.explanation.cache == "stale"
    pool.set_ready("t0", True)
    assert r.decide(conn("c"), 3.0).target.node_id == "n1"  # sticky
    assert r.cache.entries["c"][0] == "n1"


def test_cache_expires_after_access():
    c = StickyCache(500, track_changes=True)
    c.put("k", "n1", 0.0)
    assert c.get("k", 0.4)[0] == "n1"
    assert c.get("k", 0.8)[0] == "n1"  # access at 0.4 refreshed it
    assert c.get("k", 1.31) is None
    changes, _ = c.drain()
    assert changes == {"k": None}
    c.put("a", "n", 0.0)
    c.put("b", "n", 0.3)
    assert c.expire(0.6) == ["a"] and list(c.entries) == ["b"]
    never = StickyCache(0)
    never.put("k", "n", 0.0)
    assert never.get("k", 1e9)[0] == "n"


def test_local_filter_and_local_target_readiness():
    local = Target("local-id", "127.0.0.1", 5999, name="local")
    r, pool = make(local=local, local_filter="NULL|0", policy="CONSISTENT_HASH_MODULO",
                   props={"MODULO": "2", "HASH": "FNV1A"})
    d = r.decide(conn(None), 1.0)
    assert d.outcome is Outcome.REFUSED_UNAVAILABLE and "local target not ready" in \
        d.explanation.reason
    pool.report_probe("local", True, node_id="local-id")
    d = r.decide(conn(None), 1.0)
    assert d.ok and d.local and d.explanation.local_match and d.explanation.key == "NULL"
    d = r.decide(conn("AAA"), 1.0)  # AAA → "0" with FNV1A
    assert d.local and d.explanation.key == "0" and d.explanation.filtered_key == "AAA"
    d = r.decide(conn("BBB"), 1.0)  # → "1": the modulo policy never selects
    assert d.outcome is Outcome.REFUSED_UNAVAILABLE


def test_local_target_enabled_is_first_in_pool_order():
    local = Target(None, "127.0.0.1", 5999, name="local")
    r, pool = make(policy="FIRST_ELEMENT", local=local, local_enabled=True)
    for name in ("t0", "local"):
        pool.set_ready(name, True, f"id-{name}")
    d = r.decide(conn("x"), 1.0)
    assert d.target.name == "local" and d.local


def test_no_policy_or_pool_refuses_use_another():
    r, pool = make(policy=None)
    pool.set_ready("t0", True)
    assert r.decide(conn("x"), 1.0).outcome is Outcome.REFUSED_USE_ANOTHER
    bare = Router("bare", KeyResolver(KeyType.CLIENT_ID))
    d = bare.decide(conn("x"), 1.0)
    assert d.outcome is Outcome.REFUSED_USE_ANOTHER and d.explanation.reason == "no policy"


def test_decide_for_key_skips_key_filter_and_populates_cache():
    r, pool = make(key_filter="^.{3}")
    for i in range(3):
        pool.set_ready(f"t{i}", True, f"n{i}")
    assert r.decide(conn("abcdef"), 1.0).explanation.key == "abc"
    d = r.decide_for_key("abcdef", 1.0)
    assert d.explanation.key == "abcdef" and "abcdef" in r.cache.entries


def test_management_setters_blank_clears():
    r, _ = make()
    r.set_key_filter("^x")
    assert r.get_key_filter() == "^x"
    r.set_key_filter("  ")
    assert r.get_key_filter() is None
    r.set_local_target_filter("a|b")
    assert r.get_local_target_filter() == "a|b"
    r.set_local_target_filter("")
    assert r.get_local_target_filter() is None


def test_pins_before_cache_and_fall_through_when_not_ready():
    pins = parse_pins('{"key": "gold", "node_id": "n2"}\n# comment\n'
                      '{"pattern": "eu-.*", "node_id": "t1"}\n')
    r, pool = make(policy="FIRST_ELEMENT", pins=pins)
    for i in range(3):
        pool.set_ready(f"t{i}", True, f"n{i}")
    assert r.decide(conn("plain"), 1.0).target.node_id == "n0"
    d = r.decide(conn("gold"), 1.0)
    assert d.target.node_id == "n2" and d.explanation.pin == "gold"
    assert r.decide(conn("eu-7"), 1.0).target.name == "t1"
    pool.set_ready("t2", False)
    d = r.decide(conn("gold"), 2.0)
    assert d.target.node_id == "n0" and d.explanation.pin == "gold"


@pytest.mark.parametrize("text,msg", [
    ("{bad", "<pins>:1: invalid JSON"),
    ('{"key": "a"}', "node_id None must be"),
    ('{"key": "a", "pattern": "b", "node_id": "n"}', "exactly one"),
    ('\n{"pattern": "(", "node_id": "n"}', "<pins>:2: invalid regular expression"),
    ('{"key": "a", "node_id": "n", "x": 1}', "unknown field 'x'"),
])
def test_pin_file_errors(text, msg):
    with pytest.raises(PinFileError, match=msg):
        parse_pins(text)


def test_explanation_to_dict_is_json():
    r, pool = make()
    pool.set_ready("t0", True, "n0")
    d = r.decide(conn("k"), 1.0)
    data = json.loads(json.dumps(d.to_dict()))
    assert data["outcome"] == "OK"
    ex = data["explanation"]
    assert {"raw_key", "filtered_key", "key", "local_match", "cache", "cache_age_s", "policy",
            "ready_targets", "total_targets", "quorum_size", "quorum_met"} <= set(ex)
    assert (ex["ready_targets"], ex["total_targets"], ex["policy"]) == (1, 3, "CONSISTENT_HASH")


def test_dry_run_add_and_remove():
    before = [T(i, f"n{i}") for i in range(4)]
    keys = [f"client-{i}" for i in range(4000)]
    after = change_pool(before, add=[T(9, "n9")])
    rep = dry_run("CONSISTENT_HASH", {}, keys, before, after)
    assert rep.deterministic and rep.total_keys == 4000
    assert all(m.after == "n9" for m in rep.moved)  # only keys taken by the new target move
    assert 0.1 < rep.moved_fraction < 0.3
    removed = change_pool(before, remove=["t1"])
    rep = dry_run("CONSISTENT_HASH", {}, keys, before, removed)
    assert all(m.before == "n1" for m in rep.moved) and rep.moved_count > 0
    assert not dry_run("ROUND_ROBIN", {}, keys[:5], before, removed).deterministic


def test_dry_run_inputs():
    log = [json.dumps({"explanation": {"filtered_key": "a", "key": "x"}}),
           json.dumps({"filtered_key": "b"}), "garbage", json.dumps({"explanation": {"key": "a"}})]
    assert keys_from_routing_log(log) == ["a", "b"]
    assert keys_from_key_list("a\n\n# c\n b \n") == ["a", "b"]


def test_membership_sources():
    src = create_membership_source("static", [T(0), T(1)])
    pool = Pool()
    src.start(pool)
    assert [st.target.name for st in pool.members] == ["t0", "t1"]
    with pytest.raises(MembershipSourceError, match="'mdns' is not available"):
        create_membership_source("mdns", [])
