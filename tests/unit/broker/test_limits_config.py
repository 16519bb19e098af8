"""Config of the resource limits, PROXY protocol and /metrics keys: defaults, overrides, and errors
naming file, key and value (broker TOML and router TOML)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from broker.config import ResourceLimits, load_config
from broker.wire.io.tomlconfig import ConfigError
from router.config import load_router_config
from tests.unit.router.test_router_config import MINIMAL
from tests.unit.router.test_router_config import write as write_router

BASE = """
[acceptors.amqp]
port = 0
"""


def write(tmp_path: Path, body: str) -> Path:
    (tmp_path / "users.toml").write_text("")
    p = tmp_path / "broker.toml"
    p.write_text(body)
    return p


def test_defaults_are_bounded(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.limits.for_user("anyone") == ResourceLimits(max_connections=1000, max_queues=10000)
    assert (cfg.max_sessions, cfg.max_links) == (256, 1000)
    assert cfg.management.metrics_auth is True and cfg.management.metrics_cache_ms == 1000
    assert cfg.acceptors[0].proxy_protocol_from == () and not cfg.acceptors[0].trusts_proxy("127.0.0.1")


def test_user_tables_override_the_defaults_key_by_key(tmp_path):
    cfg = load_config(write(tmp_path, BASE + """
[amqp]
max-sessions = 8
max-links = 64
[resource-limit-defaults]
max-queues = 50
[resource-limits.alice]
max-connections = 5
[resource-limits."bob.smith"]
max-queues = -1
[management]
metrics-auth = false
metrics-cache-ms = 0
"""))
    assert cfg.limits.for_user("alice") == ResourceLimits(5, 50)
    assert cfg.limits.for_user("bob.smith") == ResourceLimits(1000, -1)
    assert cfg.limits.for_user("bob") == ResourceLimits(1000, 50)  # exact match only, as in Artemis
    assert cfg.limits.for_user(None) == ResourceLimits(1000, 50)
    assert (cfg.max_sessions, cfg.max_links) == (8, 64)
    assert cfg.management.metrics_auth is False and cfg.management.metrics_cache_ms == 0


def test_proxy_protocol_from(tmp_path):
    cfg = load_config(write(tmp_path, BASE + 'proxy-protocol-from = ["10.1.0.0/16", "::1", "127.0.0.1/32"]\n'))
    acc = cfg.acceptors[0]
    assert acc.proxy_protocol_from[0] == ipaddress.ip_network("10.1.0.0/16")
    assert acc.trusts_proxy("10.1.200.3") and acc.trusts_proxy("::1") and acc.trusts_proxy("::ffff:127.0.0.1")
    assert not acc.trusts_proxy("10.2.0.1") and not acc.trusts_proxy("garbage")


@pytest.mark.parametrize("extra, path, msg", [
    ("[resource-limits.alice]\nmax-conections = 3\n", "resource-limits.alice.max-conections", "unknown key"),
    ("[resource-limit-defaults]\nmax-queues = -2\n", "resource-limit-defaults.max-queues", "-2 must be >= -1"),
    ("[resource-limit-defaults]\nmax-sessions = 2\n", "resource-limit-defaults.max-sessions", "unknown key"),
    ("[amqp]\nmax-sessions = 0\n", "amqp.max-sessions", "0 must be > 0"),
    ("[amqp]\nmax-links = 'many'\n", "amqp.max-links", "'many' must be an integer"),
    ("[management]\nmetrics-auth = 'yes'\n", "management.metrics-auth", "must be true or false"),
])
def test_errors_name_file_key_value(tmp_path, extra, path, msg):
    p = write(tmp_path, BASE + extra)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert ei.value.path == path and msg in ei.value.message, str(ei.value)
    assert str(ei.value).startswith(f"{p}: {path}: ")


def test_bad_proxy_network_is_named(tmp_path):
    p = write(tmp_path, BASE + 'proxy-protocol-from = ["127.0.0.1/33"]\n')
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert ei.value.path == "acceptors.amqp.proxy-protocol-from[0]" and "127.0.0.1/33" in ei.value.message


def test_router_upstream_proxy_protocol(tmp_path):
    acc = "[[acceptors]]\nname = 'a'\nport = 1\nrouter = 'r'\n"
    cfg = load_router_config(write_router(tmp_path, MINIMAL + "\n" + acc + "mode = 'proxy'\nupstream-proxy-protocol = true\n"))
    assert cfg.acceptors[0].upstream_proxy_protocol is True
    cfg = load_router_config(write_router(tmp_path, MINIMAL + "\n" + acc + "mode = 'proxy'\n"))
    assert cfg.acceptors[0].upstream_proxy_protocol is False
    with pytest.raises(ConfigError) as ei:
        load_router_config(write_router(tmp_path, MINIMAL + "\n" + acc + "upstream-proxy-protocol = true\n"))
    assert ei.value.path == "acceptors[0].upstream-proxy-protocol" and "proxy" in ei.value.message
    cfg = load_router_config(write_router(tmp_path, MINIMAL + "\n" + acc + "mode = 'auto'\nupstream-proxy-protocol = true\n"))
    assert (cfg.acceptors[0].mode, cfg.acceptors[0].upstream_proxy_protocol) == ("auto", True)
