"""``broker.routing.ClusterPoolSource.targets``: the pool a router inside a broker takes from its
cluster, with HA pairs (pure logic over the cluster's tables; the cluster is a plain stand-in).
The real-process test is tests/integration/test_ha_topology.py."""

from __future__ import annotations

from types import SimpleNamespace

from broker.routing import ClusterPoolSource
from router.core.membership import PAIR_HOLD_S


class _Cluster:
    def __init__(self):
        self.members: dict = {}          # node id -> SimpleNamespace(connector, management_url)
        self.connected: set = set()
        self.member_backups: dict = {}
        self.cfg = SimpleNamespace(name="c")

    def member(self, node_id, port, up=True):
        self.members[node_id] = SimpleNamespace(connector=f"amqp://h:{port}", management_url=f"http://h:{port + 1}")
        (self.connected.add if up else self.connected.discard)(node_id)

    def live_members(self):
        return [(n, m.connector, m.management_url) for n, m in sorted(self.members.items()) if n in self.connected]


def _source():
    cluster = _Cluster()
    return ClusterPoolSource(SimpleNamespace(cluster=cluster, node_id="me")), cluster


def _view(targets):
    return [(t.name, t.port, t.pair, t.backup) for t in targets]


def test_a_member_without_backups_leaves_when_its_bridge_goes_down():
    src, c = _source()
    c.member("a", 100)
    c.member("b", 200)
    assert _view(src.targets(0.0)) == [("a", 100, "a", False), ("b", 200, "b", False)]
    c.connected.discard("a")
    assert _view(src.targets(1.0)) == [("b", 200, "b", False)]
    assert src.next_expiry(1.0) is None


def test_a_pair_fails_over_keeps_its_slots_and_the_dead_primary_leaves_after_the_grace():
    src, c = _source()
    c.member("a", 100)
    c.member("b", 200)
    c.member_backups["a"] = (("amqp://h:300", "http://h:301", True),)
    assert _view(src.targets(0.0)) == [("a", 100, "a", False), ("b", 200, "b", False),
                                      ("a@h:300", 300, "a", True)]
    c.connected.discard("a")                       # the primary dies: it stays (not ready), with its backup
    assert _view(src.targets(1.0)) == [("a", 100, "a", False), ("b", 200, "b", False),
                                      ("a@h:300", 300, "a", True)]
    c.member("a", 300)                             # the backup serves the node id from its own address
    c.member_backups.pop("a")                      # (its hello cleared what the primary told)
    # same slot for the backup's address, now the member itself; the dead primary stays for the grace
    assert _view(src.targets(2.0)) == [("a", 100, "a", False), ("b", 200, "b", False),
                                      ("a@h:300", 300, "a", False)]
    assert src.next_expiry(2.0) == PAIR_HOLD_S
    assert src.status()["departed"] == ["a"]
    assert _view(src.targets(2.0 + PAIR_HOLD_S)) == [("b", 200, "b", False), ("a@h:300", 300, "a", False)]
    assert src.next_expiry(40.0) is None
    # the old primary comes back as a backup at its old address: its old slot name
    c.member_backups["a"] = (("amqp://h:100", "http://h:101", True),)
    assert _view(src.targets(50.0)) == [("b", 200, "b", False), ("a@h:300", 300, "a", False),
                                       ("a", 100, "a", True)]


def test_own_backups_and_a_backup_at_the_members_address_are_not_targets():
    src, c = _source()
    c.member("a", 100)
    c.member_backups["me"] = (("amqp://h:900", "", True),)        # this node's own backup
    c.member_backups["a"] = (("amqp://h:100", "", True), ("bad connector", "", True))
    assert _view(src.targets(0.0)) == [("a", 100, "a", False)]


def test_a_down_member_with_backups_leaves_after_the_grace_and_one_without_a_backup_in_sync_at_once():
    src, c = _source()
    c.member("a", 100)
    c.member("b", 200)
    c.member_backups["a"] = (("amqp://h:300", "", True),)
    c.member_backups["b"] = (("amqp://h:400", "", False),)    # a replication backup still syncing
    src.targets(0.0)
    c.connected -= {"a", "b"}                                  # both die; nobody takes over
    assert _view(src.targets(1.0)) == [("a", 100, "a", False), ("a@h:300", 300, "a", True),
                                      ("b@h:400", 400, "b", True)]
    assert src.next_expiry(1.0) == PAIR_HOLD_S
    later = 1.0 + PAIR_HOLD_S
    assert _view(src.targets(later)) == [("a@h:300", 300, "a", True), ("b@h:400", 400, "b", True)]
    assert src.next_expiry(later) is None                      # nothing left to wait for: no busy loop
    assert _view(src.targets(later + 100)) == [("a@h:300", 300, "a", True), ("b@h:400", 400, "b", True)]


def test_one_node_id_at_one_address_under_two_schemes_keeps_its_name():
    src, c = _source()
    c.member("a", 100)
    c.member_backups["a"] = (("amqps://h:100", "", True),)    # the member's own host:port, TLS
    assert _view(src.targets(0.0)) == [("a", 100, "a", False)]
    c.member_backups.pop("a")
    assert _view(src.targets(1.0)) == [("a", 100, "a", False)]
