"""The discovery pool's parts (``source = "discovery"``): an announcement → a target
(``router.core.membership``), a discovery group's table changes → pool joins and leaves
(``router.discovery_source``, fed real packets through the broker's own ``DiscoveryGroup``), the
``[...pool.discovery-group]`` config keys and their errors. The multicast itself is tested with
real brokers and a real router in tests/integration/test_router_discovery_pool.py."""

from __future__ import annotations

import pytest
import trio

from broker.cluster.discovery import Announcement, encode_announcement
from broker.tomlconfig import ConfigError
from router.config import load_router_config
from router.core.membership import MembershipChange, announced_target, discovery_change
from router.core.policies.base import Target
from router.core.pool import FollowContext, Pool
from router.discovery_source import DiscoverySource, check_options
from router.errors import MembershipSourceError
from router.service import RouterService

GROUP = {"group-address": "231.7.7.7", "group-port": 9876}


def ann(node_id="n1", port=5001, *, mgmt="http://127.0.0.1:6001/", scheme="amqp", cluster="c1", seq=1,
        more=()):
    return Announcement(node_id, cluster, mgmt, (f"{scheme}://127.0.0.1:{port}", *more), seq)


# -- announcement → target ------------------------------------------------------------------------
def test_an_announcement_names_its_target():
    t = announced_target(ann(more=("amqp://10.0.0.9:7000",)))
    assert t == Target("n1", "127.0.0.1", 5001, False, "http://127.0.0.1:6001", "n1")
    assert t.slot == t.identity == "n1"  # named by the node id: caches and hashes hold node ids
    tls = announced_target(ann(scheme="amqps", mgmt=""))
    assert (tls.tls, tls.management_url) == (True, None)  # no management URL: TCP probe


def test_table_changes_become_pool_changes():
    a = ann()
    assert discovery_change("added", a) == (MembershipChange((announced_target(a),)), None)
    moved = ann(port=5009, seq=2)
    assert discovery_change("changed", moved) == (
        MembershipChange((announced_target(moved),), ("n1",)), None)
    assert discovery_change("removed", a) == (MembershipChange(removed=("n1",)), None)
    # a connector without a port: no target, and the reason
    bad = Announcement("n2", "c1", "", ("amqp://h",), 1)
    change, why = discovery_change("added", bad)
    assert not change and "n2" in why and "host:port" in why
    change, why = discovery_change("changed", bad)  # it moved somewhere unusable: it leaves
    assert change == MembershipChange(removed=("n2",)) and why
    with pytest.raises(ValueError):
        discovery_change("refreshed", a)


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
