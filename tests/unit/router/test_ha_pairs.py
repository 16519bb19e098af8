"""HA pairs in the router (issue 12, item 5): a primary and its backups serve one node id,
whichever is active. The pure parts — the pool offers one target per pair, placement equals the
pool without backups (Artemis vectors), a cached key waits while its pair fails over, split
brain is deterministic, the cluster view pairs members that share a node id, ``backup-of`` in
the config — and the shell's failover wait, re-probe on an upstream failure, and the prober
hurrying a pair that fails over."""

from __future__ import annotations

import csv
import json
import logging
from dataclasses import replace

import pytest
import trio

from broker.wire.io.tomlconfig import ConfigError
from router.config import CacheConfig, PolicyConfig, TargetConfig, load_router_config
from router.core.cache import StickyCache
from router.core.decide import Outcome, Router
from router.core.keys import ConnectionInfo, KeyResolver, KeyType
from router.core.membership import ClusterMembership, ViewMember, parse_cluster_view
from router.core.pool import Pool
from router.health import ProbeKicks, run_health_checks
from router.policies import Target, create_policy, fnv1a_utf16
from router.service import RouterService
from tests.paths import VECTORS
from tests.unit.router.test_service import FakeManagement, rconfig, start_fake
from tests.waiting import wait_for_async

ARTEMIS_HASH = {"HASH": "FNV1A", "VIRTUAL_NODES": "1"}


def tgt(name, node_id=None, *, pair=None, backup=False, port=None):
    return Target(node_id, "127.0.0.1", port or 5000 + len(name), False, f"http://m/{name}", name,
                  pair, backup)


def pair_pool(**kw) -> Pool:
    """a (primary) + a2 (its backup), b, c: three identities."""
    return Pool([tgt("a", "X", pair="a"), tgt("a2", pair="a", backup=True), tgt("b", "Y"),
                 tgt("c", "Z")], **kw)


def names(targets):
    return [t.name for t in targets]


# -- the pool: one target per identity ---------------------------------------------------------
def test_a_pair_is_one_target_served_by_its_active_member():
    pool = pair_pool()
    for s in ("a", "b", "c"):
        pool.report_probe(s, True, node_id={"a": "X", "b": "Y", "c": "Z"}[s])
    pool.report_probe("a2", False, node_id="X", error="broker not active")  # passive backup
    assert names(pool.targets()) == ["a", "b", "c"]
    assert (pool.ready_count, pool.total_count) == (3, 3)
    # failover: the primary dies, the backup activates with the primary's node id
    pool.report_probe("a", False, error="refused")
    assert names(pool.targets()) == ["b", "c"] and pool.failing_over("X") == "a"
    pool.report_probe("a2", True, node_id="X")
    assert names(pool.targets()) == ["a2", "b", "c"]  # the pair keeps its place
    assert pool.failing_over("X") is None
    for name in ("X", "a", "a2"):  # every name of the pair leads to its serving member
        assert pool.ready_target(name).name == "a2"
    assert pool.pairs() == [{"name": "a", "node_id": "X", "members": ["a", "a2"],
                             "backups": ["a2"], "serving": "a2", "active": ["a2"],
                             "state": "serving", "node_ids": ["X"]}]
    snap = pool.snapshot()
    assert snap["total"] == 3 and snap["pairs"][0]["serving"] == "a2"
    assert [(t["name"], t["pair"], t["backup"]) for t in snap["targets"]][:2] == [
        ("a", "a", False), ("a2", "a", True)]


def test_quorum_counts_a_pair_once():
    pool = pair_pool(quorum_size=2)
    pool.report_probe("a", True, node_id="X")
    pool.report_probe("a2", True, node_id="X")  # both active: still one identity
    assert not pool.quorum_met and pool.targets() == ()
    pool.report_probe("b", True, node_id="Y")
    assert pool.quorum_met


def test_failing_over_needs_a_pair_with_no_member_ready():
    pool = pair_pool()
    pool.report_probe("a", True, node_id="X")
    pool.report_probe("b", True, node_id="Y")
    assert pool.failing_over("X") is None                       # served
    pool.report_probe("b", False)
    assert pool.failing_over("Y") is None                       # a target on its own: Artemis
    pool.report_probe("a", False)
    assert {n: pool.failing_over(n) for n in ("X", "a", "a2")} == dict.fromkeys(("X", "a", "a2"), "a")
    assert pool.failing_over_slots() == {"a", "a2"}
    assert pool.pairs()[0]["state"] == "failing_over" and pool.pairs()[0]["node_id"] == "X"


def test_a_passive_backup_tells_the_pairs_node_id_a_lone_target_does_not_learn_it():
    pool = pair_pool()
    pool.report_probe("a2", False, node_id="X", error="broker not active")
    pool.report_probe("c", False, node_id="Q", error="broker not active")
    assert pool.ready_target("X") is None and pool.failing_over("X") == "a"
    assert [st.target.node_id for st in pool.members] == ["X", "X", "Y", "Z"]


@pytest.mark.parametrize("order", [("a", "a2"), ("a2", "a")])
def test_split_brain_picks_the_primary_whatever_the_order_and_never_alternates(order):
    pool = pair_pool()
    for s in order:
        pool.report_probe(s, True, node_id="X")
    assert pool.split_brain == {"a": ("a", "a2")}
    for _ in range(5):  # probe after probe: the same choice
        for s in reversed(order):
            pool.report_probe(s, True, node_id="X")
        assert names(pool.targets())[0] == "a" and pool.ready_target("X").name == "a"
    p = pool.pairs()[0]
    assert (p["state"], p["serving"], p["active"]) == ("split_brain", "a", ["a", "a2"])
    pool.report_probe("a", False)
    assert pool.split_brain == {} and pool.ready_target("X").name == "a2"


def test_two_backups_the_first_active_backup_serves():
    pool = Pool([tgt("a", pair="a"), tgt("a2", pair="a", backup=True),
                 tgt("a3", pair="a", backup=True)])
    pool.report_probe("a3", True, node_id="X")
    assert pool.ready_target("X").name == "a3"
    pool.report_probe("a2", True, node_id="X")
    assert pool.ready_target("X").name == "a2" and pool.split_brain == {"a": ("a2", "a3")}


def test_mark_not_ready_until_the_next_probe():
    pool = pair_pool()
    pool.report_probe("a", True, node_id="X", connection_count=3)
    v, probes = pool.version, pool.members[0].probes
    assert pool.mark_not_ready("a", "upstream connect failed: refused")
    assert not pool.members[0].ready and pool.members[0].probes == probes
    assert pool.members[0].last_error == "upstream connect failed: refused" and pool.version > v
    assert not pool.mark_not_ready("a", "again") and not pool.mark_not_ready("nope", "x")
    pool.report_probe("a", True, node_id="X")
    assert pool.ready_target("X").name == "a"


# -- placement: a pool with backups places every key as the pool without them -----------------
def _vector_rows():
    with (VECTORS / "hash_vectors.tsv").open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r for r in rows if r["policy"] == "CONSISTENT_HASH" and r["target_set"] == "uuids"
            and int(r["param"]) >= 2]


ROWS = _vector_rows()


def test_there_are_artemis_vectors_for_this():
    assert len(ROWS) >= 50


@pytest.mark.parametrize("failed_over", [False, True])
def test_artemis_consistent_hash_places_keys_as_without_backups(failed_over):
    """Every CONSISTENT_HASH vector over the ``uuids`` target set: each target gets a backup;
    with the primaries serving, or (failed_over) every backup serving its primary's node id,
    the pair chosen is the one Artemis chose among the targets alone."""
    for r in ROWS:
        ids = r["target_node_ids"].split(";")
        members = []
        for i, nid in enumerate(ids):
            members += [tgt(f"t{i}", nid, pair=f"t{i}"), tgt(f"t{i}b", pair=f"t{i}", backup=True)]
        pool = Pool(members)
        for i, nid in enumerate(ids):
            pool.report_probe(f"t{i}b" if failed_over else f"t{i}", True, node_id=nid)
            pool.report_probe(f"t{i}" if failed_over else f"t{i}b", False, node_id=nid)
        policy = create_policy("CONSISTENT_HASH", ARTEMIS_HASH)
        got = policy.select_target(pool.targets(), json.loads(r["key_json"]))
        assert got.node_id == ids[int(r["expected"])], r
        assert got.name == f"t{r['expected']}" + ("b" if failed_over else "")


@pytest.mark.parametrize("props", [{}, ARTEMIS_HASH])
def test_consistent_hash_ring_is_the_same_with_both_members_active(props):
    ids = [f"node-{i}" for i in range(4)]
    alone = Pool([tgt(f"t{i}", nid) for i, nid in enumerate(ids)])
    paired = Pool([m for i, nid in enumerate(ids) for m in
                   (tgt(f"t{i}", nid, pair=f"t{i}"), tgt(f"t{i}b", pair=f"t{i}", backup=True))])
    for i, nid in enumerate(ids):
        alone.report_probe(f"t{i}", True, node_id=nid)
        paired.report_probe(f"t{i}", True, node_id=nid)
        paired.report_probe(f"t{i}b", True, node_id=nid)  # split brain everywhere
    p1, p2 = create_policy("CONSISTENT_HASH", props), create_policy("CONSISTENT_HASH", props)
    for k in range(300):
        assert p1.select_target(alone.targets(), f"key-{k}").node_id == \
            p2.select_target(paired.targets(), f"key-{k}").node_id


def test_modulo_transform_is_untouched_by_pairs():
    pool = pair_pool()
    for s in ("a", "a2", "b"):
        pool.report_probe(s, True, node_id="X" if s != "b" else "Y")
    p = create_policy("CONSISTENT_HASH_MODULO", {"MODULO": "3", "HASH": "FNV1A"})
    # the key is sharded by its own hash: no target (nor pair) takes part
    assert p.transform_key("client-1") == str((fnv1a_utf16("client-1") & 0x7FFFFFFF) % 3)
    assert p.select_target(pool.targets(), p.transform_key("client-1")) is None


def test_round_robin_least_connections_and_first_element_count_a_pair_once():
    pool = pair_pool()
    for s, nid, n in (("a", "X", 5), ("a2", "X", 0), ("b", "Y", 3), ("c", "Z", 9)):
        pool.report_probe(s, True, node_id=nid, connection_count=n)
    rr = create_policy("ROUND_ROBIN", {}, __import__("random").Random(1))
    assert sorted(names(rr.select_target(pool.targets(), "k") for _ in range(3))) == ["a", "b", "c"]
    lc = create_policy("LEAST_CONNECTIONS", {})
    for st in pool.members:
        lc.observe(st.target, st.connection_count)
    # a2's count (0) is not a target's: the pair is served by a (5); b has the fewest
    assert lc.select_target(pool.targets(), "k").name == "b"
    assert create_policy("FIRST_ELEMENT", {}).select_target(pool.targets(), "k").name == "a"
    pool.report_probe("a", False)
    assert create_policy("FIRST_ELEMENT", {}).select_target(pool.targets(), "k").name == "a2"


# -- the decision: a cached key waits while its pair fails over ---------------------------------
def router_for(pool, cache=None, policy="CONSISTENT_HASH"):
    return Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy(policy, ARTEMIS_HASH
                  if policy == "CONSISTENT_HASH" else {}), pool=pool,
                  cache=cache if cache is not None else StickyCache(0))


def conn(key):
    return ConnectionInfo("10.0.0.1:1", container_id=key)


def test_a_cached_key_waits_for_its_pair_then_follows_it_to_the_backup():
    pool = pair_pool()
    for s, nid in (("a", "X"), ("b", "Y"), ("c", "Z")):
        pool.report_probe(s, True, node_id=nid)
    r = router_for(pool)
    r.cache.put("k1", "X", 0.0)
    assert r.decide(conn("k1"), 1.0).target.name == "a"
    pool.report_probe("a", False, error="refused")       # failing over: the backup is passive
    d = r.decide(conn("k1"), 2.0)
    assert d.outcome is Outcome.REFUSED_UNAVAILABLE and d.target is None
    assert d.explanation.failover == "a" and d.explanation.cache == "stale"
    assert "pair a is failing over" in d.explanation.reason
    assert r.lookup(conn("k1"), 2.0)[0].explanation.failover == "a"
    assert r.cache.get("k1", 2.0)[0] == "X"               # nothing re-placed
    pool.report_probe("a2", True, node_id="X")           # the backup is active
    d = r.decide(conn("k1"), 3.0)
    assert d.ok and d.target.name == "a2" and d.explanation.cache == "hit"
    assert r.cache.get("k1", 3.0)[0] == "X"               # the key still names the node id


def test_after_the_wait_or_without_one_the_key_is_re_placed_as_in_artemis():
    pool = pair_pool()
    for s, nid in (("a", "X"), ("b", "Y"), ("c", "Z")):
        pool.report_probe(s, True, node_id=nid)
    pool.report_probe("a", False)
    r = router_for(pool)
    r.cache.put("k1", "X", 0.0)
    d = r.decide_resolved(r.resolve(conn("k1")), 1.0, hold=False)
    assert d.ok and d.target.name in ("b", "c") and d.explanation.cache == "stale"
    assert d.explanation.failover is None and r.cache.get("k1", 1.0)[0] == d.target.node_id
    r.cache.put("k2", "X", 0.0)
    r.failover_wait = False                                # quorum-timeout = 0
    assert r.decide(conn("k2"), 1.0).ok
    # a target on its own that is not ready: the policy re-places at once (Artemis)
    r.failover_wait = True
    pool.report_probe("b", False)
    r.cache.put("k3", "Y", 0.0)
    d = r.decide(conn("k3"), 1.0)
    assert d.ok and d.target.name == "c" and d.explanation.cache == "stale"


def first_element_sites(**kw) -> Pool:
    """s1 (primary) + s1b (its backup), then s2: FIRST_ELEMENT's first choice is the pair."""
    pool = Pool([tgt("s1", "X", pair="s1"), tgt("s1b", pair="s1", backup=True), tgt("s2", "Y")], **kw)
    pool.report_probe("s1", True, node_id="X", now=0.0)
    pool.report_probe("s1b", False, node_id="X", error="broker not active", now=0.0)
    pool.report_probe("s2", True, node_id="Y", now=0.0)
    return pool


def test_first_element_waits_for_its_first_choice_pair_while_it_fails_over():
    pool = first_element_sites()
    r = router_for(pool, policy="FIRST_ELEMENT", cache=None)
    r.cache = None
    r.failover_wait_s = 3.0
    assert r.decide(conn("new-1"), 1.0).target.name == "s1"
    pool.report_probe("s1", False, error="refused", now=10.0)     # the primary dies
    d = r.decide(conn("new-2"), 10.5)
    assert d.outcome is Outcome.REFUSED_UNAVAILABLE and d.explanation.failover == "s1"
    assert "first in pool order, is failing over" in d.explanation.reason
    # the shell's wait ran out (hold=False): the next one in pool order
    assert r.decide_resolved(r.resolve(conn("new-2")), 13.0, hold=False).target.name == "s2"
    pool.report_probe("s1b", True, node_id="X", now=11.0)           # the backup is active
    assert r.decide(conn("new-3"), 11.5).target.name == "s1b"


def test_first_element_stops_waiting_once_the_failover_took_longer_than_the_wait():
    pool = first_element_sites()
    r = router_for(pool, policy="FIRST_ELEMENT")
    r.cache = None
    r.failover_wait_s = 3.0
    pool.report_probe("s1", False, error="refused", now=10.0)
    assert r.decide(conn("k"), 12.9).explanation.failover == "s1"
    assert r.decide(conn("k"), 13.0).target.name == "s2"           # the whole site is gone
    r.failover_wait = False                                       # quorum-timeout = 0: never waits
    pool2 = first_element_sites()
    r2 = router_for(pool2, policy="FIRST_ELEMENT")
    r2.failover_wait = False
    pool2.report_probe("s1", False, error="refused", now=10.0)
    assert r2.decide(conn("k"), 10.1).target.name == "s2"


def test_first_element_does_not_wait_for_a_pair_never_served_nor_a_lone_target():
    pool = Pool([tgt("s1", "X", pair="s1"), tgt("s1b", pair="s1", backup=True), tgt("s2", "Y")])
    pool.report_probe("s1", False, error="refused", now=0.0)        # down since the start
    pool.report_probe("s1b", False, error="refused", now=0.0)
    pool.report_probe("s2", True, node_id="Y", now=0.0)
    r = router_for(pool, policy="FIRST_ELEMENT")
    assert r.decide(conn("k"), 1.0).target.name == "s2"
    lone = Pool([tgt("a", "X"), tgt("b", "Y")])
    lone.report_probe("a", True, now=0.0)
    lone.report_probe("b", True, now=0.0)
    lone.report_probe("a", False, now=1.0)
    assert router_for(lone, policy="FIRST_ELEMENT").decide(conn("k"), 1.5).target.name == "b"
    # other policies re-place a new key at once, as before (only cached keys wait)
    pool3 = first_element_sites()
    pool3.report_probe("s1", False, error="refused", now=10.0)
    assert router_for(pool3, policy="ROUND_ROBIN").decide(conn("k"), 10.5).target.name == "s2"


def test_no_diversion_while_a_first_choice_pair_fails_over_so_no_hold():
    pool = first_element_sites(allow_failback=False)
    r = router_for(pool, policy="FIRST_ELEMENT")
    r.failover_wait_s = 3.0
    pool.report_probe("s1", False, error="refused", now=10.0)
    d = r.decide(conn("k"), 10.2)
    assert d.target is None                                          # it waits: nobody goes to s2
    pool.report_probe("s1b", True, node_id="X", now=10.8)
    assert pool.held == {} and r.decide(conn("k"), 11.0).target.name == "s1b"


def test_a_pair_whose_members_left_is_no_pair_any_more():
    pool = pair_pool()
    pool.report_probe("a", True, node_id="X")
    pool.report_probe("b", True, node_id="Y")
    pool.report_probe("a", False)
    assert pool.failing_over("X") == "a"
    pool.remove_target("a2")                               # one member left: a lone target
    assert pool.failing_over("X") is None
    r = router_for(pool)
    r.cache.put("k", "X", 0.0)
    assert r.decide(conn("k"), 1.0).target.name == "b"


# -- config: backup-of ----------------------------------------------------------------------------
HEAD = '''
[[acceptors]]
name = "p"
port = 0
router = "main"
mode = "proxy"
[routers.main.policy]
name = "CONSISTENT_HASH"
[routers.main.pool]
'''


def target_toml(name, port, *, mgmt=True, extra=""):
    return (f'[[routers.main.pool.targets]]\nname = "{name}"\nhost = "127.0.0.1"\nport = {port}\n'
            + (f'management-url = "http://127.0.0.1:{port + 1000}"\n' if mgmt else "") + extra)


def load(tmp_path, text):
    p = tmp_path / "router.toml"
    p.write_text(text)
    return load_router_config(p)


def test_backup_of_makes_a_pair_of_two_targets(tmp_path):
    cfg = load(tmp_path, HEAD + target_toml("b1", 5001, extra='node-id = "X"\n')
               + target_toml("b1-backup", 5002, extra='backup-of = "b1"\n')
               + target_toml("b2", 5003))
    ts = [tc.to_target() for tc in cfg.routers["main"].pool.targets]
    assert [(t.name, t.node_id, t.pair, t.backup) for t in ts] == [
        ("b1", "X", "b1", False), ("b1-backup", None, "b1", True), ("b2", None, None, False)]
    svc = RouterService(cfg.routers["main"])
    assert svc.pool.total_count == 2 and svc.pool.pair_count == 1


@pytest.mark.parametrize("targets, path, msg", [
    (target_toml("a", 1) + target_toml("b", 2, extra='backup-of = "zz"\n'),
     "targets[1].backup-of", "names no other target"),
    (target_toml("a", 1, extra='backup-of = "a"\n'), "targets[0].backup-of", "names no other"),
    (target_toml("b", 2, extra='backup-of = "a"\n') + target_toml("a", 1),
     "targets[0].backup-of", "must be listed before its backup"),
    (target_toml("a", 1) + target_toml("b", 2, extra='backup-of = "a"\n')
     + target_toml("c", 3, extra='backup-of = "b"\n'), "targets[2].backup-of", "is itself a backup"),
    (target_toml("a", 1) + target_toml("b", 2, extra='backup-of = "a"\nnode-id = "X"\n'),
     "targets[1].node-id", "set node-id on 'a'"),
    (target_toml("a", 1, mgmt=False) + target_toml("b", 2, extra='backup-of = "a"\n'),
     "targets[0].management-url", "passive backup"),
    (target_toml("a", 1) + target_toml("b", 2, mgmt=False, extra='backup-of = "a"\n'),
     "targets[1].management-url", "passive backup"),
])
def test_backup_of_errors(tmp_path, targets, path, msg):
    with pytest.raises(ConfigError) as ei:
        load(tmp_path, HEAD + targets)
    assert ei.value.path == f"routers.main.pool.{path}" and msg in ei.value.message, str(ei.value)


def test_only_pool_targets_can_be_backups(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load(tmp_path, HEAD + target_toml("a", 1)
             + '[routers.main.local-target]\nhost = "h"\nport = 1\nbackup-of = "a"\n')
    assert ei.value.path == "routers.main.local-target.backup-of"


# -- the cluster view: members that share a node id form a pair ----------------------------------
def view(members, node_id="A", port=5001, role=None):
    body = {"node_id": node_id, "connector": f"amqp://127.0.0.1:{port}", "members": members}
    if role:
        body["role"] = role
    return body


def member(node_id, port, connected=True, role=None):
    m = {"node_id": node_id, "connector": f"amqp://127.0.0.1:{port}",
         "management_url": f"http://127.0.0.1:{port + 1000}", "connected": connected}
    if role:
        m["role"] = role
    return m


def test_a_view_lists_backups_with_their_primarys_node_id():
    body = view([member("B", 5002), member("B", 5012, role="backup"),
                 member("A", 5011, connected=False, role="backup"),
                 member("B", 5013), member("B", 5012, role="backup")])   # skipped: no pair shape
    out = parse_cluster_view(body, "http://127.0.0.1:6001")
    assert [(m.node_id, m.port, m.backup, m.alive) for m in out] == [
        ("A", 5001, False, True), ("B", 5002, False, True), ("B", 5012, True, True),
        ("A", 5011, True, False)]
    # the answering node may itself be a backup
    out = parse_cluster_view(view([member("A", 5002)], role="backup"), "http://127.0.0.1:6001")
    assert [(m.node_id, m.port, m.backup) for m in out] == [("A", 5001, True), ("A", 5002, False)]


def vm(node_id, port, alive=True, backup=False):
    return ViewMember(node_id, "127.0.0.1", port, False, f"http://127.0.0.1:{port + 1000}", alive,
                      backup)


def test_members_with_one_node_id_join_as_a_pair_and_keep_their_state_when_roles_change():
    m = ClusterMembership(leave_after_s=10)
    ch = m.observe([vm("A", 5001), vm("B", 5002), vm("B", 5012, backup=True)], now=0)
    assert [(t.name, t.node_id, t.pair, t.backup) for t in ch.added] == [
        ("A", "A", "A", False), ("B", "B", "B", False), ("B@127.0.0.1:5012", "B", "B", True)]
    pool = Pool()
    for t in ch.added:
        pool.add_target(t)
    assert pool.pair_count == 1 and pool.total_count == 2
    for s in ("A", "B"):
        pool.report_probe(s, True, node_id=s)
    pool.report_probe("B@127.0.0.1:5012", False, node_id="B")
    assert names(pool.targets()) == ["A", "B"]
    # B dies, its backup activates; later views list the backup as the node's primary
    ch = m.observe([vm("A", 5001), vm("B", 5002, alive=False), vm("B", 5012, backup=True)], now=1)
    assert not ch
    pool.report_probe("B", False)
    pool.report_probe("B@127.0.0.1:5012", True, node_id="B")
    ch = m.observe([vm("A", 5001), vm("B", 5012)], now=2)
    assert ch.added == () and ch.removed == () and [(t.name, t.backup) for t in ch.updated] == [
        ("B@127.0.0.1:5012", False)]
    for t in ch.updated:
        assert pool.update_target(t)
    assert pool.ready_target("B").name == "B@127.0.0.1:5012"   # still ready: state kept
    # the dead primary's address leaves after leave-after; the pair is the backup alone
    ch = m.observe([vm("A", 5001), vm("B", 5012)], now=10.5)
    assert ch.removed == ("B",)
    pool.remove_target("B")
    assert pool.pair_count == 0 and pool.ready_target("B").name == "B@127.0.0.1:5012"


def test_a_worker_follows_a_role_change_without_losing_state():
    a = Target("A", "127.0.0.1", 1, False, "http://m/a", "A", "A", False)
    a2 = Target("A", "127.0.0.1", 2, False, "http://m/a2", "A@127.0.0.1:2", "A", True)
    pool = Pool([a, a2])
    pool.report_probe("A@127.0.0.1:2", True, node_id="A")
    assert pool.sync_members([a, Target("A", "127.0.0.1", 2, False, "http://m/a2",
                                        "A@127.0.0.1:2", "A", False)])
    assert pool.members[1].ready and not pool.members[1].target.backup


# -- the shell: waiting for a failover, re-probing on an upstream failure -------------------------
def pair_config(quorum_timeout=3000, check_period=100, urls=None):
    urls = urls or {}
    targets = [TargetConfig("a", "127.0.0.1", 5001, management_url=urls.get("a", "http://m/a"),
                            pair="a"),
               TargetConfig("a2", "127.0.0.1", 5002, management_url=urls.get("a2", "http://m/a2"),
                            backup_of="a", pair="a"),
               TargetConfig("b", "127.0.0.1", 5003, management_url=urls.get("b", "http://m/b"))]
    return rconfig(targets, policy="CONSISTENT_HASH", props=ARTEMIS_HASH, cache=CacheConfig(),
                   quorum_timeout=quorum_timeout, check_period=check_period)


def settled_service(**kw) -> RouterService:
    svc = RouterService(pair_config(**kw))
    svc.pool.report_probe("a", True, node_id="X")
    svc.pool.report_probe("a2", False, node_id="X", error="broker not active")
    svc.pool.report_probe("b", True, node_id="Y")
    svc.core.cache.put("k1", "X", 0.0)
    svc.pool.report_probe("a", False, error="refused")
    return svc


async def test_a_key_waits_for_its_pairs_failover(autojump_clock):
    svc = settled_service()
    got = {}

    async def client():
        got["d"] = await svc.route(conn("k1"))

    async with trio.open_nursery() as n:
        n.start_soon(client)
        await trio.sleep(1.5)   # the thing under test: time passes (autojump clock) while the pair fails over
        assert "d" not in got                       # waiting, not re-placed on b
        svc.pool.report_probe("b", True, node_id="Y", connection_count=1)  # unrelated change
        await trio.sleep(0.5)   # the thing under test: the unrelated change does not end the wait
        assert "d" not in got
        svc.pool.report_probe("a2", True, node_id="X")
    d = got["d"]
    assert d.ok and d.target.name == "a2" and d.explanation.cache == "hit"
    assert d.explanation.waited_s == pytest.approx(2.0, abs=0.01)
    assert svc.counters["failover_waits"] == 1 and svc.counters["failover_wait_timeouts"] == 0
    assert svc.counters["quorum_waits"] == 0 and svc.cache_entries()[0]["node_id"] == "X"


async def test_a_failover_wait_ends_at_quorum_timeout_then_the_key_is_re_placed(autojump_clock):
    svc = settled_service(quorum_timeout=3000)
    start = trio.current_time()
    d = await svc.route(conn("k1"))
    assert trio.current_time() - start == pytest.approx(3.0, abs=0.01)
    assert d.ok and d.target.name == "b" and d.explanation.cache == "stale"
    assert svc.counters["failover_wait_timeouts"] == 1
    assert svc.cache_entries()[0]["node_id"] == "Y"       # fail-back = stay: re-pointed
    svc0 = settled_service(quorum_timeout=0)               # no wait at all
    start = trio.current_time()
    assert (await svc0.route(conn("k1"))).target.name == "b" and trio.current_time() == start
    assert svc0.counters["failover_waits"] == 0


async def test_a_new_connection_waits_for_the_first_choice_pair_under_first_element(autojump_clock):
    cfg = pair_config()
    svc = RouterService(replace(cfg, policy=PolicyConfig("FIRST_ELEMENT", {}), cache=None))
    now = svc.clock()
    svc.pool.report_probe("a", True, node_id="X", now=now)
    svc.pool.report_probe("a2", False, node_id="X", error="broker not active", now=now)
    svc.pool.report_probe("b", True, node_id="Y", now=now)
    svc.pool.report_probe("a", False, error="refused", now=svc.clock())
    got = {}

    async def client():
        got["d"] = await svc.route(conn("fresh"))

    async with trio.open_nursery() as n:
        n.start_soon(client)
        await trio.sleep(0.8)   # the thing under test: time passes while the pair fails over
        assert "d" not in got
        svc.pool.report_probe("a2", True, node_id="X", now=svc.clock())
    d = got["d"]
    assert d.ok and d.target.name == "a2" and svc.counters["failover_waits"] == 1


async def test_an_upstream_failure_marks_the_target_down_and_kicks_its_probe():
    svc = settled_service()
    svc.pool.report_probe("b", True, node_id="Y")
    pushed = []
    svc.round_listeners.append(lambda: pushed.append(1))
    svc.upstream_failed("b", "could not reach broker b:5003")
    st = svc.pool.snapshot()["targets"][2]
    assert not st["ready"] and st["last_error"].startswith("upstream connect failed")
    assert svc.counters["upstream_marked_down"] == 1 and svc.counters["upstream_reprobes"] == 1
    assert svc._kicks.kicks == 1 and pushed == [1]
    svc.upstream_failed("b", "again")                      # already down: only the kick
    assert svc.counters["upstream_marked_down"] == 1 and svc._kicks.kicks == 2


class FakeLink:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


async def test_a_worker_reports_upstream_failures_to_its_supervisor_rate_limited():
    link = FakeLink()
    now = [100.0]
    svc = RouterService(pair_config(), shared=link, clock=lambda: now[0])
    svc.pool.report_probe("b", True, node_id="Y")
    for _ in range(20):                                    # a flood of failing connections
        svc.upstream_failed("b", "refused")
    assert not svc.pool.snapshot()["targets"][2]["ready"]  # marked here at once
    assert link.sent == [{"op": "upstream_failed", "router": "r", "slot": "b", "error": "refused"}]
    now[0] += 0.15
    svc.upstream_failed("b", "refused")
    assert len(link.sent) == 2 and svc._kicks.kicks == 0   # the worker never probes


def test_the_supervisor_hands_a_workers_report_to_its_service():
    from router.workers import Supervisor, WorkerSlot

    calls = []

    class Svc:
        def upstream_failed(self, slot, error):
            calls.append((slot, error))

    sup = Supervisor("x.toml", None, 1, {})
    sup.services = {"r": Svc()}
    assert sup._handle(WorkerSlot(0), {"op": "upstream_failed", "router": "r", "slot": "b",
                                       "error": "refused"}) is None
    assert calls == [("b", "refused")]


async def test_pair_state_changes_are_logged_once(caplog):
    caplog.set_level(logging.WARNING, logger="lodestone.router.service")
    svc = RouterService(pair_config())
    svc.pool.report_probe("a2", False, node_id="X")        # starting: not "failing over"
    svc.pool.report_probe("a", True, node_id="X")
    svc.pool.report_probe("a2", True, node_id="X")
    svc.pool.report_probe("a2", True, node_id="X", connection_count=3)
    svc.pool.report_probe("a", False)
    svc.pool.report_probe("a2", False)
    svc.pool.report_probe("a2", True, node_id="X")
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 4, msgs
    assert "a, a2 are active at once (split brain); connections go to a only" in msgs[0]
    assert caplog.records[0].levelno == logging.ERROR
    assert "served by a2" in msgs[1] and "is failing over" in msgs[2] and "served by a2" in msgs[3]


# -- the prober: kicks and a pair failing over -------------------------------------------------------
async def test_a_kick_probes_at_once_and_kicks_coalesce(nursery):
    fake = FakeManagement("uuid-a")
    url = await start_fake(nursery, fake)
    pool = Pool([Target(None, "127.0.0.1", 1, False, url, "a")])
    kicks = ProbeKicks()
    await nursery.start(lambda task_status: run_health_checks(
        pool, check_period_ms=60_000, username="admin", password="pw", clock=trio.current_time,
        kicks=kicks, task_status=task_status))
    assert fake.requests == 1
    start = trio.current_time()
    for _ in range(50):                                    # a flood: one more probe, not 50
        kicks.kick("a")
    await wait_for_async(lambda: fake.requests >= 2, 2, interval_s=0.01, what="the kicked probe")
    assert trio.current_time() - start < 1
    await trio.sleep(0.3)   # the thing under test: no second probe comes of the other 49 kicks
    assert fake.requests == 2


async def test_a_pair_failing_over_is_probed_until_a_member_is_active(nursery):
    primary, backup = FakeManagement("X"), FakeManagement("X", active=False)
    url_a, url_b = await start_fake(nursery, primary), await start_fake(nursery, backup)
    pool = Pool([Target(None, "127.0.0.1", 1, False, url_a, "a", "a"),
                 Target(None, "127.0.0.1", 2, False, url_b, "a2", "a", True)])
    kicks = ProbeKicks()
    await nursery.start(lambda task_status: run_health_checks(
        pool, check_period_ms=60_000, username="admin", password="pw", clock=trio.current_time,
        kicks=kicks, task_status=task_status))
    assert pool.ready_target("X").name == "a" and backup.requests == 1
    primary.active = False
    pool.mark_not_ready("a", "upstream connect failed")   # as the service does...
    kicks.kick("a")                                        # ...with a kick
    # the backup is probed again and again
    await wait_for_async(lambda: backup.requests >= 4, 3, interval_s=0.01, what="the backup probed 3 more times")
    backup.active = True
    start = trio.current_time()
    await wait_for_async(lambda: pool.ready_target("X") is not None, 3, interval_s=0.01, what="X served")
    assert pool.ready_target("X").name == "a2" and trio.current_time() - start <= 1.5
    n = backup.requests
    await trio.sleep(0.5)   # the thing under test: served again, no more probes (back to check-period)
    assert backup.requests == n


async def test_the_cluster_source_applies_pairs_and_role_changes_to_the_pool():
    from router.cluster_source import ClusterSource
    from router.core.pool import FollowContext

    src = ClusterSource([], {"seed-connectors": ["http://seed:1"]})
    views = [[vm("A", 5001), vm("B", 5002), vm("B", 5012, backup=True)],
             [vm("A", 5001), vm("B", 5002, alive=False), vm("B", 5012)]]

    async def read_view(url, ctx, timeout_s, ssl_context=None):
        return views.pop(0)

    src.read_view = read_view
    pool = Pool()
    ctx = FollowContext(1000, clock=lambda: 0.0)
    assert await src.refresh(pool, ctx)
    assert [(st.target.name, st.target.pair, st.target.backup) for st in pool.members] == [
        ("A", "A", False), ("B", "B", False), ("B@127.0.0.1:5012", "B", True)]
    pool.report_probe("B@127.0.0.1:5012", True, node_id="B")
    assert await src.refresh(pool, ctx)                   # the backup is listed as the primary
    st = pool.members[2]
    assert st.ready and not st.target.backup and pool.ready_target("B") is st.target
    assert src.status()["members"] == ["A", "B", "B@127.0.0.1:5012"]


def test_the_dry_run_counts_a_pair_once(tmp_path, capsys):
    from router.dryrun_cli import dry_run_main

    p = tmp_path / "router.toml"
    p.write_text(HEAD + target_toml("b1", 5001, extra='node-id = "X"\n')
                 + target_toml("b1-backup", 5002, extra='backup-of = "b1"\n')
                 + target_toml("b2", 5003, extra='node-id = "Y"\n'))
    keys = tmp_path / "keys.txt"
    keys.write_text("\n".join(f"k{i}" for i in range(200)) + "\n")
    assert dry_run_main([str(p), "--keys", str(keys), "--json", "--remove", "b2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["before_targets"] == ["X", "Y"] and report["after_targets"] == ["X"]
