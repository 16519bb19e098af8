"""``[broker-connections.<name>]``: the URI with its alternates (pure) and the config's errors."""

from __future__ import annotations

import pytest

from broker.config import load_config
from broker.connections.settings import AddressFilter, MirrorConfig, parse_uri
from broker.wire.io.tomlconfig import ConfigError
from tests.brokerproc import write_config


@pytest.mark.parametrize("text, want", [
    ("amqp://a:5672", ("amqp://a:5672",)),
    ("tcp://ServerA:5672#BackupA:5672,BackupB:5673", ("amqp://ServerA:5672", "amqp://BackupA:5672",
                                                      "amqp://BackupB:5673")),
    ("amqp://a:5672#amqp://b:5672,c:5672", ("amqp://a:5672", "amqp://b:5672", "amqp://c:5672")),
    ("amqps://a#b", ("amqps://a:5671", "amqps://b:5671")),          # the first URI's scheme, its port
    ("amqp://[::1]:5672#[fe80::1]:6000", ("amqp://[::1]:5672", "amqp://[fe80::1]:6000")),
    ("AMQP://h:1/?x=1", ("amqp://h:1",)),
])
def test_uris_and_alternates(text, want):
    assert parse_uri(text) == want


@pytest.mark.parametrize("text, says", [
    ("a:5672", "needs a scheme"),
    ("http://a:1", "not one of"),
    ("amqp://a:0", "must be 1-65535"),
    ("amqp://a:x", "must be 1-65535"),
    ("amqp://a:1#", "an empty host"),
    ("amqp://a:1#b:2,b:2", "listed twice"),
    ("amqp://user@a:1", "no user"),
    ("amqp://::1:5672", "brackets"),
])
def test_bad_uris_say_why(text, says):
    with pytest.raises(ValueError, match=says):
        parse_uri(text)


def _load(tmp_path, extra: str):
    path = write_config(tmp_path)
    path.write_text(path.read_text() + "\n" + extra)
    return load_config(path)


def test_a_connection_with_senders_and_receivers(tmp_path):
    cfg = _load(tmp_path, '[broker-connections.dc2]\nuri = "tcp://b:5672#c:5672"\nuser = "bridge"\n'
                          'password = "s3cret"\nretry-interval-ms = 100\nreconnect-attempts = 3\nauto-start = false\n'
                          '[[broker-connections.dc2.senders]]\naddress-match = "orders.#"\n'
                          '[[broker-connections.dc2.receivers]]\nqueue-name = "inbound"\n'
                          'remote-address = "/amq/queue/inbound"\n')
    (c,) = cfg.broker_connections
    assert c.name == "dc2" and c.uris == ("amqp://b:5672", "amqp://c:5672") and c.uri == "amqp://b:5672#amqp://c:5672"
    assert c.credentials == ("bridge", "s3cret") and c.retry_interval_ms == 100 and c.reconnect_attempts == 3
    assert not c.auto_start
    assert c.senders[0].address_match == "orders.#" and c.senders[0].queue_name is None
    assert c.receivers[0].queue_name == "inbound" and c.receivers[0].remote_address == "/amq/queue/inbound"


def test_defaults_are_artemis_defaults(tmp_path):
    (c,) = _load(tmp_path, '[broker-connections.x]\nuri = "amqp://h:5672"\n').broker_connections
    assert (c.retry_interval_ms, c.reconnect_attempts, c.auto_start, c.credentials) == (5000, -1, True, None)


@pytest.mark.parametrize("extra, key, says", [
    ('uri = "h:1"', "broker-connections.x.uri", "needs a scheme"),
    ('uri = "amqp://h:1"\npassword = "p"', "broker-connections.x.password", "without a user"),
    ('uri = "amqp://h:1"\nretry-interval-ms = 0', "broker-connections.x.retry-interval-ms", ""),
    ('uri = "amqp://h:1"\nreconnect-attempts = -2', "broker-connections.x.reconnect-attempts", ""),
    ('uri = "amqp://h:1"\nmirror-everything = true', "broker-connections.x.mirror-everything", ""),
    ('uri = "amqp://h:1"\n[[broker-connections.x.senders]]\nremote-address = "q"',
     "broker-connections.x.senders[0]", "exactly one of"),
    ('uri = "amqp://h:1"\n[[broker-connections.x.senders]]\nqueue-name = "q"\naddress-match = "a"',
     "broker-connections.x.senders[0]", "exactly one of"),
    ('uri = "amqp://h:1"\n[[broker-connections.x.senders]]\naddress-match = "a.#.#b"',
     "broker-connections.x.senders[0].address-match", ""),
    ('uri = "amqp://h:1"\n[[broker-connections.x.senders]]\nqueue-name = "q"\n'
     '[[broker-connections.x.receivers]]\nqueue-name = "q"', "broker-connections.x.receivers[0]", "loop"),
    ('uri = "amqp://h:1"\n[broker-connections.x.mirror]\naddress-filter = "a,!"',
     "broker-connections.x.mirror.address-filter", "needs a prefix"),
    ('uri = "amqp://h:1"\n[broker-connections.x.mirror]\ndurable = "yes"', "broker-connections.x.mirror.durable", ""),
    ('uri = "amqp://h:1"\n[broker-connections.x.mirror]\nsync = "yes"', "broker-connections.x.mirror.sync", ""),
    ('uri = "amqp://h:1"\n[broker-connections.x.mirror]\ninitial-sync = 1',
     "broker-connections.x.mirror.initial-sync", ""),
])
def test_a_bad_connection_names_file_key_and_value(tmp_path, extra, key, says):
    with pytest.raises(ConfigError) as raised:
        _load(tmp_path, "[broker-connections.x]\n" + extra + "\n")
    text = str(raised.value)
    assert key in text and says in text and "broker.toml" in text


def test_a_mirror_s_keys_and_artemis_defaults(tmp_path):
    (c,) = _load(tmp_path, '[broker-connections.dr]\nuri = "amqp://h:5672"\n[broker-connections.dr.mirror]\n'
                           ).broker_connections
    assert c.mirror == MirrorConfig(True, True, True, AddressFilter(), True, False, False)
    (c,) = _load(tmp_path, '[broker-connections.dr]\nuri = "amqp://h:5672"\n[broker-connections.dr.mirror]\n'
                           'message-acknowledgements = false\nqueue-creation = false\nqueue-removal = false\n'
                           'durable = false\naddress-filter = "orders, !orders.secret ,audit"\nsync = true\n'
                           'initial-sync = true\n').broker_connections
    m = c.mirror
    assert (m.message_acknowledgements, m.queue_creation, m.queue_removal, m.durable, m.sync, m.initial_sync) == (
        False, False, False, False, True, True)
    assert m.address_filter == AddressFilter(("orders", "audit"), ("orders.secret",))
    assert _load(tmp_path, '[broker-connections.x]\nuri = "amqp://h:1"\n').broker_connections[0].mirror is None


@pytest.mark.parametrize("text, address, allowed", [
    ("", "anything", True),
    ("orders", "orders.eu", True), ("orders", "audit", False),
    ("!audit", "orders", True), ("!audit", "audit.x", False),
    ("orders,!orders.secret", "orders.secret.x", False), ("orders,!orders.secret", "orders.public", True),
    ("!orders.secret,orders", "orders.secret", False),       # an exclusion wins, wherever it is listed
])
def test_the_address_filter(text, address, allowed):
    assert AddressFilter.parse(text).allows(address) is allowed
