"""The discovery pool's parts (``source = "discovery"``): an announcement → its targets, HA
backups included (``router.core.membership``), a discovery group's table changes → pool joins,
leaves and role changes
(``router.discovery_source``, fed real packets through the broker's own ``DiscoveryGroup``), the
``[...pool.discovery-group]`` config keys and their errors. The multicast itself is tested with
real brokers and a real router in tests/integration/test_router_discovery_pool.py (and a
replicated pair in tests/integration/test_router_discovery_pairs.py)."""

from __future__ import annotations

import pytest
import trio

from broker.wire.discovery import Announcement, encode_announcement
from broker.wire.io.tomlconfig import ConfigError
from router.config import load_router_config
from router.core.membership import (PAIR_HOLD_S, DiscoveryMembership, MembershipChange, announced_target, announced_targets,
                                    discovery_change)
from router.core.policies.base import Target
from router.core.pool import FollowContext, Pool
from router.discovery_source import DiscoverySource, check_options
from router.errors import MembershipSourceError
from router.service import RouterService

GROUP = {"group-address": "231.7.7.7", "group-port": 9876}


def ann(node_id="n1", port=5001, *, mgmt="http://127.0.0.1:6001/", scheme="amqp", cluster="c1", seq=1,
        more=(), backups=()):
    return Announcement(node_id, cluster, mgmt, (f"{scheme}://127.0.0.1:{port}", *more), seq, backups)


# -- announcement → target ------------------------------------------------------------------------
def test_an_announcement_names_its_target():
    t = announced_target(ann(more=("amqp://10.0.0.9:7000",)))
    assert t == Target("n1", "127.0.0.1", 5001, False, "http://127.0.0.1:6001", "n1", pair="n1")
    assert t.slot == t.identity == t.group == "n1"  # named by the node id: caches and hashes hold node ids
    tls = announced_target(ann(scheme="amqps", mgmt=""))
    assert (tls.tls, tls.management_url) == (True, None)  # no management URL: TCP probe


def test_table_changes_become_pool_changes():
    a = ann()
    assert discovery_change("added", a) == (MembershipChange((announced_target(a),)), None)
    moved = ann(port=5009, seq=2)
    assert discovery_change("changed", moved, [announced_target(a)]) == (
        MembershipChange((announced_target(moved),), ("n1",)), None)
    assert discovery_change("removed", a, [announced_target(a)]) == (MembershipChange(removed=("n1",)), None)
    assert discovery_change("removed", a) == (MembershipChange(), None)  # it held no slot
    # a connector without a port: no target, and the reason
    bad = Announcement("n2", "c1", "", ("amqp://h",), 1)
    change, why = discovery_change("added", bad)
    assert not change and "n2" in why and "host:port" in why
    change, why = discovery_change("changed", bad, [Target("n2", "h", 1, name="n2", pair="n2")])
    # it moved somewhere unusable: it leaves
    assert change == MembershipChange(removed=("n2",)) and why
    with pytest.raises(ValueError):
        discovery_change("refreshed", a)


# -- HA backups in announcements → pairs -------------------------------------------------------------
B1 = ("amqp://127.0.0.1:7001", "http://127.0.0.1:8001/", True)
B2 = ("amqps://10.0.0.2:7002", "", False)


def test_announced_backups_are_members_of_the_node_ids_pair():
    targets, why = announced_targets(ann(backups=(B1, B2)))
    assert why is None
    assert targets == (
        Target("n1", "127.0.0.1", 5001, False, "http://127.0.0.1:6001", "n1", "n1", False),
        Target("n1", "127.0.0.1", 7001, False, "http://127.0.0.1:8001", "n1@127.0.0.1:7001", "n1", True),
        Target("n1", "10.0.0.2", 7002, True, None, "n1@10.0.0.2:7002", "n1", True))  # no URL: TCP probe
    assert {t.group for t in targets} == {"n1"}    # one routing identity
    v6, _ = announced_targets(ann(backups=(("amqp://[::1]:7003", "", True),)))
    assert v6[1].name == "n1@[::1]:7003" and v6[1].host == "::1"


def test_an_unusable_backup_is_left_out_and_said():
    targets, why = announced_targets(ann(backups=(("amqp://nohost", "", True), B1,
                                                  ("amqp://127.0.0.1:5001", "", True),   # the node's own address
                                                  ("amqp://127.0.0.1:7001", "", False))))  # B1's again
    assert [t.name for t in targets] == ["n1", "n1@127.0.0.1:7001"]
    assert "n1 backup 0" in why and "host:port" in why
    assert "n1 backup 2: 127.0.0.1:5001 is announced twice" in why and "n1 backup 3" in why
    # the node's own connector unusable: nothing joins, backups neither
    targets, why = announced_targets(Announcement("n2", "c1", "", ("amqp://h",), 1, (B1,)))
    assert targets == () and why.startswith("n2: ")


def names(change):
    return ([t.name for t in change.added], list(change.removed), [(t.name, t.backup) for t in change.updated])


def test_a_changed_announcement_gives_the_node_id_exactly_its_new_slots():
    m = DiscoveryMembership()
    change, why = m.observe("added", ann(backups=(B1, B2)))
    assert why is None and names(change) == (["n1", "n1@127.0.0.1:7001", "n1@10.0.0.2:7002"], [], [])
    assert m.slots() == {"n1": ["n1", "n1@127.0.0.1:7001", "n1@10.0.0.2:7002"]}
    # only in-sync flags changed (the group says "changed"): nothing to do, the slots keep their state
    assert not m.observe("changed", ann(seq=2, backups=(B1[:2] + (False,), B2[:2] + (True,))))[0]
    # B2 lost, B1's probe URL changed, a third backup joined
    b1 = ("amqp://127.0.0.1:7001", "http://127.0.0.1:8009", True)
    b3 = ("amqp://127.0.0.1:7003", "", False)
    change, _ = m.observe("changed", ann(seq=3, backups=(b1, b3)))
    assert names(change) == (["n1@127.0.0.1:7001", "n1@127.0.0.1:7003"],
                             ["n1@10.0.0.2:7002", "n1@127.0.0.1:7001"], [])
    assert change.added[0].management_url == "http://127.0.0.1:8009"
    # the node itself moved: its slot leaves and joins again, its backups stay
    change, _ = m.observe("changed", ann(port=5009, seq=4, backups=(b1, b3)))
    assert names(change) == (["n1"], ["n1"], []) and change.added[0].port == 5009
    # expired: every slot of the node id leaves
    change, _ = m.observe("removed", ann(port=5009, seq=4, backups=(b1, b3)))
    assert names(change) == ([], ["n1", "n1@127.0.0.1:7001", "n1@127.0.0.1:7003"], []) and m.known == {}


def test_the_backup_that_took_over_keeps_its_slot():
    m = DiscoveryMembership()
    m.observe("added", ann(backups=(B1,)))
    # the primary is dead; its backup serves n1 and announces it, from its own address, no backup
    change, why = m.observe("changed", Announcement("n1", "c1", "http://127.0.0.1:8001", ("amqp://127.0.0.1:7001",),
                                                    9))
    # the dead primary's slot is held (not removed) while the backup's is probed: the pair stays
    # a pair, failing over, instead of one unready member whose keys would be re-placed
    assert why is None and names(change) == ([], [], [("n1@127.0.0.1:7001", False)])
    assert m.known["n1"] == (Target("n1", "127.0.0.1", 7001, False, "http://127.0.0.1:8001",
                                    "n1@127.0.0.1:7001", "n1", False),)
    assert m.held == {"n1": ("n1", 0.0)} and m.slots() == {"n1": ["n1@127.0.0.1:7001", "n1"]}
    assert m.expire(PAIR_HOLD_S - 0.1) == MembershipChange()
    assert m.expire(PAIR_HOLD_S) == MembershipChange(removed=("n1",)) and m.held == {}
    # the old primary comes back as its backup: a new member, named by its address
    change, _ = m.observe("changed", Announcement("n1", "c1", "http://127.0.0.1:8001", ("amqp://127.0.0.1:7001",),
                                                  10, (("amqp://127.0.0.1:5001", "http://127.0.0.1:6001", False),)))
    assert names(change) == (["n1@127.0.0.1:5001"], [], []) and change.added[0].backup
    # an announcement that became unusable: all its slots leave, and why
    change, why = m.observe("changed", Announcement("n1", "c1", "", ("amqp://h",), 11, (B1,)))
    assert names(change) == ([], ["n1@127.0.0.1:7001", "n1@127.0.0.1:5001"], []) and why
    assert m.known == {}


def test_discovery_change_with_the_slots_known():
    known, _ = announced_targets(ann(backups=(B1,)))
    assert discovery_change("removed", ann(), known) == (MembershipChange(removed=("n1", "n1@127.0.0.1:7001")), None)
    change, _ = discovery_change("changed", ann(seq=2), known)   # the backup was lost
    assert names(change) == ([], ["n1@127.0.0.1:7001"], [])


def _source_and_pool():
    """A discovery source over a real Pool, and ``hear(announcement, now)``: the packet through the
    group's table into the pool (True if the pool changed)."""
    src = DiscoverySource([], {**GROUP, "refresh-timeout-ms": 1000, "cluster": "c1"})
    pool = Pool()

    def hear(a, now):
        ev = src.group.receive(encode_announcement(a), now)
        return src.apply(pool, *ev) if ev is not None and ev[0] != "refreshed" else False

    return src, pool, hear


def test_the_source_forms_pairs_from_announced_backups():
    src, pool, hear = _source_and_pool()

    def members():
        return [(st.target.name, st.target.pair, st.target.backup, st.ready) for st in pool.members]

    assert hear(ann(backups=(B1[:2] + (False,),)), 0.0)
    assert members() == [("n1", "n1", False, False), ("n1@127.0.0.1:7001", "n1", True, False)]
    assert pool.total_count == 1 and pool.pairs()[0]["backups"] == ["n1@127.0.0.1:7001"]
    pool.report_probe("n1", True, "n1", 0, 0.1)
    pool.report_probe("n1@127.0.0.1:7001", False, "n1", None, 0.1, error="passive backup")
    assert pool.pairs()[0]["serving"] == "n1"
    assert not hear(ann(seq=2, backups=(B1,)), 0.2)            # in sync now: the pool is unchanged
    assert src.status()["backups"] == {"n1": [{"connector": B1[0], "management_url": B1[1], "in_sync": True}]}
    assert src.status()["slots"] == {"n1": ["n1", "n1@127.0.0.1:7001"]}
    # failover: the backup is active and announces n1 from its own address; it keeps its state
    pool.report_probe("n1", False, None, None, 0.3, error="refused")
    pool.report_probe("n1@127.0.0.1:7001", True, "n1", 0, 0.3)
    assert hear(Announcement("n1", "c1", "http://127.0.0.1:8001", (B1[0],), 3), 0.4)
    assert members() == [("n1", "n1", False, False), ("n1@127.0.0.1:7001", "n1", False, True)]  # n1 held
    assert pool.ready_target("n1").port == 7001
    # expiry takes every slot of the node id
    hear(ann(seq=4, backups=(B1,)), 0.5)
    assert [m[0] for m in members()] == ["n1@127.0.0.1:7001", "n1"]
    for e in src.group.expire(2.0):
        src.apply(pool, "removed", e)
    assert pool.members == [] and src.status()["slots"] == {} and src.status()["left"] == 2


def test_the_source_applies_what_the_group_hears():
    src = DiscoverySource([], {**GROUP, "refresh-timeout-ms": 1000, "cluster": "c1", "key": "k"})
    pool = Pool()

    def hear(a, now, key="k"):
        ev = src.group.receive(encode_announcement(a, key), now)
        return src.apply(pool, *ev) if ev is not None and ev[0] != "refreshed" else False

    def members():
        return [(st.target.name, st.target.port, st.ready) for st in pool.members]

    assert hear(ann("n1", 5001), 0.0) and hear(ann("n2", 5002), 0.1)
    assert members() == [("n1", 5001, False), ("n2", 5002, False)]  # joined not ready
    pool.report_probe("n1", True, "n1", 0, 0.2)
    assert pool.ready_target("n1") is not None
    assert not hear(ann("n1", 5001, seq=2), 0.5)            # a refresh changes nothing
    assert not hear(ann("n3", 5003), 0.5, key=None)         # unsigned: dropped by the group
    assert not hear(ann("n3", 5003, cluster="c2"), 0.5)     # another cluster
    assert not hear(ann("n3", 5003, seq=0), 0.5, key="x")   # forged
    assert hear(ann("n2", 5012, seq=2), 0.6)                # moved: replaced
    assert members() == [("n1", 5001, True), ("n2", 5012, False)]
    # n1 refreshed at 0.5 and n2 at 0.6: n1 expires first (refresh timeout 1 s)
    for e in src.group.expire(1.55):
        src.apply(pool, "removed", e)
    assert members() == [("n2", 5012, False)]
    st = src.status()
    assert st["members"] == ["n2"] and st["joined"] == 3 and st["left"] == 1 and st["signed_only"]
    assert st["counters"]["garbage"] == 2 and st["counters"]["other_cluster"] == 1
    # an announcement whose connector cannot be a target is shown, not joined
    assert not hear(Announcement("n4", "c1", "", ("amqp://h",), 1), 1.6)
    assert "n4" in src.status()["unusable"] and [m[0] for m in members()] == ["n2"]


def test_follow_reports_a_group_it_cannot_join_and_keeps_retrying():
    # 192.0.2.1 (TEST-NET-1) is no address of this host: joining the group there fails
    src = DiscoverySource([], {**GROUP, "local-bind-address": "192.0.2.1",
                               "initial-wait-timeout-ms": 60_000})
    pool = Pool()

    async def main():
        with trio.fail_after(10):  # started at the failure, not after the initial wait
            async with trio.open_nursery() as nursery:
                await nursery.start(src.follow, pool, FollowContext(50))
                assert src.status()["last_error"]
                nursery.cancel_scope.cancel()

    trio.run(main)
    assert pool.members == []


# -- options and config ----------------------------------------------------------------------------
def test_options_defaults_and_strings():
    assert check_options({**GROUP}) == {**GROUP, "local-bind-address": "0.0.0.0", "refresh-timeout-ms": 10000,
                                        "initial-wait-timeout-ms": 10000, "cluster": None, "key": None}
    assert check_options({"group-address": "231.7.7.7", "group-port": "9876",
                          "refresh-timeout-ms": "500"})["refresh-timeout-ms"] == 500
    with pytest.raises(MembershipSourceError):
        DiscoverySource([Target("a", "h", 1)], dict(GROUP))
    with pytest.raises(MembershipSourceError) as ei:
        DiscoverySource([], {**GROUP, "jgroups-file": "x"})
    assert ei.value.key == "jgroups-file"


BASE = '[routers.main]\nkey-type = "CLIENT_ID"\n[routers.main.policy]\nname = "FIRST_ELEMENT"\n' \
       '[routers.main.pool]\nsource = "discovery"\n'
DG = '[routers.main.pool.discovery-group]\ngroup-address = "231.7.7.7"\ngroup-port = 9876\n'


def load(tmp_path, text):
    p = tmp_path / "router.toml"
    p.write_text(text)
    return load_router_config(p)


def test_discovery_pool_config(tmp_path):
    cfg = load(tmp_path, BASE + 'username = "admin"\npassword = "pw"\n' + DG +
               'local-bind-address = "127.0.0.1"\nrefresh-timeout-ms = 3000\ninitial-wait-timeout-ms = 0\n'
               'cluster = "prod"\nkey = "s3cret"\n')
    pc = cfg.routers["main"].pool
    assert pc.source == "discovery" and pc.targets == ()
    assert pc.source_options == {"group-address": "231.7.7.7", "group-port": 9876,
                                 "local-bind-address": "127.0.0.1", "refresh-timeout-ms": 3000,
                                 "initial-wait-timeout-ms": 0, "cluster": "prod", "key": "s3cret"}
    svc = RouterService(cfg.routers["main"])
    assert svc.dynamic_membership and svc.pool.members == []
    st = svc.membership_status()
    assert st["source"] == "discovery" and st["cluster"] == "prod" and st["signed_only"]
    assert "s3cret" not in repr(st)  # the key is never shown
    assert st["members"] == [] and st["last_error"] is None


P = "routers.main.pool.discovery-group."


@pytest.mark.parametrize("extra, path, msg", [
    ("", "routers.main.pool.discovery-group", "missing (required table)"),
    ('[routers.main.pool.discovery-group]\ngroup-port = 9876\n', P + "group-address", "missing"),
    ('[routers.main.pool.discovery-group]\ngroup-address = "231.7.7.7"\n', P + "group-port", "missing"),
    (DG.replace("231.7.7.7", "10.0.0.1"), P + "group-address", "not a multicast address"),
    (DG.replace("231.7.7.7", "nope"), P + "group-address", "not an IPv4 address"),
    (DG.replace("9876", "70000"), P + "group-port", "70000 must be > 0 and <= 65535"),
    (DG.replace("9876", '"x"'), P + "group-port", "must be"),
    (DG + 'local-bind-address = "::1"\n', P + "local-bind-address", "not an IPv4 address"),
    (DG + "refresh-timeout-ms = 0\n", P + "refresh-timeout-ms", "0 must be > 0"),
    (DG + "initial-wait-timeout-ms = -1\n", P + "initial-wait-timeout-ms", "must be >= 0"),
    (DG + 'cluster = ""\n', P + "cluster", "non-empty"),
    (DG + "broadcast-period-ms = 5\n", P + "broadcast-period-ms", "unknown key"),
    ('[[routers.main.pool.targets]]\nhost = "h"\nport = 1\n' + DG, "routers.main.pool.targets",
     "takes its targets from the brokers' announcements"),
])
def test_discovery_pool_config_errors(tmp_path, extra, path, msg):
    with pytest.raises(ConfigError) as ei:
        load(tmp_path, BASE + extra)
    assert ei.value.path == path and msg in ei.value.message, str(ei.value)


def test_a_discovery_group_table_needs_source_discovery(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load(tmp_path, BASE.replace('source = "discovery"\n', '[[routers.main.pool.targets]]\nhost = "h"\n'
                                                               'port = 1\n') + DG)
    assert ei.value.path == "routers.main.pool.discovery-group" and "unknown key" in ei.value.message


def test_a_takeover_keeps_the_pair_failing_over_until_the_new_member_is_ready():
    # the backup announces the node id before its probe says active: the pair must not shrink to
    # one unready member (its cached keys would be re-placed), it stays failing over
    _src, pool, hear = _source_and_pool()
    hear(ann(backups=(B1,)), 0.0)
    pool.report_probe("n1", True, "n1", 0, 0.1)
    pool.report_probe("n1@127.0.0.1:7001", False, "n1", None, 0.1, error="passive backup")
    pool.report_probe("n1", False, None, None, 0.2, error="refused")          # the primary dies
    hear(Announcement("n1", "c1", "http://127.0.0.1:8001", (B1[0],), 3), 0.3)  # its backup took over
    assert pool.failing_over("n1") is not None and len(pool.pairs()[0]["members"]) == 2
    pool.report_probe("n1@127.0.0.1:7001", True, "n1", 0, 0.4)                 # probed: active
    assert pool.failing_over("n1") is None and pool.ready_target("n1").port == 7001
