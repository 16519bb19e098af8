"""Broker config: the shipped files load; bad values name file, key and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.config import apply_overrides, check_anonymous, load_config
from broker.wire.io.tomlconfig import ConfigError
from tests.paths import REPO

ETC = REPO / "etc"


def write(tmp_path: Path, body: str) -> Path:
    (tmp_path / "users.toml").write_text("")
    p = tmp_path / "broker.toml"
    p.write_text(body)
    return p


BASE = """
[acceptors.amqp]
port = 0
"""


@pytest.mark.parametrize("name,amqp,mgmt", [
    ("broker.toml", 5672, 8161),
    ("broker-1.toml", 15672, 18161),
    ("broker-2.toml", 15673, 18162),
    ("broker-3.toml", 15674, 18163),
])
def test_shipped_configs_load(name, amqp, mgmt):
    cfg = load_config(ETC / name)
    assert cfg.acceptors[0].port == amqp and cfg.management.port == mgmt
    assert cfg.management.host == "127.0.0.1" and cfg.acceptors[0].host == "127.0.0.1"
    assert cfg.users_file == ETC / "users.toml"
    assert cfg.data_dir.resolve().parent == REPO / "var"


def test_defaults(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.data_dir == tmp_path / "data" and cfg.persistent
    assert cfg.acceptors[0].sasl_mechanisms == ("PLAIN",)
    s = cfg.settings.for_address("anything")
    assert (s.default_routing_type, s.auto_create, s.max_delivery_count, s.dead_letter_address) == \
        ("anycast", True, 10, "DLQ")
    assert cfg.journal.sync == "batch" and cfg.producer_window == 1000


@pytest.mark.parametrize("extra,path,fragment", [
    ("[acceptors.amqp]\nport = 70000", "acceptors.amqp.port", "70000 must be <= 65535"),
    ("[acceptors.amqp]\nport = 1\nsasl-mechanisms = ['CRAM']", "acceptors.amqp.sasl-mechanisms[0]", "'CRAM'"),
    ("[acceptors.amqp]\nport = 1\nsasl-mechanisms = ['EXTERNAL']", "acceptors.amqp.sasl-mechanisms", "EXTERNAL needs"),
    ("[acceptors.amqp]\nprot = 1", "acceptors.amqp.prot", "unknown key"),
    ("[acceptors.amqp]\nport = 1\n[address-defaults]\nmax-delivery-count = -1",
     "address-defaults.max-delivery-count", "-1 must be >= 0"),
    ("[acceptors.amqp]\nport = 1\n[address-defaults]\ndefault-routing-type = 'fanout'",
     "address-defaults.default-routing-type", "'fanout'"),
    ("[acceptors.amqp]\nport = 1\n[addresses.orders]\nrouting-types = ['both']",
     "addresses.orders.routing-types[0]", "'both'"),
    ("[acceptors.amqp]\nport = 1\n[journal]\nsync = 'sometimes'", "journal.sync", "'sometimes'"),
    ("[acceptors.amqp]\nport = 1\n[security]\nusers-file = 'nope.toml'", "security.users-file", "no such file"),
    ("[acceptors.amqp]\nport = 1\n[acceptors.amqp.tls]\ncert-file = 'x.pem'\nkey-file = 'x.pem'",
     "acceptors.amqp.tls.cert-file", "no such file"),
    ("[node]\nname = 'x'", "acceptors", "at least one"),
    ("[acceptors.amqp]\nport = 1\n[amqp]\nmax-frame-bytes = 100", "amqp.max-frame-bytes", "100 must be >= 512"),
    ("[acceptors.amqp]\nport = 1\n[amqp]\nhandshake-timeout-s = -1", "amqp.handshake-timeout-s", "-1"),
])
def test_errors_name_file_key_and_value(tmp_path, extra, path, fragment):
    p = write(tmp_path, extra)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    err = ei.value
    assert err.file == str(p) and err.path == path and fragment in str(err)
    assert str(err).startswith(f"{p}: {path}: ")


def test_anonymous_needs_the_users_file_to_enable_it(tmp_path):
    cfg = load_config(write(tmp_path, "[acceptors.amqp]\nport = 0\nsasl-mechanisms = ['PLAIN', 'ANONYMOUS']"))
    check_anonymous(cfg, True)
    with pytest.raises(ConfigError) as ei:
        check_anonymous(cfg, False)
    assert ei.value.path == "acceptors.amqp.sasl-mechanisms"


def test_overrides(tmp_path):
    cfg = apply_overrides(load_config(write(tmp_path, BASE)), amqp_port=1234, management_port=0,
                          data_dir=tmp_path / "d")
    assert cfg.acceptors[0].port == 1234 and cfg.management.port == 0 and cfg.data_dir == tmp_path / "d"


def test_address_settings_table(tmp_path):
    cfg = load_config(write(tmp_path, BASE + """
[address-defaults]
max-delivery-count = 5
[address-settings."events.#"]
default-routing-type = "multicast"
[address-settings."events.audit"]
dead-letter-address = ""
"""))
    assert cfg.settings.for_address("events.x").default_routing_type == "multicast"
    assert cfg.settings.for_address("events.x").max_delivery_count == 5  # inherits the defaults
    assert cfg.settings.for_address("events.audit").dead_letter_address is None


def test_address_settings_patterns_are_checked_like_permissions(tmp_path):
    """`ord#` is not a pattern (wildcards are whole words), in address settings as in the users file."""
    from broker.config import load_config

    p = tmp_path / "b.toml"
    users = REPO / "etc" / "users.toml"
    p.write_text(f'[security]\nusers-file = "{users}"\n[acceptors.amqp]\nport = 0\n'
                 '[address-settings."ord#"]\nmax-delivery-count = 3\n')
    with pytest.raises(ConfigError) as err:
        load_config(p)
    assert "address-settings.ord#" in str(err.value) and "whole words" in str(err.value)


def test_address_settings_and_permissions_rank_patterns_alike():
    from broker.core.addresses import AddressSettings, SettingsResolver
    from broker.wire.io.users import match_specificity

    patterns = ["#", "orders.#", "*.eu", "orders.*", "orders.eu"]
    resolver = SettingsResolver(AddressSettings(), tuple(
        (p, AddressSettings(max_delivery_count=i + 1)) for i, p in enumerate(patterns)))
    # "orders.eu" > "orders.*" > "orders.#" > "*.eu" > "#" for both
    assert resolver.for_address("orders.eu").max_delivery_count == 5
    assert sorted(patterns, key=match_specificity, reverse=True) == ["orders.eu", "orders.*", "orders.#", "*.eu", "#"]
    assert resolver.for_address("x.eu").max_delivery_count == 3
    assert resolver.for_address("orders.us").max_delivery_count == 4


def test_duplicate_detection_keys(tmp_path):
    """[node] id-cache-size / persist-id-cache / id-cache-max-ids, the per-address id-cache-size
    (inherited from [address-defaults]), and [cluster]'s keys defaulting to [node]'s."""
    cfg = load_config(write(tmp_path, BASE))
    assert (cfg.id_cache_size, cfg.persist_id_cache, cfg.id_cache_max_ids) == (20000, True, 1_000_000)
    assert cfg.settings.for_address("x").id_cache_size is None       # the node's
    cfg = load_config(write(tmp_path, """
[node]
id-cache-size = 7
persist-id-cache = false
id-cache-max-ids = 100
[acceptors.amqp]
port = 0
[address-defaults]
id-cache-size = 50
[address-settings."small.#"]
id-cache-size = 2
[address-settings."other.#"]
max-delivery-count = 3
[cluster]
connector = "amqp://127.0.0.1:0"
"""))
    assert (cfg.id_cache_size, cfg.persist_id_cache, cfg.id_cache_max_ids) == (7, False, 100)
    assert cfg.settings.for_address("small.a").id_cache_size == 2
    assert cfg.settings.for_address("other.a").id_cache_size == 50   # inherits [address-defaults]
    assert (cfg.cluster.id_cache_size, cfg.cluster.persist_id_cache) == (7, False)
    cfg = load_config(write(tmp_path, """
[node]
id-cache-size = 7
[acceptors.amqp]
port = 0
[cluster]
connector = "amqp://127.0.0.1:0"
id-cache-size = 9
"""))
    assert cfg.cluster.id_cache_size == 9 and cfg.id_cache_size == 7


@pytest.mark.parametrize("body, path, fragment", [
    ("[node]\nid-cache-size = 0\n", "node.id-cache-size", "0 must be > 0"),
    ("[node]\nid-cache-max-ids = -1\n", "node.id-cache-max-ids", "-1 must be > 0"),
    ("[node]\npersist-id-cache = 1\n", "node.persist-id-cache", "1"),
    ("[address-settings.\"a.#\"]\nid-cache-size = 0\n", "address-settings.a.#.id-cache-size", "0 must be > 0"),
])
def test_duplicate_detection_errors_name_file_key_and_value(tmp_path, body, path, fragment):
    p = write(tmp_path, BASE + body)
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert ei.value.path == path and fragment in str(ei.value)
