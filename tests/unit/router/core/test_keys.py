"""Key resolution in Lodestone mode (Artemis mode is covered row by row by the vectors)."""

from __future__ import annotations

import pytest

from router.core.filters import compile_key_filter, compile_local_filter
from router.core.keys import (ConnectionInfo, KeyResolver, KeyType, artemis_source_key,
                              lodestone_source_key)
from router.errors import FilterError


@pytest.mark.parametrize("source,key", [
    ("10.0.0.7:5672", "10.0.0.7"),
    ("[::1]:5672", "::1"),
    ("[2001:db8:0:0:0:0:0:1]:443", "2001:db8::1"),
    ("[fe80::1%eth0]:5672", "fe80::1%eth0"),
    ("[::ffff:10.0.0.1]:5672", "10.0.0.1"),
    ("10.0.0.7", "10.0.0.7"),
    ("2001:db8::1", "2001:db8::1"),
    ("localhost:1", "localhost"),
    ("", ""),
])
def test_lodestone_source_key(source, key):
    assert lodestone_source_key(source) == key


@pytest.mark.parametrize("source,key", [
    ("[::1]:5672", "[0:0:0:0:0:0:0:1]"),
    ("10.0.0.7:5672", "10.0.0.7"),
    ("/10.0.0.1:1", "10.0.0.1"),
    ("invm:0", "invm"),
    ("[2001:db8::abcd]:1", "[2001:db8:0:0:0:0:0:abcd]"),
])
def test_artemis_source_key(source, key):
    assert artemis_source_key(source) == key


def test_key_types_and_null():
    c = ConnectionInfo(source="10.1.2.3:999", sni_host="Broker.Example.COM", container_id="cid",
                       user="alice", roles=("admin", "eu"))
    assert KeyResolver(KeyType.SOURCE_IP).resolve(c) == ("10.1.2.3", "10.1.2.3")
    assert KeyResolver(KeyType.SNI_HOST).resolve(c) == ("broker.example.com",
                                                         "broker.example.com")
    assert KeyResolver(KeyType.CLIENT_ID).resolve(c) == ("cid", "cid")
    assert KeyResolver(KeyType.USER_NAME).resolve(c) == ("alice", "alice")
    assert KeyResolver(KeyType.ROLE_NAME).resolve(c) == ("admin", "admin")
    empty = ConnectionInfo(source="10.1.2.3:999")
    for kt in KeyType:
        if kt is not KeyType.SOURCE_IP:
            assert KeyResolver(kt).resolve(empty)[1] == "NULL"


def test_key_filter_keeps_whole_match_and_null_on_miss():
    c = ConnectionInfo(source="1.1.1.1:1", container_id="EQ_PRODUCER-7")
    r = KeyResolver(KeyType.CLIENT_ID, compile_key_filter("EQ_(.*)-"))
    assert r.resolve(c)[1] == "EQ_PRODUCER-"  # group 0, not group 1
    r = KeyResolver(KeyType.CLIENT_ID, compile_key_filter("^zzz"))
    assert r.resolve(c) == ("EQ_PRODUCER-7", "NULL")


def test_role_filter_selects_first_listed_role_and_trims():
    c = ConnectionInfo(source="1.1.1.1:1", roles=("guest", "EQ_CONSUMER", "EQ_PRODUCER"))
    r = KeyResolver(KeyType.ROLE_NAME, compile_key_filter("(?<=^EQ_).*"))
    assert r.resolve(c) == ("EQ_CONSUMER", "CONSUMER")
    r = KeyResolver(KeyType.ROLE_NAME, compile_key_filter("B"))
    assert r.resolve(c)[1] == "NULL"


def test_key_type_parse_and_filters():
    with pytest.raises(ValueError, match="CLIENT_ID, SNI_HOST, SOURCE_IP, USER_NAME, ROLE_NAME"):
        KeyType.parse("client_id")
    assert compile_key_filter("  ") is None and compile_key_filter(None) is None
    assert compile_local_filter("  ") is None
    assert compile_local_filter("", from_config=True).matches("")
    assert not compile_local_filter("", from_config=True).matches("x")
    assert compile_key_filter(r"\d+").find("x\u0663\u0664 12") == "12"  # Java \d is ASCII
    with pytest.raises(FilterError, match="invalid regular expression"):
        compile_key_filter("(")
