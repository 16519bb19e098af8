"""The cluster pool's pure parts: a broker's ``GET /api/v1/cluster`` → targets
(``router.core.membership``), the join/leave rule, the order nodes are asked in, a worker
following its supervisor's membership (``Pool.sync_members``), and the pool's config keys."""

from __future__ import annotations

import pytest

from broker.wire.io.tomlconfig import ConfigError
from router.config import load_router_config
from router.core.membership import ClusterMembership, ViewMember, parse_cluster_view, parse_connector
from router.core.policies.base import Target
from router.core.pool import Pool
from router.errors import ClusterViewError, MembershipSourceError
from router.service import RouterService


def view(node_id="A", connector="amqp://127.0.0.1:5001", members=()):
    return {"name": "c", "node_id": node_id, "connector": connector, "members": list(members),
            "bridges": []}


def member(node_id, port, connected=True, mgmt=None, scheme="amqp"):
    return {"node_id": node_id, "connector": f"{scheme}://127.0.0.1:{port}",
            "management_url": mgmt if mgmt is not None else f"http://127.0.0.1:{port + 1000}",
            "connected": connected, "since": 1.0 if connected else None}


def vm(node_id, port, alive=True, mgmt=None):
    return ViewMember(node_id, "127.0.0.1", port, False,
                      mgmt if mgmt is not None else f"http://127.0.0.1:{port + 1000}", alive)


# -- parsing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("url, expect", [
    ("amqp://127.0.0.1:5672", ("127.0.0.1", 5672, False)),
    ("amqps://broker.example:5671", ("broker.example", 5671, True)),
    ("tcp://10.0.0.1:61616", ("10.0.0.1", 61616, False)),
    ("amqp://[::1]:5672", ("::1", 5672, False)),
])
def test_connectors_give_host_port_and_tls(url, expect):
    assert parse_connector(url) == expect


@pytest.mark.parametrize("url", ["http://h:1", "amqp://h", "amqp://:5672", None, 5672])
def test_bad_connectors_are_refused(url):
    with pytest.raises(ValueError):
        parse_connector(url)


def test_a_view_is_the_answering_node_then_its_members():
    body = view(members=[member("B", 5002), member("C", 5003, connected=False, scheme="amqps")])
    out = parse_cluster_view(body, "http://127.0.0.1:6001/")
    assert out == [ViewMember("A", "127.0.0.1", 5001, False, "http://127.0.0.1:6001", True),
                   ViewMember("B", "127.0.0.1", 5002, False, "http://127.0.0.1:6002", True),
                   ViewMember("C", "127.0.0.1", 5003, True, "http://127.0.0.1:6003", False)]
    t = out[1].to_target()
    assert (t.name, t.node_id, t.identity, t.slot) == ("B", "B", "B", "B")


def test_bad_members_are_skipped_the_rest_count():
    body = view(members=[member("B", 5002), "junk", {"node_id": "X", "connector": "nope"},
                         {"connector": "amqp://h:1"}, member("A", 5009), member("B", 5010),
                         member("C", 5003, mgmt="")])
    out = parse_cluster_view(body, "http://127.0.0.1:6001")
    assert [(m.node_id, m.port, m.management_url) for m in out] == [
        ("A", 5001, "http://127.0.0.1:6001"), ("B", 5002, "http://127.0.0.1:6002"), ("C", 5003, None)]


@pytest.mark.parametrize("body", [[], "x", {"connector": "amqp://h:1", "members": []},
                                  view(connector="http://h:1"), {**view(), "members": None}])
def test_what_is_not_a_cluster_view_is_a_remote_error(body):
    with pytest.raises(ClusterViewError):
        parse_cluster_view(body, "http://h:1")


# -- joining and leaving --------------------------------------------------------------------------
def test_nodes_join_when_first_seen_and_leave_after_no_alive_view_for_leave_after():
    m = ClusterMembership(leave_after_s=10)
    ch = m.observe([vm("A", 5001), vm("B", 5002), vm("C", 5003, alive=False)], now=0)
    assert [t.name for t in ch.added] == ["A", "B", "C"] and ch.removed == ()
    assert not m.observe([vm("A", 5001), vm("B", 5002), vm("C", 5003, alive=False)], now=5)
    # B disconnected (killed): listed, not alive; C never came up
    assert not m.observe([vm("A", 5001), vm("B", 5002, alive=False), vm("C", 5003, alive=False)], now=9)
    ch = m.observe([vm("A", 5001), vm("B", 5002, alive=False)], now=10.5)
    assert ch.added == () and ch.removed == ("C",)            # 10.5 s without an alive view
    ch = m.observe([vm("A", 5001), vm("B", 5002, alive=False)], now=15.5)
    assert ch.removed == ("B",) and set(m.known) == {"A"}     # B's last alive view: t = 5
    # it comes back: it joins again
    ch = m.observe([vm("A", 5001), vm("B", 5002)], now=20)
    assert [t.name for t in ch.added] == ["B"] and ch.removed == ()


def test_a_node_that_left_stays_out_while_the_views_list_it_down():
    # a broker's view lists a killed member (connected = false) for ever: once it left, that
    # listing must not make it join again as if first seen (and leave again, every leave-after)
    m = ClusterMembership(leave_after_s=10)
    m.observe([vm("A", 5001), vm("B", 5002)], now=0)
    ch = m.observe([vm("A", 5001), vm("B", 5002, alive=False)], now=10.5)
    assert ch.removed == ("B",) and set(m.known) == {"A"}
    for now in (10.7, 11, 25, 40):
        assert not m.observe([vm("A", 5001), vm("B", 5002, alive=False)], now=now), now
        assert set(m.known) == {"A"}
    # alive again (restarted): it joins
    ch = m.observe([vm("A", 5001), vm("B", 5002)], now=41)
    assert [t.name for t in ch.added] == ["B"] and ch.removed == ()
    # a left node no view lists any more is forgotten after leave-after: listed again, it is new
    m.observe([vm("A", 5001), vm("B", 5002, alive=False)], now=52)
    assert set(m.known) == {"A"} and m.left
    m.observe([vm("A", 5001)], now=63)
    assert not m.left
    ch = m.observe([vm("A", 5001), vm("B", 5002, alive=False)], now=64)
    assert [t.name for t in ch.added] == ["B"]


def test_a_node_missing_from_the_views_leaves_too_and_no_view_changes_nothing():
    m = ClusterMembership(leave_after_s=1)
    m.observe([vm("A", 5001), vm("B", 5002)], now=0)
    assert not m.observe([vm("A", 5001)], now=0.5)
    # no node answered for a long time: observe is not called, membership stays
    ch = m.observe([vm("A", 5001)], now=100)
    assert ch.removed == ("B",) and set(m.known) == {"A"}


def test_one_view_alive_keeps_a_node_whatever_the_others_say():
    m = ClusterMembership(leave_after_s=1)
    m.observe([vm("A", 5001), vm("B", 5002)], now=0)
    m.observe([vm("B", 5002, mgmt="http://127.0.0.1:6002"), vm("A", 5001, alive=False)], now=0.9)
    assert not m.observe([vm("A", 5001), vm("B", 5002, alive=False)], now=1.5)  # A answered
    assert set(m.known) == {"A", "B"}


def test_a_new_probe_url_replaces_a_member_only_on_an_alive_report():
    m = ClusterMembership(leave_after_s=10)
    m.observe([vm("A", 5001), vm("B", 5002)], now=0)
    # a stale view of a disconnected B with another management URL does not change it
    assert not m.observe([vm("A", 5001), vm("B", 5002, alive=False, mgmt="http://x:1")], now=1)
    ch = m.observe([vm("A", 5001), vm("B", 5002, mgmt="http://x:1")], now=2)
    assert ch.removed == ("B",) and [(t.name, t.management_url) for t in ch.added] == [
        ("B", "http://x:1")]
    # a member listed without a management URL keeps the one it had
    assert not m.observe([vm("A", 5001), ViewMember("B", "127.0.0.1", 5002, False, None, True)],
                         now=3)
    assert m.targets()[1].management_url == "http://x:1"


def test_a_node_id_at_a_new_connector_is_a_new_member_of_its_pair_the_old_one_leaves():
    # restarted elsewhere (or a backup): the two do not replace each other; the pool pairs
    # them (one node id, hashed once) and the old address leaves after leave-after
    m = ClusterMembership(leave_after_s=10)
    m.observe([vm("A", 5001), vm("B", 5002)], now=0)
    ch = m.observe([vm("A", 5001), vm("B", 7002)], now=2)
    assert ch.removed == () and [(t.name, t.port, t.pair) for t in ch.added] == [
        ("B@127.0.0.1:7002", 7002, "B")]
    assert sorted(m.known) == ["A", "B", "B@127.0.0.1:7002"]
    ch = m.observe([vm("A", 5001), vm("B", 7002)], now=10.5)
    assert ch.removed == ("B",) and sorted(m.known) == ["A", "B@127.0.0.1:7002"]
    # the node id's name is free again: a member joining later takes it
    ch = m.observe([vm("A", 5001), vm("B", 7002), vm("B", 9002)], now=11)
    assert [t.name for t in ch.added] == ["B"]


def test_nodes_are_asked_last_answer_first_then_known_then_seeds():
    m = ClusterMembership(leave_after_s=10)
    assert m.candidates(["http://seed:1/", "http://seed:2"]) == ["http://seed:1", "http://seed:2"]
    m.observe([vm("A", 5001), vm("B", 5002), vm("C", 5003, mgmt="")], now=0)
    m.answered("http://127.0.0.1:6002/")
    assert m.candidates(["http://seed:1", "http://127.0.0.1:6001"]) == [
        "http://127.0.0.1:6002", "http://127.0.0.1:6001", "http://seed:1"]


# -- a worker follows the supervisor's members --------------------------------------------------
def t(name, port, mgmt=None):
    return Target(name, "127.0.0.1", port, False, mgmt, name)


def names(pool):
    return [st.target.name for st in pool.members]


def test_sync_members_keeps_state_of_unchanged_members_and_the_order():
    pool = Pool([t("A", 1), t("B", 2), t("C", 3)])
    for n in "ABC":
        pool.set_ready(n, True)
    v = pool.version
    assert pool.sync_members([t("A", 1), t("C", 3), t("D", 4)])
    assert names(pool) == ["A", "C", "D"] and [st.ready for st in pool.members] == [True, True, False]
    assert pool.version > v
    v = pool.version
    assert not pool.sync_members([t("A", 1), t("C", 3), t("D", 4)]) and pool.version == v
    # moved (new port) and reordered: rebuilt in the wanted order, moved one not ready
    assert pool.sync_members([t("D", 4), t("A", 9), t("C", 3)])
    assert names(pool) == ["D", "A", "C"] and pool.members[1].target.port == 9
    assert pool.ready_target("A") is None
    assert pool.sync_members([]) and names(pool) == []


def test_sync_members_never_removes_the_local_target():
    pool = Pool([t("A", 1)], local_target=t("local", 9), local_target_enabled=True)
    pool.sync_members([t("B", 2)])
    assert names(pool) == ["local", "B"] and pool.members[0].local


# -- config and the service -----------------------------------------------------------------------
BASE = '[routers.main]\nkey-type = "CLIENT_ID"\n[routers.main.policy]\nname = "FIRST_ELEMENT"\n' \
       '[routers.main.pool]\nsource = "cluster"\n'


def load(tmp_path, text):
    p = tmp_path / "router.toml"
    p.write_text(text)
    return load_router_config(p)


def test_cluster_pool_config(tmp_path):
    cfg = load(tmp_path, BASE + 'seed-connectors = ["http://127.0.0.1:8161", "https://b:8443/"]\n'
                                'username = "admin"\npassword = "pw"\n')
    pc = cfg.routers["main"].pool
    assert pc.source == "cluster" and pc.targets == ()
    assert pc.source_options == {"seed-connectors": ("http://127.0.0.1:8161", "https://b:8443/"),
                                 "leave-after-ms": 30000}
    svc = RouterService(cfg.routers["main"])
    assert svc.dynamic_membership and svc.pool.members == []
    st = svc.membership_status()
    assert st["seed_connectors"] == ["http://127.0.0.1:8161", "https://b:8443"]
    assert st["members"] == [] and st["leave_after_ms"] == 30000
    assert svc.pool_states() == {"members": [], "root": None, "states": [], "held": {}, "draining": {}}
    # a worker adopts the supervisor's members, then the probe results
    svc.apply_pool_states({"members": [["n1", "127.0.0.1", 5001, False, "http://127.0.0.1:6001", "n1",
                                        "n1", False]],
                           "states": [["n1", True, "n1", 0, None]]})
    assert svc.route_for_key("k").target.name == "n1"


@pytest.mark.parametrize("extra, path, msg", [
    ("", "routers.main.pool.seed-connectors", "needs at least one broker management URL"),
    ("seed-connectors = []\n", "routers.main.pool.seed-connectors", "needs at least one"),
    ('seed-connectors = ["amqp://h:5672"]\n', "routers.main.pool.seed-connectors[0]",
     "must be an http:// or https:// management URL"),
    ('seed-connectors = ["http://h:1"]\nleave-after-ms = -1\n', "routers.main.pool.leave-after-ms", ""),
    ('seed-connectors = ["http://h:1"]\nseeds = 1\n', "routers.main.pool.seeds", ""),
    ('seed-connectors = ["http://h:1"]\n[[routers.main.pool.targets]]\nhost = "h"\nport = 1\n',
     "routers.main.pool.targets", "takes its targets from the cluster"),
])
def test_cluster_pool_config_errors(tmp_path, extra, path, msg):
    with pytest.raises(ConfigError) as ei:
        load(tmp_path, BASE + extra)
    assert ei.value.path == path and msg in ei.value.message, str(ei.value)


def test_the_source_refuses_bad_options():
    from router.cluster_source import ClusterSource

    with pytest.raises(MembershipSourceError):
        ClusterSource([], {})
    with pytest.raises(MembershipSourceError):
        ClusterSource([t("A", 1)], {"seed-connectors": ["http://h:1"]})
    with pytest.raises(MembershipSourceError):
        ClusterSource([], {"seed-connectors": ["http://h:1"], "bogus": 1})


def test_a_target_inserted_in_the_middle_leaves_the_others_their_state():
    """A reload that adds a backup right after its primary (a static pool's targets are synced
    with ``sync_members``): the members after it keep their readiness, nothing is re-probed."""
    targets = [Target(f"n{i}", "h", 5670 + i, name=f"b{i}") for i in range(4)]
    pool = Pool(targets)
    for i in range(4):
        pool.set_ready(f"b{i}", True)
    assert pool.sync_members([targets[0], Target(None, "h", 6000, name="b0-backup"), *targets[1:]])
    assert [(st.target.name, st.ready) for st in pool.members] == \
        [("b0", True), ("b0-backup", False), ("b1", True), ("b2", True), ("b3", True)]
    assert pool.sync_members([targets[3], *targets[:3]])          # moved: still ready
    assert [(st.target.name, st.ready) for st in pool.members] == \
        [("b3", True), ("b0", True), ("b1", True), ("b2", True)]
