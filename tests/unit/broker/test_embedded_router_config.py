"""``[routers.<name>]`` in a broker's TOML (the router inside the broker, issue 11 part 4): the
router's own schema in embedded mode, ``acceptors.<a>.router`` and ``[routing-log]``; bad values
name file, key and value (the CLI exits 2 with one line: tests/integration/test_broker_cli_config_errors.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.config import load_config
from broker.wire.io.tomlconfig import ConfigError
from router.core.keys import KeyType


CLUSTER = """
[node]
data-dir = "d"

[acceptors.amqp]
port = 0
router = "gravity"

[cluster]
name = "east"
connector = "amqp://127.0.0.1:15672"
"""

ROUTER = """
[routers.gravity]
key-type = "CLIENT_ID"
local-target-filter = "local-.*"

[routers.gravity.policy]
name = "CONSISTENT_HASH"

[routers.gravity.pool]
source = "cluster"
local-target-enabled = true
check-period = 500
"""


def write(tmp_path: Path, body: str) -> Path:
    (tmp_path / "users.toml").write_text("")
    p = tmp_path / "broker.toml"
    p.write_text(body)
    return p


def error(tmp_path: Path, body: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, body))
    return str(info.value)


def test_a_routed_acceptor_with_a_cluster_pool(tmp_path):
    cfg = load_config(write(tmp_path, CLUSTER + ROUTER + '[routers.gravity.cache]\nbackend = "embedded"\n'))
    assert cfg.acceptors[0].router == "gravity"
    rc = cfg.routers["gravity"]
    assert rc.key_type is KeyType.CLIENT_ID and rc.local_target_filter == "local-.*"
    assert rc.local_target is None          # the broker itself, filled in at start
    assert rc.pool.source == "broker-cluster" and rc.pool.local_target_enabled
    assert rc.pool.check_period_ms == 500 and rc.pool.quorum_size == 1 and rc.pool.quorum_timeout_ms == 3000
    assert rc.cache.path == tmp_path / "d" / "router-cache-gravity.log"   # in the data dir
    assert cfg.routing_log is None


def test_an_acceptor_without_a_router_is_not_routed(tmp_path):
    cfg = load_config(write(tmp_path, CLUSTER.replace('router = "gravity"\n', "")))
    assert cfg.acceptors[0].router is None and cfg.routers == {}


def test_static_pools_and_the_routing_log(tmp_path):
    body = CLUSTER + """
[routers.gravity]
key-type = "USER_NAME"

[routers.gravity.policy]
name = "ROUND_ROBIN"

[routers.gravity.pool]
[[routers.gravity.pool.targets]]
name = "other"
host = "10.0.0.2"
port = 5672
management-url = "http://10.0.0.2:8161"

[routing-log]
path = "logs/routing.log"
"""
    cfg = load_config(write(tmp_path, body))
    assert cfg.routers["gravity"].pool.source == "static"
    assert cfg.routers["gravity"].pool.targets[0].host == "10.0.0.2"
    assert cfg.routing_log.path == tmp_path / "logs" / "routing.log"


@pytest.mark.parametrize("body,key,text", [
    (CLUSTER, "acceptors.amqp.router", "'gravity' is not a router defined in [routers] (defined: none)"),
    (CLUSTER + ROUTER + '[routers.gravity.local-target]\nhost = "x"\nport = 1\n',
     "routers.gravity.local-target", "inside a broker the broker itself is the local target"),
    (CLUSTER + ROUTER + 'seed-connectors = ["http://127.0.0.1:8161"]\n',
     "routers.gravity.pool.seed-connectors", "inside a broker a cluster pool is this broker's own cluster"),
    (CLUSTER + ROUTER + 'cluster-connection = "west"\n',
     "routers.gravity.pool.cluster-connection", "'west' is not this broker's cluster ('east')"),
    (CLUSTER.split("[cluster]")[0] + ROUTER, "routers.gravity.pool.source",
     "'cluster' needs this broker to be in a cluster"),
    (CLUSTER + ROUTER.replace('key-type = "CLIENT_ID"', 'key-type = "CLIENTID"'), "routers.gravity.key-type",
     "CLIENTID"),
    (CLUSTER + ROUTER + '[routing-log]\nmax-field-chars = 100\n', "routers.gravity.max-key-length",
     "255 must be <= routing-log.max-field-chars (100)"),
    (CLUSTER + ROUTER + 'colour = "blue"\n', "routers.gravity.pool.colour", ""),
    (CLUSTER.replace('router = "gravity"', 'router = ""') + ROUTER, "acceptors.amqp.router", ""),
])
def test_bad_values_name_file_key_and_value(tmp_path, body, key, text):
    msg = error(tmp_path, body)
    assert f"broker.toml: {key}" in msg and text in msg, msg
