"""``[cluster]``, ``[ha]`` and ``redistribution-delay-ms``: what parses, the defaults, and bad values
naming file, key and value (in the CLI too, one line and status 2:
tests/integration/test_broker_cli_config_errors.py). Also the cluster address filter."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.cluster.settings import (DEFAULT_CLUSTER_PASSWORD, ClusterConfig, Connector, HaConfig, address_clustered,
                                     parse_address_filter, parse_connector)
from broker.config import apply_overrides, load_config
from broker.wire.io.tomlconfig import ConfigError


BASE = """
[acceptors.amqp]
port = 0
"""

CLUSTER = BASE + """
[cluster]
connector = "amqp://127.0.0.1:15672"
"""

FULL = BASE + """
[cluster]
name = "east"
connector = "amqps://node-1.example:5671"
static-connectors = ["amqps://node-1.example:5671", "amqps://node-2.example:5671", "amqp://[::1]:5672"]
user = "cluster"
password = "s3cret"
message-load-balancing = "STRICT"
max-hops = 2
address = "orders, !orders.audit"
retry-interval-ms = 100
retry-interval-multiplier = 2
max-retry-interval-ms = 5000
initial-connect-attempts = 3
reconnect-attempts = 0
check-period-ms = 1000
connection-ttl-ms = 2000
call-timeout-ms = 3000
notification-interval-ms = 250
notification-attempts = 5
confirmation-window-bytes = -1
duplicate-detection = false
id-cache-size = 500
persist-id-cache = false
allow-direct-connections-only = true
key = "k3y"
require-client-key = true
ca-file = "ca.pem"
max-state-bytes = 4096

[ha]
policy = "live-only"
scale-down = true
scale-down-group-name = "east"
scale-down-connectors = ["amqp://node-2.example:5672"]

[address-defaults]
redistribution-delay-ms = 0

[address-settings."orders.#"]
redistribution-delay-ms = 5000
"""


def write(tmp_path: Path, body: str) -> Path:
    (tmp_path / "users.toml").write_text("")
    p = tmp_path / "broker.toml"
    p.write_text(body)
    return p


def test_full_cluster_table(tmp_path):
    (tmp_path / "ca.pem").write_text("")
    cfg = load_config(write(tmp_path, FULL))
    assert cfg.cluster == ClusterConfig(
        name="east", connector="amqps://node-1.example:5671",
        static_connectors=("amqps://node-1.example:5671", "amqps://node-2.example:5671", "amqp://[::1]:5672"),
        discovery_group=None, user="cluster", password="s3cret", password_set=True,
        message_load_balancing="STRICT", max_hops=2, address="orders, !orders.audit", retry_interval_ms=100,
        retry_interval_multiplier=2.0, max_retry_interval_ms=5000, initial_connect_attempts=3,
        reconnect_attempts=0, check_period_ms=1000, connection_ttl_ms=2000, call_timeout_ms=3000,
        notification_interval_ms=250, notification_attempts=5, confirmation_window_bytes=-1,
        duplicate_detection=False, id_cache_size=500, persist_id_cache=False, allow_direct_connections_only=True,
        key="k3y", require_client_key=True, ca_file=str(tmp_path / "ca.pem"), max_state_bytes=4096)
    assert isinstance(cfg.cluster.retry_interval_multiplier, float)
    assert not cfg.cluster.weak_password
    assert cfg.cluster.clusters("orders.eu") and not cfg.cluster.clusters("orders.audit.x")
    assert not cfg.cluster.clusters("billing")
    assert cfg.ha == HaConfig(policy="live-only", scale_down=True, scale_down_group_name="east",
                              scale_down_connectors=("amqp://node-2.example:5672",))
    assert cfg.settings.for_address("billing").redistribution_delay_ms == 0
    assert cfg.settings.for_address("orders.eu").redistribution_delay_ms == 5000


def test_no_cluster_table_is_a_single_node(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.cluster is None and cfg.ha == HaConfig()
    assert cfg.settings.for_address("x").redistribution_delay_ms == -1


def test_cluster_defaults_are_artemis(tmp_path):
    cfg = load_config(write(tmp_path, CLUSTER))
    assert cfg.cluster == ClusterConfig(connector="amqp://127.0.0.1:15672")
    c = cfg.cluster
    assert (c.name, c.static_connectors, c.discovery_group, c.user, c.password, c.password_set) == \
        ("my-cluster", (), None, "ACTIVEMQ.CLUSTER.ADMIN.USER", DEFAULT_CLUSTER_PASSWORD, False)
    assert (c.message_load_balancing, c.max_hops, c.address) == ("ON_DEMAND", 1, "")
    assert (c.retry_interval_ms, c.retry_interval_multiplier, c.max_retry_interval_ms) == (500, 1.0, 2000)
    assert (c.initial_connect_attempts, c.reconnect_attempts) == (-1, -1)
    assert (c.check_period_ms, c.connection_ttl_ms, c.call_timeout_ms) == (30000, 60000, 30000)
    assert (c.notification_interval_ms, c.notification_attempts, c.confirmation_window_bytes) == (1000, 2, 1048576)
    assert (c.duplicate_detection, c.id_cache_size, c.persist_id_cache, c.allow_direct_connections_only) == \
        (True, 20000, True, False)
    assert (c.key, c.require_client_key, c.ca_file, c.max_state_bytes) == (None, False, None, 1048576)
    assert c.weak_password and c.clusters("anything")
    assert cfg.ha == HaConfig()


@pytest.mark.parametrize("password,weak", [(None, True), (DEFAULT_CLUSTER_PASSWORD, True), ("x", False)])
def test_weak_password(tmp_path, password, weak):
    body = CLUSTER + ("" if password is None else f"password = {password!r}\n")
    c = load_config(write(tmp_path, body)).cluster
    assert c.password_set == (password is not None) and c.weak_password == weak


def test_own_connector_in_static_connectors_is_allowed(tmp_path):
    """Every node may share one list; the bridge skips its own connector."""
    body = BASE + '[cluster]\nconnector = "amqp://127.0.0.1:0"\n' \
        'static-connectors = ["amqp://127.0.0.1:15672", "amqp://127.0.0.1:15673"]\n'
    assert load_config(write(tmp_path, body)).cluster.connector == "amqp://127.0.0.1:0"
    body = CLUSTER + 'static-connectors = ["amqp://127.0.0.1:15672", "amqp://127.0.0.1:15673"]\n'
    assert "amqp://127.0.0.1:15672" in load_config(write(tmp_path, body)).cluster.static_connectors


def test_connectors_are_kept_in_one_spelling(tmp_path):
    body = BASE + '[cluster]\nconnector = "AMQP://Node-1:5672/"\nstatic-connectors = ["amqps://[::1]:5671/"]\n' \
        '[ha]\nscale-down-connectors = ["Amqp://Node-2:5672"]\n'
    cfg = load_config(write(tmp_path, body))
    assert cfg.cluster.connector == "amqp://node-1:5672" and cfg.cluster.static_connectors == ("amqps://[::1]:5671",)
    assert cfg.ha.scale_down_connectors == ("amqp://node-2:5672",)


def test_scale_down_to_the_cluster(tmp_path):
    cfg = load_config(write(tmp_path, CLUSTER + "[ha]\nscale-down = true\n"))
    assert cfg.ha.scale_down and cfg.ha.scale_down_connectors == ()
    cfg = load_config(write(tmp_path, CLUSTER + "[ha]\nscale-down = true\nscale-down-connectors = ['amqp://h:1']\n"))
    assert cfg.ha.scale_down and cfg.ha.scale_down_connectors == ("amqp://h:1",)
    # a shared-store backup scales down instead of serving (Artemis <shared-store><slave><scale-down>)
    cfg = load_config(write(tmp_path, CLUSTER + "[ha]\npolicy = 'shared-store'\nrole = 'backup'\nscale-down = true\n"))
    assert cfg.ha.scale_down and cfg.ha.role == "backup"


def test_partitions(tmp_path):
    cfg = load_config(write(tmp_path, CLUSTER + "primaries = ['amqp://127.0.0.1:15672', 'AMQP://H2:2']\n")).cluster
    assert cfg.partition == "primary" and cfg.primaries == ("amqp://127.0.0.1:15672", "amqp://h2:2")
    assert cfg.elects_root and not cfg.secondary
    cfg = load_config(write(tmp_path, BASE + "[cluster]\nconnector = 'amqp://127.0.0.1:0'\npartition = 'secondary'\n"
                                             "primaries = ['amqp://h1:1', 'amqp://h2:2']\n")).cluster
    assert cfg.secondary and cfg.elects_root   # a secondary may run on an OS-chosen port
    cfg = load_config(write(tmp_path, CLUSTER + "primaries = ['amqp://127.0.0.1:15672']\n[addresses.work]\nshared = true\n"
                                                "[addresses.plain]\n"))
    assert [(d.name, d.shared) for d in cfg.addresses] == [("work", True), ("plain", False)]
    plain = load_config(write(tmp_path, CLUSTER)).cluster
    assert plain.partition == "primary" and plain.primaries == () and not plain.elects_root


def test_overrides_leave_the_cluster_alone(tmp_path):
    cfg = load_config(write(tmp_path, CLUSTER))
    over = apply_overrides(cfg, amqp_port=0, management_port=0, data_dir=tmp_path / "d", name="n")
    assert over.cluster == cfg.cluster and over.ha == cfg.ha and over.acceptors[0].port == 0


BAD = [
    # [cluster]
    (BASE + "[cluster]\n", "cluster.connector", "missing (required)"),
    ("cluster = 1\n" + BASE, "cluster", "1 must be a table"),
    (BASE + "[cluster]\nconnector = 5672\n", "cluster.connector", "5672 must be a string"),
    (BASE + "[cluster]\nconnector = 'http://h:1'\n", "cluster.connector", "'http://h:1' must be an amqp://"),
    (BASE + "[cluster]\nconnector = 'amqp://h'\n", "cluster.connector", "'amqp://h' has no port"),
    (BASE + "[cluster]\nconnector = 'amqp://:5672'\n", "cluster.connector", "'amqp://:5672' has no host"),
    (BASE + "[cluster]\nconnector = 'amqp://h:70000'\n", "cluster.connector", "'amqp://h:70000' is not an amqp"),
    (BASE + "[cluster]\nconnector = 'amqp://h:x'\n", "cluster.connector", "'amqp://h:x' is not an amqp"),
    (BASE + "[cluster]\nconnector = 'amqp://u:p@h:1'\n", "cluster.connector", "'amqp://u:p@h:1' must not carry"),
    (BASE + "[cluster]\nconnector = 'amqp://h:1/vhost'\n", "cluster.connector", "'amqp://h:1/vhost' must be just"),
    (CLUSTER + "static-connectors = 'amqp://h:1'\n", "cluster.static-connectors", "'amqp://h:1' must be an array"),
    (CLUSTER + "static-connectors = ['amqp://h:1', 2]\n", "cluster.static-connectors[1]", "2 must be a string"),
    (CLUSTER + "static-connectors = ['amqp://h:1', 'tcp://h:2']\n", "cluster.static-connectors[1]",
     "'tcp://h:2' must be an amqp://"),
    (CLUSTER + "static-connectors = ['amqp://h:0']\n", "cluster.static-connectors[0]", "'amqp://h:0' has port 0"),
    (CLUSTER + "discovery-group = 'dg'\n", "cluster.discovery-group", "'dg': no [discovery-groups.dg] table"),
    (BASE + "[discovery-groups.dg]\ngroup-address = '10.0.0.1'\ngroup-port = 9876\n", "discovery-groups.dg.group-address",
     "'10.0.0.1' is not a multicast address"),
    (BASE + "[discovery-groups.dg]\ngroup-address = 'x'\ngroup-port = 9876\n", "discovery-groups.dg.group-address",
     "'x' is not an IPv4 address"),
    (BASE + "[discovery-groups.dg]\ngroup-address = '231.7.7.7'\n", "discovery-groups.dg.group-port", "missing"),
    (BASE + "[discovery-groups.dg]\ngroup-address = '231.7.7.7'\ngroup-port = 9876\nrefresh-timeout-ms = 0\n",
     "discovery-groups.dg.refresh-timeout-ms", "0 must be > 0"),
    (BASE + "[broadcast-groups.bg]\ngroup-address = '231.7.7.7'\ngroup-port = 9876\nlocal-bind-port = -2\n",
     "broadcast-groups.bg.local-bind-port", "-2 must be >= -1"),
    (BASE + "[broadcast-groups.bg]\ngroup-address = '231.7.7.7'\ngroup-port = 9876\nconnectors = ['amqp://h']\n",
     "broadcast-groups.bg.connectors[0]", "'amqp://h'"),
    (BASE + "[broadcast-groups.bg]\ngroup-address = '231.7.7.7'\ngroup-port = 9876\nperiod = 5\n",
     "broadcast-groups.bg.period", "unknown key"),
    (CLUSTER + "discovery-group = 'dg'\nstatic-connectors = ['amqp://h:1']\n", "cluster.discovery-group",
     "'dg': set discovery-group or static-connectors, not both"),
    (CLUSTER + "conector = 'amqp://h:1'\n", "cluster.conector", "unknown key (value 'amqp://h:1')"),
    (CLUSTER + "message-load-balancing = 'on_demand'\n", "cluster.message-load-balancing",
     "'on_demand' must be one of OFF, STRICT, ON_DEMAND, OFF_WITH_REDISTRIBUTION"),
    (CLUSTER + "message-load-balancing = 1\n", "cluster.message-load-balancing", "1 must be a string"),
    (CLUSTER + "max-hops = -1\n", "cluster.max-hops", "-1 must be >= 0"),
    (CLUSTER + "max-hops = 1.5\n", "cluster.max-hops", "1.5 must be an integer"),
    (CLUSTER + "max-hops = true\n", "cluster.max-hops", "True must be an integer"),
    (CLUSTER + "name = ''\n", "cluster.name", "'' must not be empty"),
    (CLUSTER + "user = ''\n", "cluster.user", "'' must not be empty"),
    (CLUSTER + "password = 1\n", "cluster.password", "1 must be a string"),
    (CLUSTER + "address = ['a']\n", "cluster.address", "['a'] must be a string"),
    (CLUSTER + "retry-interval-ms = -1\n", "cluster.retry-interval-ms", "-1 must be >= 0"),
    (CLUSTER + "retry-interval-ms = '500'\n", "cluster.retry-interval-ms", "'500' must be an integer"),
    (CLUSTER + "retry-interval-multiplier = 0.5\n", "cluster.retry-interval-multiplier", "0.5 must be >= 1.0"),
    (CLUSTER + "retry-interval-multiplier = inf\n", "cluster.retry-interval-multiplier", "inf must be a finite"),
    (CLUSTER + "retry-interval-multiplier = 'x'\n", "cluster.retry-interval-multiplier", "'x' must be a number"),
    (CLUSTER + "max-retry-interval-ms = -1\n", "cluster.max-retry-interval-ms", "-1 must be >= 0"),
    (CLUSTER + "initial-connect-attempts = -2\n", "cluster.initial-connect-attempts", "-2 must be >= -1"),
    (CLUSTER + "reconnect-attempts = -2\n", "cluster.reconnect-attempts", "-2 must be >= -1"),
    (CLUSTER + "check-period-ms = -1\n", "cluster.check-period-ms", "-1 must be >= 0"),
    (CLUSTER + "connection-ttl-ms = -1\n", "cluster.connection-ttl-ms", "-1 must be >= 0"),
    (CLUSTER + "call-timeout-ms = -1\n", "cluster.call-timeout-ms", "-1 must be >= 0"),
    (CLUSTER + "notification-interval-ms = 0\n", "cluster.notification-interval-ms", "0 must be > 0"),
    (CLUSTER + "notification-attempts = -1\n", "cluster.notification-attempts", "-1 must be >= 0"),
    (CLUSTER + "confirmation-window-bytes = -2\n", "cluster.confirmation-window-bytes", "-2 must be >= -1"),
    (CLUSTER + "duplicate-detection = 'yes'\n", "cluster.duplicate-detection", "'yes' must be true or false"),
    (CLUSTER + "id-cache-size = 0\n", "cluster.id-cache-size", "0 must be > 0"),
    (CLUSTER + "persist-id-cache = 1\n", "cluster.persist-id-cache", "1 must be true or false"),
    (CLUSTER + "allow-direct-connections-only = 0\n", "cluster.allow-direct-connections-only",
     "0 must be true or false"),
    (CLUSTER + "key = ''\n", "cluster.key", "'' must not be empty"),
    (CLUSTER + "key = 7\n", "cluster.key", "7 must be a string"),
    (CLUSTER + "require-client-key = true\n", "cluster.require-client-key", "true needs key"),
    (CLUSTER + "ca-file = 'nope.pem'\n", "cluster.ca-file", "nope.pem': no such file"),
    (CLUSTER + "max-state-bytes = 1023\n", "cluster.max-state-bytes", "1023 must be >= 1024"),
    # OpenAMQ's partitions
    (CLUSTER + "partition = 'root'\n", "cluster.partition", "'root' must be one of primary, secondary"),
    (CLUSTER + "partition = 'secondary'\n", "cluster.partition", "'secondary' needs primaries"),
    (CLUSTER + "primaries = ['amqp://h:1', 'amqp://h:1']\n", "cluster.primaries", "'amqp://h:1' is listed twice"),
    (CLUSTER + "primaries = ['amqp://h:1', 'amqp://h']\n", "cluster.primaries[1]", "'amqp://h' has no port"),
    (CLUSTER + "primaries = 'amqp://h:1'\n", "cluster.primaries", "must be an array"),
    (CLUSTER + "primaries = ['amqp://h:1', 'amqp://h:2']\n", "cluster.primaries",
     "does not name this node's connector 'amqp://127.0.0.1:15672'"),
    (BASE + "[cluster]\nconnector = 'amqp://127.0.0.1:0'\nprimaries = ['amqp://h:1']\n", "cluster.connector",
     "'amqp://127.0.0.1:0' has port 0: a defined primary is found in primaries by its connector"),
    (CLUSTER + "partition = 'secondary'\nprimaries = ['amqp://127.0.0.1:15672', 'amqp://h:2']\n", "cluster.partition",
     "'secondary', but this node's connector 'amqp://127.0.0.1:15672' is in primaries"),
    (CLUSTER + "partition = 'secondary'\nprimaries = ['amqp://h:1']\nstatic-connectors = ['amqp://h:1', 'amqp://s:2']\n",
     "cluster.static-connectors", "'amqp://s:2' is not a primary: a secondary connects to the primaries only"),
    (CLUSTER + "[addresses.work]\nshared = true\n", "addresses.work.shared",
     "true needs a cluster with a root ([cluster] primaries)"),
    (BASE + "[addresses.work]\nshared = true\n", "addresses.work.shared", "true needs a cluster with a root"),
    (CLUSTER + "primaries = ['amqp://127.0.0.1:15672']\n[addresses.work]\nrouting-types = ['multicast']\n"
               "shared = true\n", "addresses.work.shared", "true needs the anycast routing type"),
    (CLUSTER + "primaries = ['amqp://127.0.0.1:15672']\n[addresses.work]\nshared = 1\n", "addresses.work.shared",
     "1 must be true or false"),
    # [ha]
    (BASE + "[ha]\npolicy = 'replication'\n", "ha.policy",
     "'replication' needs a [cluster] table: the backup finds its primary through the cluster"),
    (BASE + "[ha]\npolicy = 'primary'\n", "ha.policy", "'primary' must be one of live-only"),
    (BASE + "[ha]\nscale-down = true\n", "ha.scale-down", "true needs a [cluster] table"),
    (CLUSTER + "[ha]\npolicy = 'shared-store'\nrole = 'primary'\nscale-down = true\n", "ha.scale-down",
     "scale-down from a shared-store primary is not supported (live-only nodes and backups scale down"),
    (BASE + "[ha]\nscale-down = true\nscale-down-connectors = ['amqp://h:1']\n", "ha.scale-down",
     "true needs a [cluster] table"),
    (BASE + "[ha]\nscale-down = 'yes'\n", "ha.scale-down", "'yes' must be true or false"),
    (BASE + "[ha]\nscale-down-group-name = ''\n", "ha.scale-down-group-name", "'' must not be empty"),
    (BASE + "[ha]\nscale-down-connectors = ['amqp://h:1', 'amqp://h']\n", "ha.scale-down-connectors[1]",
     "'amqp://h' has no port"),
    (BASE + "[ha]\nscale-down-group = 'x'\n", "ha.scale-down-group", "unknown key (value 'x')"),
    # redistribution-delay-ms
    (BASE + "[address-defaults]\nredistribution-delay-ms = -2\n", "address-defaults.redistribution-delay-ms",
     "-2 must be >= -1"),
    (BASE + "[address-settings.'orders.#']\nredistribution-delay-ms = '1s'\n",
     "address-settings.orders.#.redistribution-delay-ms", "'1s' must be an integer"),
    (BASE + "[address-settings.'orders.#']\nredistribution-delay = 0\n",
     "address-settings.orders.#.redistribution-delay", "unknown key (value 0)"),
]


@pytest.mark.parametrize("body,path,fragment", BAD)
def test_errors_name_file_key_and_value(tmp_path, body, path, fragment):
    p = write(tmp_path, body)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    err = ei.value
    assert err.file == str(p) and err.path == path, str(err)
    assert str(err).startswith(f"{p}: {path}: ") and fragment in err.message, str(err)


# -- the cluster address filter (Artemis cluster-connection <address>) -------------------------------

@pytest.mark.parametrize("text,expected", [
    ("", ((), ())),
    ("orders", (("orders",), ())),
    (" orders , events.  ,", (("orders", "events."), ())),
    ("!orders.audit", ((), ("orders.audit",))),
    ("orders, ! , !orders.audit, ,", (("orders",), ("orders.audit",))),
    ("!a,!b,c", (("c",), ("a", "b"))),
])
def test_parse_address_filter(text, expected):
    assert parse_address_filter(text) == expected


@pytest.mark.parametrize("text,address,clustered", [
    ("", "anything", True),                       # empty: every address
    ("  ,  ", "anything", True),
    ("orders", "orders.eu", True),                # prefixes, not words
    ("orders", "ordersx", True),
    ("orders", "billing", False),
    ("!orders.audit", "orders.eu", True),         # only exclusions: everything else is clustered
    ("!orders.audit", "orders.audit.x", False),
    ("orders, !orders.audit", "orders.audit", False),  # an exclusion wins over an inclusion
    ("!orders, orders", "orders.eu", False),
    (" orders ,  billing ", "billing.q", True),   # whitespace around entries is ignored
])
def test_address_clustered(text, address, clustered):
    inc, exc = parse_address_filter(text)
    assert address_clustered(address, inc, exc) == clustered
    assert ClusterConfig(connector="amqp://h:1", address=text).clusters(address) == clustered


@pytest.mark.parametrize("url,expected", [
    ("amqp://127.0.0.1:5672", Connector("amqp", "127.0.0.1", 5672)),
    ("amqps://node-1.example:5671/", Connector("amqps", "node-1.example", 5671)),
    ("amqp://[::1]:0", Connector("amqp", "::1", 0)),
])
def test_parse_connector(url, expected):
    c = parse_connector(url)
    assert c == expected and c.tls == (c.scheme == "amqps")
    assert parse_connector(str(c)) == c


def test_broadcast_and_discovery_groups(tmp_path):
    from broker.cluster.settings import BroadcastGroupConfig, DiscoveryGroupConfig
    cfg = load_config(write(tmp_path, BASE + """
[broadcast-groups.bg]
group-address = "231.7.7.7"
group-port = 9876
local-bind-address = "127.0.0.1"
broadcast-period-ms = 500
connectors = ["amqp://127.0.0.1:5672"]

[discovery-groups.dg]
group-address = "231.7.7.7"
group-port = 9876
refresh-timeout-ms = 3000

[cluster]
connector = "amqp://127.0.0.1:15672"
discovery-group = "dg"
"""))
    assert cfg.broadcast_groups == (BroadcastGroupConfig("bg", "231.7.7.7", 9876, "127.0.0.1", -1, 500,
                                                         ("amqp://127.0.0.1:5672",)),)
    assert cfg.discovery_groups == (DiscoveryGroupConfig("dg", "231.7.7.7", 9876, "0.0.0.0", 3000, 10000),)
    assert cfg.cluster.discovery_group == "dg" and cfg.cluster.static_connectors == ()
