"""``import-artemis-xml`` from a router TOML (issue 8, item 5): the table form supplies what a
broker.xml cannot say (the local target, each connector's node id and management URL), and the
imported routers place keys exactly as Artemis does for the same node ids (the Artemis vectors,
``tests/vectors`` = ``../shared/artemis-vectors``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import trio

from broker.wire.io.tomlconfig import ConfigError
from router.config import load_router_config
from router.core.decide import Outcome
from router.core.keys import ConnectionInfo
from router.service import RouterService
from tests.paths import VECTORS



def rows(name: str) -> list[dict[str, str]]:
    with (VECTORS / name).open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE))


SETS = rows("target_sets.tsv")
HASH = rows("hash_vectors.tsv")
ROUTER = rows("router_vectors.tsv")


def node_ids(set_name: str) -> list[str]:
    return [r["node_id"] for r in SETS if r["set"] == set_name]


BROKER_XML = """<configuration xmlns="urn:activemq"><core xmlns="urn:activemq:core">
  <connectors>
    <connector name="n0">tcp://10.0.0.10:61616</connector>
    <connector name="n1">tcp://10.0.0.11:61616</connector>
    <connector name="n2">tcp://10.0.0.12:61616?sslEnabled=true</connector>
    <connector name="n3">tcp://10.0.0.13:61616</connector>
    <connector name="n4">tcp://10.0.0.14:61616</connector>
  </connectors>
  <connection-routers>
    <connection-router name="ch5">
      <key-type>CLIENT_ID</key-type>
      <policy name="CONSISTENT_HASH"/>
      <pool><quorum-size>1</quorum-size><quorum-timeout>0</quorum-timeout>
        <static-connectors><connector-ref>n0</connector-ref><connector-ref>n1</connector-ref>
          <connector-ref>n2</connector-ref><connector-ref>n3</connector-ref><connector-ref>n4</connector-ref>
        </static-connectors></pool>
    </connection-router>
    <connection-router name="ch3">
      <key-type>CLIENT_ID</key-type>
      <policy name="CONSISTENT_HASH"/>
      <pool><quorum-timeout>0</quorum-timeout><static-connectors><connector-ref>n0</connector-ref>
        <connector-ref>n1</connector-ref><connector-ref>n2</connector-ref></static-connectors></pool>
    </connection-router>
    <connection-router name="shard0">
      <key-type>CLIENT_ID</key-type>
      <local-target-filter>NULL|0</local-target-filter>
      <policy name="CONSISTENT_HASH_MODULO"><property key="MODULO" value="2"/></policy>
    </connection-router>
    <connection-router name="shard1">
      <key-type>CLIENT_ID</key-type>
      <local-target-filter>NULL|1</local-target-filter>
      <policy name="CONSISTENT_HASH_MODULO"><property key="MODULO" value="2"/></policy>
    </connection-router>
    <connection-router name="shard2of3">
      <key-type>CLIENT_ID</key-type>
      <key-filter>^[^-]+</key-filter>
      <local-target-filter>2</local-target-filter>
      <policy name="CONSISTENT_HASH_MODULO"><property key="MODULO" value="3"/></policy>
    </connection-router>
  </connection-routers>
</core></configuration>
"""


def write(tmp_path: Path, ids: list[str], extra: str = "") -> Path:
    (tmp_path / "broker.xml").write_text(BROKER_XML)
    lines = ['[import-artemis-xml]', 'file = "broker.xml"',
             '[import-artemis-xml.local-target]', 'name = "self"', 'host = "127.0.0.1"', "port = 5672",
             'node-id = "local-node-id"', 'management-url = "http://127.0.0.1:8161"']
    for i, nid in enumerate(ids):
        lines += [f"[import-artemis-xml.connectors.n{i}]", f"node-id = {json.dumps(nid)}",
                  f'management-url = "http://10.0.0.1{i}:8161"']
    p = tmp_path / "router.toml"
    p.write_text("\n".join(lines) + "\n" + extra)
    return p


def test_toml_supplies_local_target_node_ids_and_management_urls(tmp_path):
    cfg = load_router_config(write(tmp_path, node_ids("names")))
    ch5 = cfg.routers["ch5"]
    assert [(t.name, t.host, t.port, t.tls, t.node_id, t.management_url) for t in ch5.pool.targets] == [
        (f"n{i}", f"10.0.0.1{i}", 61616, i == 2, f"broker-{i}", f"http://10.0.0.1{i}:8161") for i in range(5)]
    for name in ("shard0", "shard1", "shard2of3"):
        rc = cfg.routers[name]
        assert rc.local_target.name == "self" and rc.local_target.node_id == "local-node-id"
        assert rc.local_target.management_url == "http://127.0.0.1:8161"
        assert rc.policy.properties == {"MODULO": rc.policy.properties["MODULO"], "HASH": "FNV1A"}
        assert rc.artemis_keys
    assert cfg.routers["shard0"].local_target_filter == "NULL|0"


def test_unknown_connector_in_toml_is_a_config_error(tmp_path):
    p = write(tmp_path, node_ids("names")[:2])
    p.write_text(p.read_text() + '[import-artemis-xml.connectors.nX]\nnode-id = "x"\n')
    with pytest.raises(ConfigError, match=r"import-artemis-xml\.connectors\.nX\.node-id.*'nX' is not a <connector>"):
        load_router_config(p)


def test_local_target_filter_without_local_target_is_refused(tmp_path):
    (tmp_path / "broker.xml").write_text(BROKER_XML)
    p = tmp_path / "router.toml"
    p.write_text('import-artemis-xml = "broker.xml"\n')
    with pytest.raises(ConfigError, match=r"needs a local target \(\[import-artemis-xml.local-target\]"):
        load_router_config(p)


def _service(tmp_path, set_name, router) -> RouterService:
    ids = node_ids(set_name)
    svc = RouterService(load_router_config(write(tmp_path, ids)).routers[router])
    for t in svc.config.pool.targets if svc.config.pool else ():
        svc.pool.set_ready(t.name, True)
    if svc.config.local_target is not None:
        svc.pool.set_ready("self", True)  # as a probe of its management URL would
    return svc


CH = [r for r in HASH if r["policy"] == "CONSISTENT_HASH" and r["target_set"] in ("names", "uuids")
      and r["param"] in ("3", "5")]


@pytest.mark.parametrize("set_name", ["names", "uuids"])
def test_imported_consistent_hash_places_keys_as_artemis(tmp_path, set_name):
    services = {"5": _service(tmp_path, set_name, "ch5"), "3": _service(tmp_path, set_name, "ch3")}
    checked = 0
    for r in CH:
        if r["target_set"] != set_name:
            continue
        ids = r["target_node_ids"].split(";")
        svc = services[r["param"]]
        assert [t.node_id for t in svc.config.pool.targets] == ids
        d = trio.run(svc.route, ConnectionInfo(source="10.9.9.9:1", container_id=json.loads(r["key_json"])))
        key = json.loads(r["key_json"])
        if key in ("", "NULL") or key.startswith("$.artemis.internal.router.client."):
            continue  # the key resolver maps these before the policy (router vectors cover them)
        if len(key) > svc.config.max_key_length:
            assert d.outcome is Outcome.REFUSED_USE_ANOTHER  # Lodestone's max-key-length (255)
            continue
        assert d.outcome is Outcome.OK
        assert d.target.node_id == ids[int(r["expected"])], r
        checked += 1
    assert checked >= 40


MOD_SCENARIOS = {"modulo2-local0": "shard0", "modulo2-local1": "shard1", "modulo3-local2": "shard2of3"}


@pytest.mark.parametrize("r", [r for r in ROUTER if r["scenario"] in MOD_SCENARIOS],
                         ids=lambda r: f"{r['scenario']}|{r['input_json']}")
def test_imported_modulo_shards_as_artemis(tmp_path, r):
    svc = _service(tmp_path, "names", MOD_SCENARIOS[r["scenario"]])
    d = trio.run(svc.route, ConnectionInfo(source="10.0.0.1:1", container_id=json.loads(r["input_json"])))
    assert d.outcome is Outcome[r["result_status"]]
    if d.outcome is Outcome.OK:
        assert d.local and d.target.node_id == r["result_node_id"]


MOD2 = [r for r in HASH if r["policy"] == "CONSISTENT_HASH_MODULO" and r["param"] == "2"]


def test_imported_modulo_transforms_every_vector_key_as_artemis(tmp_path):
    """Every CONSISTENT_HASH_MODULO vector with MODULO=2: the imported router's transformed key
    is Artemis's ``transformKey`` output, and shard "0" (and only it) is the local target."""
    svc = _service(tmp_path, "names", "shard0")
    checked = 0
    for r in MOD2:
        key = json.loads(r["key_json"])
        if key in ("", "NULL") or key.startswith("$.artemis.internal.router.client.") \
                or len(key) > svc.config.max_key_length:
            continue  # resolved before the policy / Lodestone's max-key-length
        d = trio.run(svc.route, ConnectionInfo(source="10.0.0.1:1", container_id=key))
        assert d.explanation.key == r["expected"], r
        assert (d.outcome is Outcome.OK and d.local) == (r["expected"] == "0"), r
        checked += 1
    assert checked >= 30
