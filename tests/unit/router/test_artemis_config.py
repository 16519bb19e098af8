"""Router configuration as Artemis writes it: broker.xml import (realistic file, discovery
pools, trimmed filters) and regex filters rejected as config errors (moved from the issue #3
review files)."""

from __future__ import annotations

import pytest

from broker.wire.io.tomlconfig import ConfigError
from router.config import TargetConfig, import_artemis_xml, load_router_config
from router.core.keys import ConnectionInfo, KeyType
from router.policies import fnv1a_utf16
from router.service import RouterService


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

# -- config ---------------------------------------------------------------------------------
def test_xml_local_target_filter_is_trimmed(tmp_path):
    """Artemis's XML parser trims element text; a pretty-printed local-target-filter kept its
    whitespace and never full-matched."""
    p = tmp_path / "broker.xml"
    p.write_text("""<configuration xmlns="urn:activemq"><core xmlns="urn:activemq:core">
      <connection-routers><connection-router name="lp">
        <key-type>CLIENT_ID</key-type>
        <local-target-filter>
            ^FOO.*
        </local-target-filter>
      </connection-router></connection-routers></core></configuration>""")
    rc = import_artemis_xml(p, local_target=TargetConfig("local", "127.0.0.1", 5672))["lp"]
    assert rc.local_target_filter == "^FOO.*"

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
    eb = import_artemis_xml(p, local_target=LOCAL)["evenly-balance"]
    assert eb.pool.source == "discovery" and eb.pool.targets == ()
    assert eb.pool.source_options == {"group-address": "231.7.7.7", "group-port": 9876,
                                      "local-bind-address": "0.0.0.0", "refresh-timeout-ms": 10000,
                                      "initial-wait-timeout-ms": 10000, "cluster": None, "key": None}
    service = RouterService(eb)
    assert service.dynamic_membership
    # JGroups, and values the source refuses, are ConfigErrors naming the pool's reference
    for old, new, msg in (("<refresh-timeout>10000</refresh-timeout>", "<jgroups-file>j.xml</jgroups-file>",
                           "<jgroups-file> is not supported"),
                          ("<group-port>9876</group-port>", "<group-port>x</group-port>",
                           "group-port: 'x' is not an integer"),
                          ("<group-address>231.7.7.7</group-address>\n        <group-port>",
                           "<group-address>10.0.0.1</group-address>\n        <group-port>",
                           "not a multicast address")):
        assert old in xml, old
        p.write_text(xml.replace(old, new))
        with pytest.raises(ConfigError) as ei:
            import_artemis_xml(p, local_target=LOCAL)
        assert ei.value.path == "connection-routers.evenly-balance.pool.discovery-group-ref"
        assert "'dg1'" in ei.value.message and msg in ei.value.message, ei.value.message


def test_xml_cluster_connection_pool_maps_to_a_cluster_source(tmp_path):
    p = tmp_path / "broker.xml"
    p.write_text(REALISTIC_XML.replace("""<static-connectors><connector-ref>node2</connector-ref></static-connectors>""",
                                       """<cluster-connection>cluster1</cluster-connection>"""))
    with pytest.raises(ConfigError) as ei:  # broker.xml has no management URLs
        import_artemis_xml(p, local_target=LOCAL)
    assert ei.value.path == "connection-routers.evenly-balance.pool.cluster-connection"
    assert "'cluster1'" in ei.value.message and "management-url" in ei.value.message
    # a management URL for the cluster-connection's connector (or the local target) seeds it
    eb = import_artemis_xml(p, local_target=LOCAL,
                            management_urls={"artemis": "http://127.0.0.1:8161",
                                             "node1": "http://10.1.0.1:8161"})["evenly-balance"]
    assert eb.pool.source == "cluster" and eb.pool.targets == ()
    assert eb.pool.source_options == {"seed-connectors": ("http://127.0.0.1:8161",), "leave-after-ms": 30000}
    svc = RouterService(eb)
    assert svc.dynamic_membership and svc.membership_status()["seed_connectors"] == ["http://127.0.0.1:8161"]
    p.write_text(p.read_text().replace("<cluster-connection>cluster1<", "<cluster-connection>nope<"))
    with pytest.raises(ConfigError, match="'nope' is not a <cluster-connection>"):
        import_artemis_xml(p, local_target=LOCAL, management_urls={"artemis": "http://127.0.0.1:8161"})
