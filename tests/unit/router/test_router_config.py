"""Router TOML config and Artemis broker.xml import."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from broker.wire.io.tomlconfig import ConfigError
from router.config import (CacheConfig, PoolConfig, import_artemis_xml, load_router_config,
                           parse_connector_url)
from router.core.keys import KeyType
from tests.paths import REPO


MINIMAL = """
[routers.r.policy]
name = "FIRST_ELEMENT"
[[routers.r.pool.targets]]
host = "127.0.0.1"
port = 5672
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "router.toml"
    p.write_text(textwrap.dedent(text))
    return p


def test_sample_config_loads():
    cfg = load_router_config(REPO / "etc" / "router.toml")
    main = cfg.routers["main"]
    assert [(a.name, a.mode, a.port) for a in cfg.acceptors] == \
        [("auto", "auto", 5672), ("proxy", "proxy", 5673), ("redirect", "redirect", 5674)]
    assert main.policy.name == "CONSISTENT_HASH" and main.cache.backend == "embedded"
    # the local deployment's pool is its broker cluster, read from the brokers' management APIs
    assert main.pool.source == "cluster" and main.pool.targets == ()
    assert main.pool.source_options["seed-connectors"] == (
        "http://127.0.0.1:18161", "http://127.0.0.1:18162", "http://127.0.0.1:18163")
    assert cfg.users_file == REPO / "etc" / "users.toml"


def test_artemis_defaults(tmp_path):
    cfg = load_router_config(write(tmp_path, MINIMAL + "[routers.r.cache]\n"))
    r = cfg.routers["r"]
    assert r.key_type is KeyType.SOURCE_IP and r.key_filter is None
    assert r.pool == PoolConfig(targets=r.pool.targets)
    assert (r.pool.check_period_ms, r.pool.quorum_size, r.pool.quorum_timeout_ms) == \
        (5000, 1, 3000)
    assert r.cache == CacheConfig()
    assert r.pool.targets[0].name == "127.0.0.1:5672"
    assert cfg.name == "router" and cfg.workers == 1 and cfg.management.port == 8160
    a = load_router_config(write(tmp_path, MINIMAL + """
        [[acceptors]]
        name = "a"
        port = 0
        router = "r"
    """)).acceptors[0]
    assert (a.mode, a.handshake_timeout_ms, a.connect_timeout_ms, a.idle_timeout_s,
            a.tls_handshake_timeout_ms, a.sasl_mechanisms, a.anonymous, a.host, a.tcp_user_timeout_ms) == \
        ("redirect", 10000, 5000, 0, 5000, ("PLAIN", "EXTERNAL"), False, "127.0.0.1", 30000)


def test_persisted_defaults_to_embedded(tmp_path):
    r = load_router_config(write(tmp_path, MINIMAL + "[routers.r.cache]\npersisted = true\n"
                                 "timeout = 60000\n")).routers["r"]
    assert r.cache.backend == "embedded" and r.cache.persisted and r.cache.timeout_ms == 60000
    assert r.cache.path == tmp_path / "router-cache-r.log"


@pytest.mark.parametrize("extra,path,msg", [
    ("[routers.r.pool]\nquorum-size = 0", "routers.r.pool.quorum-size", "0 must be > 0"),
    ("[routers.r.pool]\ncheck-period = 0", "routers.r.pool.check-period", "0 must be > 0"),
    ("[routers.r.pool]\nquorum-timeout = -1", "routers.r.pool.quorum-timeout", "-1 must be >= 0"),
    ("[routers.r.cache]\ntimeout = -1", "routers.r.cache.timeout", "-1 must be >= 0"),
    ("[routers.r]\nkey-type = 'IP'", "routers.r.key-type", "'IP'"),
    ("[routers.r]\nkey-filter = '('", "routers.r.key-filter", "invalid regular expression"),
    ("[routers.r]\nlocal-target-filter = 'x'", "routers.r.local-target-filter",
     "needs a [routers.r.local-target]"),
    ("[routers.r.pool]\nlocal-target-enabled = true", "routers.r.pool.local-target-enabled",
     "needs a [routers.r.local-target]"),
    ("[routers.r.policy]\nproperties = { MODULO = 2 }", "routers.r.policy.properties.MODULO",
     "unknown property 'MODULO'"),
    ("[routers.r.cache]\nbackend = 'redis'", "routers.r.cache.redis-url", "missing"),
    ("[routers.r.cache]\nbackend = 'memory'\npersisted = true", "routers.r.cache.backend",
     "cannot be persisted"),
    ("[routers.r.pool]\nsource = 'mdns'", "routers.r.pool.source",
     "'mdns' is not available"),
    ("[routers.r.pool]\ncheck_period = 5", "routers.r.pool.check_period", "unknown key"),
    ("[[acceptors]]\nname = 'a'\nport = 1\nrouter = 'nope'", "acceptors[0].router",
     "'nope' is not a router"),
    ("[[acceptors]]\nname = 'a'\nport = 1\nrouter = 'r'\nmode = 'tunnel'", "acceptors[0].mode",
     "'tunnel' must be one of redirect, proxy"),
    ("[[acceptors]]\nname = 'a'\nport = 1\nrouter = 'r'\nsasl-mechanisms = ['CRAM']",
     "acceptors[0].sasl-mechanisms[0]", "'CRAM'"),
    ("[[acceptors]]\nname = 'a'\nport = 1\nrouter = 'r'\ntls-cert = 'c.pem'",
     "acceptors[0].tls-key", "go together"),
    ("[[acceptors]]\nname = 'a'\nport = 1\nrouter = 'r'\ntcp-user-timeout-ms = -1",
     "acceptors[0].tcp-user-timeout-ms", "-1 must be >= 0"),
    ("[[acceptors]]\nname = 'a'\nport = 1\nrouter = 'r'\nupstream-close-grace-ms = 0",
     "acceptors[0].upstream-close-grace-ms", "0 must be >= 50"),
])
def test_errors_name_file_key_value(tmp_path, extra, path, msg):
    base = MINIMAL
    if extra.startswith("[routers.r.policy]"):
        base = base.replace('[routers.r.policy]\nname = "FIRST_ELEMENT"\n', "")
        extra = extra.replace("[routers.r.policy]", "[routers.r.policy]\nname = 'FIRST_ELEMENT'")
    if extra.startswith("[routers.r.pool]"):
        extra = extra.replace("[routers.r.pool]\n", "")
        base = base.replace("[[routers.r.pool.targets]]", f"[routers.r.pool]\n{extra}\n"
                            "[[routers.r.pool.targets]]")
        extra = ""
    p = write(tmp_path, base + "\n" + extra + "\n")
    with pytest.raises(ConfigError) as ei:
        load_router_config(p)
    err = ei.value
    assert err.file == str(p) and err.path == path, str(err)
    assert msg in err.message, str(err)
    assert str(err).startswith(f"{p}: {path}: ")


def test_no_router_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no router defined"):
        load_router_config(write(tmp_path, "name = 'x'\n"))
    with pytest.raises(ConfigError, match="no such file"):
        load_router_config(tmp_path / "nope.toml")


BROKER_XML = """<?xml version="1.0"?>
<configuration xmlns="urn:activemq" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">
 <core xmlns="urn:activemq:core">
  <connectors>
    <connector name="c1">tcp://10.0.0.1:61616</connector>
    <connector name="c2">tcp://10.0.0.2:61617?sslEnabled=true</connector>
    <connector name="c3">tcp://10.0.0.3</connector>
  </connectors>
  <discovery-groups><discovery-group name="dg1"/></discovery-groups>
  <connection-routers>
    <connection-router name="simple-router">
      <policy name="FIRST_ELEMENT"/>
      <pool><static-connectors><connector-ref>c1</connector-ref><connector-ref>c2</connector-ref>
      </static-connectors></pool>
    </connection-router>
    <connection-router name="hash">
      <key-type>USER_NAME</key-type>
      <key-filter>^[^.]+</key-filter>
      <cache><persisted>true</persisted><timeout>60000</timeout></cache>
      <policy name="CONSISTENT_HASH"/>
      <pool><check-period>1000</check-period><quorum-size>2</quorum-size>
        <username>guest</username><password>pw</password>
        <static-connectors><connector-ref>c1</connector-ref><connector-ref>c2</connector-ref>
        <connector-ref>c3</connector-ref></static-connectors></pool>
    </connection-router>
    <connection-router name="modulo">
      <key-type>CLIENT_ID</key-type>
      <policy name="CONSISTENT_HASH_MODULO"><property key="MODULO" value="2"/></policy>
    </connection-router>
  </connection-routers>
 </core>
</configuration>
"""


def test_import_artemis_xml(tmp_path):
    p = tmp_path / "broker.xml"
    p.write_text(BROKER_XML)
    routers = import_artemis_xml(p, management_urls={"c1": "http://10.0.0.1:8161"})
    s = routers["simple-router"]
    assert s.key_type is KeyType.SOURCE_IP and s.artemis_keys
    assert [(t.name, t.host, t.port, t.tls, t.management_url) for t in s.pool.targets] == [
        ("c1", "10.0.0.1", 61616, False, "http://10.0.0.1:8161"),
        ("c2", "10.0.0.2", 61617, True, None)]
    h = routers["hash"]
    assert h.policy.properties == {"HASH": "FNV1A", "VIRTUAL_NODES": "1"}
    assert (h.pool.check_period_ms, h.pool.quorum_size, h.pool.quorum_timeout_ms) == \
        (1000, 2, 3000)
    assert (h.pool.username, h.pool.password) == ("guest", "pw")
    assert h.cache.persisted and h.cache.backend == "embedded" and h.cache.timeout_ms == 60000
    assert h.pool.targets[2].port == 61616
    m = routers["modulo"]
    assert m.policy.properties == {"MODULO": "2", "HASH": "FNV1A"} and m.pool is None


@pytest.mark.parametrize("change,path,msg", [
    (("<connector-ref>c2</connector-ref>\n      </static", "<connector-ref>c9</connector-ref>\n"
      "      </static"), "connection-routers.simple-router.pool.static-connectors", "'c9'"),
    (("<key-type>USER_NAME", "<key-type>USER"), "connection-routers.hash.key-type", "'USER'"),
    (("<quorum-size>2", "<quorum-size>0"), "connection-routers.hash.pool.quorum-size",
     "0 must be > 0"),
    (('value="2"', 'value="x"'), "connection-routers.modulo.policy", "must be an integer"),
    (('<property key="MODULO"', '<property key="modulo"'), "connection-routers.modulo.policy",
     "unknown property 'modulo'"),
    (("<policy name=\"FIRST_ELEMENT\"/>", "<policy name=\"NOPE\"/>"),
     "connection-routers.simple-router.policy", "no policy named 'NOPE'"),
])
def test_import_artemis_xml_errors(tmp_path, change, path, msg):
    p = tmp_path / "broker.xml"
    p.write_text(BROKER_XML.replace(*change, 1))
    with pytest.raises(ConfigError) as ei:
        import_artemis_xml(p)
    assert ei.value.path == path and msg in ei.value.message, str(ei.value)


def test_import_artemis_xml_incomplete_discovery_pools_and_bad_xml(tmp_path):
    p = tmp_path / "broker.xml"
    p.write_text(BROKER_XML.replace(
        "<static-connectors><connector-ref>c1</connector-ref><connector-ref>c2</connector-ref>\n"
        "      </static-connectors>", '<discovery-group-ref discovery-group-name="dg1"/>'))
    with pytest.raises(ConfigError, match="'dg1': discovery-group.group-address: missing"):
        import_artemis_xml(p)
    p.write_text('<!DOCTYPE x [<!ENTITY a "aaaa">]><configuration>&a;</configuration>')
    with pytest.raises(ConfigError, match="invalid XML"):
        import_artemis_xml(p)


def test_toml_imports_xml(tmp_path):
    (tmp_path / "broker.xml").write_text(BROKER_XML)
    cfg = load_router_config(write(tmp_path, 'import-artemis-xml = "broker.xml"\n'))
    assert sorted(cfg.routers) == ["hash", "modulo", "simple-router"]


def test_parse_connector_url():
    assert parse_connector_url("tcp://h:1?sslEnabled=true;foo=bar") == ("h", 1, True)
    assert parse_connector_url("tcp://0.0.0.0:61616?host=a;port=2") == ("a", 2, False)


def test_integer_policy_properties_are_written_as_integers(tmp_path):
    """`MODULO = 2` (a TOML integer) must reach the policy as "2", not "2.0"."""
    p = tmp_path / "r.toml"
    p.write_text('[routers.r]\nkey-type = "CLIENT_ID"\nlocal-target-filter = "NULL|0"\n'
                 '[routers.r.local-target]\nhost = "127.0.0.1"\nport = 5672\n'
                 '[routers.r.policy]\nname = "CONSISTENT_HASH_MODULO"\nproperties = { MODULO = 2 }\n')
    cfg = load_router_config(p)
    assert cfg.routers["r"].policy.properties["MODULO"] == "2"


@pytest.mark.parametrize("extra", ['backend = "redis"\nredis-url = "http://user:s3cret@host:1"',
                                   'backend = "memory"\nredis-url = "redis://:s3cret@host:6379"'])
def test_a_bad_redis_url_is_named_without_its_password(tmp_path, extra):
    with pytest.raises(ConfigError) as e:
        load_router_config(write(tmp_path, MINIMAL + "[routers.r.cache]\n" + extra + "\n"))
    assert "redis-url" in str(e.value) and "s3cret" not in str(e.value) and ":***@" in str(e.value)
