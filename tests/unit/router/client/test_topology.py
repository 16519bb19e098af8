"""Pure rules of the topology-aware client (router/client/topology.py) and the broker's member
list (ClusterNode.client_topology): URL lists, the Open property, the four policies (seeded)."""

from __future__ import annotations

import collections
import random
from types import SimpleNamespace

import pytest
from proton import symbol

from broker.wire.frames import CLUSTER_MEMBERS, MAX_CLUSTER_MEMBERS
from broker.cluster.bridge import ClusterNode, _Member
from router.client.topology import (FirstElement, Member, Random, RandomSticky, RoundRobin, Topology, UrlListError,
                                    make_policy, members_from_properties, parse_urls, redacted, with_userinfo)


# -- starting URLs ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec, urls", [
    ("amqp://a:1", ["amqp://a:1"]),
    ("  amqps://a:5671 ", ["amqps://a:5671"]),
    ("(amqp://a:1,amqp://b:2)", ["amqp://a:1", "amqp://b:2"]),
    ("( amqp://a:1 , amqps://b:2 )", ["amqp://a:1", "amqps://b:2"]),
    ("(amqp://a:1)", ["amqp://a:1"]),
    ("(amqp://a:1,amqp://a:1,amqp://b)", ["amqp://a:1", "amqp://b"]),   # duplicates once; default port
    ("amqp://u:p@a:1", ["amqp://u:p@a:1"]),
    ("amqp://[::1]:5672", ["amqp://[::1]:5672"]),
    (["amqp://a:1", "amqp://b:2"], ["amqp://a:1", "amqp://b:2"]),
    (("amqp://a:1",), ["amqp://a:1"]),
])
def test_parse_urls(spec, urls):
    assert parse_urls(spec) == urls


@pytest.mark.parametrize("spec", [
    "", "()", "(amqp://a:1,)", "(,amqp://a:1)", "(amqp://a:1", "(amqp://a:1,amqp://b:2)?x=1",
    "amqp://a:1,amqp://b:2",            # a list needs its parentheses (Artemis)
    "tcp://a:1", "http://a:1", "a:1", "amqp://", "amqp://a:port", "amqp://a:1/path", "amqp://a:1?q=1",
    [], [""], ["amqp://a:1", 5],
])
def test_parse_urls_rejects(spec):
    with pytest.raises(UrlListError):
        parse_urls(spec)


# -- the Open property ---------------------------------------------------------------------------

def props(entries):
    return {symbol("product"): "lodestone", symbol(CLUSTER_MEMBERS): entries}


def test_members_from_properties_in_node_id_order():
    got = members_from_properties(props([{"node-id": "c", "connector": "amqp://h:3"},
                                         {"node-id": "a", "connector": "amqp://h:1"},
                                         {"node-id": "b", "connector": "amqps://h:2"}]))
    assert got == [Member("amqp://h:1", "a"), Member("amqps://h:2", "b"), Member("amqp://h:3", "c")]


@pytest.mark.parametrize("properties", [None, {}, {symbol("node-id"): "x"}, props("amqp://h:1"), props(7),
                                        {CLUSTER_MEMBERS: None}])
def test_members_absent(properties):
    assert members_from_properties(properties) is None


def test_members_skips_bad_entries_and_duplicates():
    got = members_from_properties(props([
        "amqp://h:9",                                   # not a map
        {"node-id": "a"},                               # no connector
        {"node-id": "b", "connector": "tcp://h:2"},     # not AMQP
        {"node-id": "c", "connector": "amqp://h:3/x"},  # a path
        {"node-id": "d", "connector": 42},
        {"node-id": "e", "connector": b"amqp://h:5"},   # binary: decoded
        {"node-id": "e", "connector": "amqp://h:6"},    # the same node again: the first one counts
        {"connector": "amqp://h:7"},                    # no node id: keyed by URL
    ]))
    assert got == [Member("amqp://h:7", None), Member("amqp://h:5", "e")]


def test_members_bounded():
    many = [{"node-id": f"n{i:04d}", "connector": f"amqp://h:{1000 + i}"} for i in range(MAX_CLUSTER_MEMBERS + 50)]
    assert len(members_from_properties(props(many))) == MAX_CLUSTER_MEMBERS


def test_credentials_of_the_starting_url():
    assert with_userinfo("amqp://h:2", "amqp://u:p@a:1") == "amqp://u:p@h:2"
    assert with_userinfo("amqp://x:y@h:2", "amqp://u:p@a:1") == "amqp://x:y@h:2"
    assert with_userinfo("amqp://h:2", "amqp://a:1") == "amqp://h:2"
    assert redacted("amqp://u:p@h:2") == "amqp://u:***@h:2"
    assert redacted("amqp://h:2") == "amqp://h:2"


# -- policies (seeded) --------------------------------------------------------------------------

def test_round_robin_random_start_then_next():
    rng = random.Random(7)
    first = random.Random(7).randrange(5)
    p = RoundRobin(rng)
    assert [p.select(5) for _ in range(7)] == [(first + i) % 5 for i in range(7)]
    # exactly even over whole rounds, whatever the start
    for seed in range(20):
        p = RoundRobin(random.Random(seed))
        assert collections.Counter(p.select(3) for _ in range(30)) == {0: 10, 1: 10, 2: 10}


def test_round_robin_list_shrinks_and_grows():
    p = RoundRobin(random.Random(1))
    p.pos = 4
    assert p.select(3) == 2      # (4 + 1) % 3
    assert p.select(4) == 3


def test_random_is_the_seeded_sequence():
    expected = random.Random(3)
    p = Random(random.Random(3))
    assert [p.select(4) for _ in range(50)] == [expected.randrange(4) for _ in range(50)]
    p = Random(random.Random(0))
    assert {p.select(4) for _ in range(200)} == {0, 1, 2, 3}


def test_random_sticky():
    p = RandomSticky(random.Random(5))
    pick = p.select(4)
    assert pick == random.Random(5).randrange(4)
    assert {p.select(4) for _ in range(20)} == {pick}
    assert {p.select(9) for _ in range(5)} == {pick}      # more members: still the same one
    p.pos = 3
    assert p.select(2) in (0, 1)                          # the list got shorter than the pick: draw again


def test_first_element():
    p = FirstElement()
    assert [p.select(n) for n in (1, 3, 5)] == [0, 0, 0]


def test_policy_names():
    rng = random.Random(0)
    for name, cls in [("round-robin", RoundRobin), ("random", Random), ("random-sticky", RandomSticky),
                      ("first-element", FirstElement),
                      ("org.apache.activemq.artemis.api.core.client.loadbalance.RoundRobinConnectionLoadBalancingPolicy",
                       RoundRobin),
                      ("FirstElementConnectionLoadBalancingPolicy", FirstElement)]:
        assert isinstance(make_policy(name, rng), cls)
    with pytest.raises(ValueError, match="unknown connection load-balancing policy"):
        make_policy("least-loaded", rng)


# -- Topology ------------------------------------------------------------------------------------

THREE = props([{"node-id": "b", "connector": "amqp://h:2"}, {"node-id": "a", "connector": "amqp://h:1"},
               {"node-id": "c", "connector": "amqp://h:3"}])


def test_topology_starts_from_the_urls_then_balances_over_the_members():
    t = Topology("(amqp://s:1,amqp://s:2)", policy="first-element")
    assert t.plan() == [Member("amqp://s:1"), Member("amqp://s:2")]
    assert t.learn(THREE) is True
    # the members first (policy's pick, then the others in order), the starting URLs last
    assert [m.url for m in t.plan()] == ["amqp://h:1", "amqp://h:2", "amqp://h:3", "amqp://s:1", "amqp://s:2"]
    assert t.learn(THREE) is False


def test_topology_round_robin_is_even_and_fails_over_in_order():
    t = Topology("amqp://h:2", policy="round-robin", rng=random.Random(11))
    t.learn(THREE)
    firsts = []
    for _ in range(9):
        plan = [m.url for m in t.plan()]
        firsts.append(plan[0])
        i = ["amqp://h:1", "amqp://h:2", "amqp://h:3"].index(plan[0])
        assert plan[:3] == (["amqp://h:1", "amqp://h:2", "amqp://h:3"] * 2)[i:i + 3]
        assert plan[3:] == []   # the starting URL is a member already
    assert collections.Counter(firsts) == {"amqp://h:1": 3, "amqp://h:2": 3, "amqp://h:3": 3}


def test_topology_keeps_what_it_knows_when_an_open_says_nothing():
    t = Topology("amqp://h:1")
    t.learn(THREE)
    assert t.learn({symbol("product"): "other"}) is False
    assert t.learn(props([])) is False
    assert t.urls() == ["amqp://h:1", "amqp://h:2", "amqp://h:3"]
    assert t.learn(props([{"node-id": "a", "connector": "amqp://h:1"}])) is True   # two left
    assert t.urls() == ["amqp://h:1"]


def test_topology_rejects_bad_arguments():
    with pytest.raises(UrlListError):
        Topology("tcp://a:1")
    with pytest.raises(ValueError):
        Topology("amqp://a:1", policy="nope")


# -- the broker's side ---------------------------------------------------------------------------

def fake_cluster(n_members: int, connected=lambda i: True):
    members = {f"n{i:04d}": _Member(f"n{i:04d}", f"amqp://h:{2000 + i}", "") for i in range(n_members)}
    by_node = {f"n{i:04d}": SimpleNamespace(connected=connected(i)) for i in range(n_members)}
    c = SimpleNamespace(node=SimpleNamespace(node_id="me"), connector="amqp://h:1000", members=members,
                        by_node=by_node)
    c.live_members = lambda: ClusterNode.live_members(c)
    return c


def test_broker_lists_itself_first_then_connected_members():
    c = fake_cluster(4, connected=lambda i: i != 2)
    c.members["n0003"].connector = ""          # a member without a connector cannot be offered
    del c.by_node["n0001"]                      # known, no bridge
    got = ClusterNode.client_topology(c)
    assert got == [{"node-id": "me", "connector": "amqp://h:1000"}, {"node-id": "n0000", "connector": "amqp://h:2000"}]
    # what the client reads back from it
    assert [m.url for m in members_from_properties({CLUSTER_MEMBERS: got})] == ["amqp://h:1000", "amqp://h:2000"]


def test_broker_list_is_bounded():
    got = ClusterNode.client_topology(fake_cluster(MAX_CLUSTER_MEMBERS + 10))
    assert len(got) == MAX_CLUSTER_MEMBERS
    assert got[0] == {"node-id": "me", "connector": "amqp://h:1000"}
