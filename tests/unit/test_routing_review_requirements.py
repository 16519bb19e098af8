"""Review of issue #3: requirements that had no test, or only a loose one."""

from __future__ import annotations

import json
import math
import random
from fractions import Fraction

import pytest
import trio

from broker.tomlconfig import ConfigError
from router.cache_embedded import EmbeddedCacheStore
from router.config import (CacheConfig, PolicyConfig, PoolConfig, RouterConfig, TargetConfig,
                           import_artemis_xml, load_router_config)
from router.core.cache import StickyCache
from router.core.decide import Outcome, Router
from router.core.keys import ConnectionInfo, KeyResolver, KeyType
from router.core.pool import Pool, register_membership_source
from router.core.pool import _SOURCES as MEMBERSHIP_SOURCES
from router.policies import Target, create_policy, fnv1a_utf16
from router.service import RouterService

POLICIES = [("FIRST_ELEMENT", {}), ("ROUND_ROBIN", {}), ("LEAST_CONNECTIONS", {}),
            ("CONSISTENT_HASH", {}), ("CONSISTENT_HASH", {"HASH": "FNV1A", "VIRTUAL_NODES": "1"}),
            ("CONSISTENT_HASH", {"LOAD_FACTOR": "1.25"})]


def svc_config(n=2, *, policy="FIRST_ELEMENT", props=None, quorum=1, quorum_timeout=3000,
               cache=None, local=None, local_enabled=False) -> RouterConfig:
    return RouterConfig("r", key_type=KeyType.CLIENT_ID, policy=PolicyConfig(policy, props or {}),
                        cache=cache, local_target=local,
                        pool=PoolConfig(quorum_size=quorum, quorum_timeout_ms=quorum_timeout,
                                        local_target_enabled=local_enabled,
                                        targets=tuple(TargetConfig(f"t{i}", "h", 1 + i)
                                                      for i in range(n))))


# -- quorum ---------------------------------------------------------------------------------
async def test_quorum_wait_blocks_only_the_waiting_connection(autojump_clock):
    """Below quorum a cache miss waits; meanwhile a cache hit (quorum ignored) is served."""
    svc = RouterService(svc_config(2, quorum=2, cache=CacheConfig()))
    svc.pool.report_probe("t0", True, node_id="n0")
    svc.pool.report_probe("t1", True, node_id="n1")
    assert (await svc.route(ConnectionInfo("1:1", container_id="hot"))).target.node_id == "n0"
    svc.pool.report_probe("t1", False, error="down")  # 1 of 2 ready: below quorum
    got = {}

    async def cold():
        got["cold"] = await svc.route(ConnectionInfo("1:1", container_id="cold"))
        got["cold_at"] = trio.current_time()

    async def hot():
        await trio.sleep(0.1)
        got["hot"] = await svc.route(ConnectionInfo("1:1", container_id="hot"))
        got["hot_at"] = trio.current_time()

    start = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(cold)
        n.start_soon(hot)
        await trio.sleep(1.0)
        assert "cold" not in got
        assert got["hot"].ok and got["hot"].explanation.cache == "hit"
        assert got["hot_at"] - start == pytest.approx(0.1)
        svc.pool.report_probe("t1", True, node_id="n1")
    assert got["cold"].ok and got["cold_at"] - start == pytest.approx(1.0)
    assert got["cold"].explanation.waited_s == pytest.approx(1.0)


def test_below_quorum_offers_no_targets_to_the_policy():
    seen = []

    class Spy(create_policy("FIRST_ELEMENT").__class__):
        def select_target(self, targets, key):
            seen.append(tuple(targets))
            return super().select_target(targets, key)

    pool = Pool([Target(None, "h", i, name=f"t{i}") for i in range(3)], quorum_size=2)
    r = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=Spy(), pool=pool)
    pool.set_ready("t0", True, "n0")
    d = r.decide(ConnectionInfo("1:1", container_id="k"), 0.0)
    assert d.outcome is Outcome.REFUSED_UNAVAILABLE and seen == [()]
    assert not d.explanation.quorum_met and d.explanation.ready_targets == 1


# -- local target first ---------------------------------------------------------------------
async def test_service_local_target_enabled_is_first():
    local = TargetConfig("local", "127.0.0.1", 5999, node_id="local-id")
    svc = RouterService(svc_config(2, local=local, local_enabled=True))
    assert [st.target.name for st in svc.pool.members] == ["local", "t0", "t1"]
    for name in ("t1", "t0", "local"):
        svc.pool.report_probe(name, True)
    d = await svc.route(ConnectionInfo("1:1", container_id="x"))
    assert d.local and d.target.name == "local"
    svc.pool.report_probe("local", False, error="down")
    d = await svc.route(ConnectionInfo("1:1", container_id="x"))
    assert not d.local and d.target.name == "t0"


# -- expire after access --------------------------------------------------------------------
def test_router_cache_expires_after_access_not_after_write():
    pool = Pool([Target(None, "h", i, name=f"t{i}") for i in range(3)])
    for i in range(3):
        pool.set_ready(f"t{i}", True, f"n{i}")
    r = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy("ROUND_ROBIN"),
               pool=pool, cache=StickyCache(500))
    c = ConnectionInfo("1:1", container_id="k")
    first = r.decide(c, 0.0).target
    for t in (0.4, 0.8, 1.2, 1.6):  # 1.6 s after the write, never 0.5 s idle
        d = r.decide(c, t)
        assert d.explanation.cache == "hit" and d.target == first
        assert d.explanation.cache_age_s == pytest.approx(t)
    assert r.decide(c, 2.2).explanation.cache == "miss"  # 0.6 s idle


# -- round robin from the seeded rng --------------------------------------------------------
async def test_round_robin_start_comes_from_the_seeded_rng():
    starts = []
    for seed in (11, 11, 12):
        svc = RouterService(svc_config(7, policy="ROUND_ROBIN"), rng=random.Random(seed))
        for i in range(7):
            svc.pool.report_probe(f"t{i}", True, node_id=f"n{i}")
        starts.append((await svc.route(ConnectionInfo("1:1", container_id="k"))).target.name)
        assert starts[-1] == f"t{random.Random(seed).randrange(2**31 - 1) % 7}"
    assert starts[0] == starts[1]


# -- bounded load ---------------------------------------------------------------------------
@pytest.mark.parametrize("factor", ["1.0", "1.1", "1.25", "2"])
def test_bounded_load_never_exceeds_ceil_factor_times_mean(factor):
    """Exact bound (no slack): max load <= ceil(c * total / n) after every assignment."""
    p = create_policy("CONSISTENT_HASH", {"LOAD_FACTOR": factor})
    ts = [Target(f"node-{i}", "h", i, name=f"t{i}") for i in range(5)]
    c = Fraction(factor)
    for total in range(1, 3001):
        p.select_target(ts, f"key-{total}")
        assert max(p.loads.values()) <= math.ceil(c * total / 5), total


# -- keys: huge and non-ASCII ---------------------------------------------------------------
@pytest.mark.parametrize("name,props", POLICIES)
@pytest.mark.parametrize("key", ["k" * 1_000_000, "ключ-é-中文-😀", "\ud800lone", "", "NULL"])
def test_huge_and_non_ascii_keys_route(name, props, key):
    pool = Pool([Target(f"node-{i}", "h", i, name=f"t{i}") for i in range(3)])
    for i in range(3):
        pool.set_ready(f"t{i}", True)
    r = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy(name, props),
               pool=pool, cache=StickyCache(0))
    d = r.decide(ConnectionInfo("1:1", container_id=key), 0.0)
    assert d.ok and d.explanation.key == key
    assert r.decide(ConnectionInfo("1:1", container_id=key), 1.0).target == d.target
    if name == "CONSISTENT_HASH" and props.get("VIRTUAL_NODES") == "1" and key:
        h = fnv1a_utf16(key)  # Artemis: floor, else the smallest point
        pts = sorted((fnv1a_utf16(f"node-{i}"), i) for i in range(3))
        below = [i for hp, i in pts if hp <= h]
        assert d.target.name == f"t{below[-1] if below else pts[0][1]}"


def test_embedded_store_round_trips_non_ascii_and_lone_surrogates(tmp_path):
    keys = ["ключ", "中文", "😀", "\ud800", "a\nb", "x" * 100_000]
    a = EmbeddedCacheStore(tmp_path / "c.log", fsync=False)
    a.write([(k, "n", 1.0, 1.0) for k in keys], [], [])
    a.close()
    b = EmbeddedCacheStore(tmp_path / "c.log", fsync=False)
    assert sorted(b.load()) == sorted(keys) and b.skipped == 0


def test_embedded_complete_last_record_without_newline_is_kept(tmp_path):
    path = tmp_path / "c.log"
    a = EmbeddedCacheStore(path, fsync=False)
    a.write([("k1", "n1", 1.0, 1.0)], [], [])
    a.close()
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # crash right before the newline
    b = EmbeddedCacheStore(path, fsync=False)
    assert set(b.load()) == {"k1"}
    b.write([("k2", "n2", 1.0, 1.0)], [], [])
    b.close()
    assert set(EmbeddedCacheStore(path).load()) == {"k1", "k2"}


# -- config ---------------------------------------------------------------------------------
MIN = """
[routers.r]
key-type = "CLIENT_ID"
{extra}
[routers.r.local-target]
host = "127.0.0.1"
port = 5999
[routers.r.policy]
name = "FIRST_ELEMENT"
[[routers.r.pool.targets]]
host = "127.0.0.1"
port = 5672
"""


@pytest.mark.parametrize("extra,key,value", [
    ('key-filter = "a(b"', "routers.r.key-filter", "'a(b'"),
    ('local-target-filter = "[z-a]"', "routers.r.local-target-filter", "'[z-a]'"),
    ('local-target-filter = "*x"', "routers.r.local-target-filter", "'*x'"),
])
def test_invalid_regex_filters_are_config_errors(tmp_path, extra, key, value):
    p = tmp_path / "router.toml"
    p.write_text(MIN.format(extra=extra))
    with pytest.raises(ConfigError) as ei:
        load_router_config(p)
    e = ei.value
    assert (e.file, e.path) == (str(p), key) and value in e.message
    assert "invalid regular expression" in e.message


REALISTIC_XML = """<?xml version='1.0'?>
<configuration xmlns="urn:activemq" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance"
               xsi:schemaLocation="urn:activemq /schema/artemis-configuration.xsd">
  <core xmlns="urn:activemq:core">
    <name>broker-a</name>
    <persistence-enabled>true</persistence-enabled>
    <connectors>
      <connector name="artemis">tcp://0.0.0.0:61616</connector>
      <connector name="node1">tcp://10.1.0.1:61616?sslEnabled=true;trustStorePath=t.jks</connector>
      <connector name="node2">tcp://10.1.0.2:61617</connector>
      <connector name="node3">tcp://ignored:1?host=10.1.0.3;port=61618</connector>
    </connectors>
    <acceptors>
      <acceptor name="artemis">tcp://0.0.0.0:61616?router=consistent-hash-router;protocols=AMQP</acceptor>
    </acceptors>
    <broadcast-groups>
      <broadcast-group name="bg1">
        <group-address>231.7.7.7</group-address><group-port>9876</group-port>
        <broadcast-period>2000</broadcast-period><connector-ref>artemis</connector-ref>
      </broadcast-group>
    </broadcast-groups>
    <discovery-groups>
      <discovery-group name="dg1">
        <group-address>231.7.7.7</group-address>
        <group-port>9876</group-port>
        <refresh-timeout>10000</refresh-timeout>
      </discovery-group>
    </discovery-groups>
    <cluster-connections>
      <cluster-connection name="cluster1">
        <connector-ref>artemis</connector-ref>
        <discovery-group-ref discovery-group-name="dg1"/>
      </cluster-connection>
    </cluster-connections>
    <connection-routers>
      <connection-router name="local-partition">
        <key-type>CLIENT_ID</key-type>
        <key-filter>^.{3}</key-filter>
        <local-target-filter>^FOO.*</local-target-filter>
      </connection-router>
      <connection-router name="simple-router">
        <policy name="FIRST_ELEMENT"/>
        <pool>
          <static-connectors>
            <connector-ref>node1</connector-ref>
            <connector-ref>node2</connector-ref>
            <connector-ref>node3</connector-ref>
          </static-connectors>
        </pool>
      </connection-router>
      <connection-router name="consistent-hash-router">
        <key-type>USER_NAME</key-type>
        <local-target-filter>admin</local-target-filter>
        <cache>
          <persisted>true</persisted>
          <timeout>60000</timeout>
        </cache>
        <policy name="CONSISTENT_HASH"/>
        <pool>
          <quorum-size>2</quorum-size>
          <check-period>1000</check-period>
          <local-target-enabled>true</local-target-enabled>
          <static-connectors>
            <connector-ref>node1</connector-ref>
            <connector-ref>node2</connector-ref>
            <connector-ref>node3</connector-ref>
          </static-connectors>
        </pool>
      </connection-router>
      <connection-router name="sharded">
        <key-type>CLIENT_ID</key-type>
        <local-target-filter>NULL|0</local-target-filter>
        <policy name="CONSISTENT_HASH_MODULO">
          <property key="MODULO" value="3"/>
        </policy>
      </connection-router>
      <connection-router name="evenly-balance">
        <key-type>CLIENT_ID</key-type>
        <key-filter>^.{3}</key-filter>
        <policy name="LEAST_CONNECTIONS">
          <property key="CONNECTION_COUNT_THRESHOLD" value="30"/>
        </policy>
        <pool>
          <username>guest</username>
          <password>guest</password>
          <quorum-timeout>0</quorum-timeout>
          <static-connectors><connector-ref>node2</connector-ref></static-connectors>
        </pool>
      </connection-router>
    </connection-routers>
  </core>
</configuration>
"""

LOCAL = TargetConfig("local", "127.0.0.1", 61616, node_id="8f1d6a7e-0000-4000-8000-00000000000a")
NODE_IDS = {"node1": "5d3c1b9e-1111-4111-8111-111111111111",
            "node2": "a0b1c2d3-2222-4222-8222-222222222222",
            "node3": "f00dbabe-3333-4333-8333-333333333333"}


def artemis_select(node_ids: list[str], key: str) -> str:
    """Independent reference of Artemis ConsistentHashPolicy.selectTarget (spec §2.4)."""
    ring: dict[int, str] = {}
    for n in node_ids:
        ring[fnv1a_utf16(n)] = n
    h = fnv1a_utf16(key)
    floor = [p for p in ring if p <= h]
    return ring[max(floor)] if floor else ring[min(ring)]


async def test_realistic_broker_xml_imports_with_artemis_exact_hashing(tmp_path):
    p = tmp_path / "broker.xml"
    p.write_text(REALISTIC_XML)
    routers = import_artemis_xml(p, local_target=LOCAL, node_ids=NODE_IDS)
    assert list(routers) == ["local-partition", "simple-router", "consistent-hash-router",
                             "sharded", "evenly-balance"]
    assert all(r.artemis_keys for r in routers.values())
    lp = routers["local-partition"]
    assert (lp.key_type, lp.key_filter, lp.local_target_filter, lp.policy, lp.pool) == \
        (KeyType.CLIENT_ID, "^.{3}", "^FOO.*", None, None)
    s = routers["simple-router"]
    assert s.key_type is KeyType.SOURCE_IP and s.policy.properties == {}
    assert [(t.name, t.host, t.port, t.tls) for t in s.pool.targets] == [
        ("node1", "10.1.0.1", 61616, True), ("node2", "10.1.0.2", 61617, False),
        ("node3", "10.1.0.3", 61618, False)]
    ch = routers["consistent-hash-router"]
    assert ch.policy.name == "CONSISTENT_HASH"
    assert ch.policy.properties == {"HASH": "FNV1A", "VIRTUAL_NODES": "1"}
    assert (ch.pool.quorum_size, ch.pool.check_period_ms, ch.pool.quorum_timeout_ms,
            ch.pool.local_target_enabled) == (2, 1000, 3000, True)
    assert (ch.cache.backend, ch.cache.timeout_ms) == ("embedded", 60000)
    assert routers["sharded"].policy.properties == {"MODULO": "3", "HASH": "FNV1A"}
    eb = routers["evenly-balance"]
    assert eb.policy.properties == {"CONNECTION_COUNT_THRESHOLD": "30"}
    assert (eb.pool.username, eb.pool.password, eb.pool.quorum_timeout_ms) == \
        ("guest", "guest", 0)

    # the imported router decides exactly as Artemis would
    svc = RouterService(ch)
    try:
        assert svc.pool.members[0].local
        for st in svc.pool.all_states():
            svc.pool.report_probe(st.target.slot, True)
        ids = [st.target.node_id for st in svc.pool.members]
        assert ids[0] == LOCAL.node_id and ids[1:] == list(NODE_IDS.values())
        for i in range(300):
            key = f"user-{i}-é" if i % 3 else f"U{i}"
            d = svc.route_for_key(key)
            assert d.ok and d.target.node_id == artemis_select(ids, key), key
        assert svc.route_for_key("admin").local  # local-target-filter
    finally:
        await svc.aclose()
    sh = RouterService(routers["sharded"])
    sh.pool.report_probe("local", True)
    for cid in ("AAA", "BBB", "client-7", None):
        d = await sh.route(ConnectionInfo("10.0.0.1:5", container_id=cid))
        expect = "NULL" if cid is None else str((fnv1a_utf16(cid) & 0x7FFFFFFF) % 3)
        assert d.explanation.key == expect
        assert d.local == (expect in ("NULL", "0"))


def test_xml_discovery_pool_maps_to_a_discovery_source(tmp_path):
    p = tmp_path / "broker.xml"
    xml = REALISTIC_XML.replace("""<static-connectors><connector-ref>node2</connector-ref></static-connectors>""",
                                """<discovery-group-ref discovery-group-name="dg1"/>""")
    p.write_text(xml)
    with pytest.raises(ConfigError) as ei:  # no discovery membership source yet
        import_artemis_xml(p, local_target=LOCAL)
    assert ei.value.path == "connection-routers.evenly-balance.pool.discovery-group-ref"
    assert "'dg1'" in ei.value.message and "not supported yet" in ei.value.message
    started = []

    class FakeDiscovery:
        def __init__(self, targets, options):
            self.options = options

        def start(self, pool):
            started.append(self.options)

    register_membership_source("discovery", FakeDiscovery)
    try:
        eb = import_artemis_xml(p, local_target=LOCAL)["evenly-balance"]
        assert eb.pool.source == "discovery" and eb.pool.targets == ()
        assert eb.pool.source_options == {"discovery-group": "dg1", "group-address": "231.7.7.7",
                                          "group-port": "9876", "refresh-timeout": "10000"}
        RouterService(eb)
        assert started == [dict(eb.pool.source_options)]
    finally:
        del MEMBERSHIP_SOURCES["discovery"]


def test_explanations_stay_json_with_odd_keys():
    pool = Pool([Target("n0", "h", 1, name="t0")])
    pool.set_ready("t0", True)
    r = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy("FIRST_ELEMENT"),
               pool=pool, cache=StickyCache(0))
    d = r.decide(ConnectionInfo("1:1", container_id="ключ\x00"), 0.0)
    assert json.loads(json.dumps(d.to_dict()))["explanation"]["key"] == "ключ\x00"
