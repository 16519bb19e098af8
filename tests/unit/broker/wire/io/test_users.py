"""Unit tests of broker/wire/io/users.py: users file, authentication, Artemis wildcard permissions."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import pytest

from broker.__main__ import hash_password_main
from broker.wire.io.users import (Principal, SecurityConfig, hash_password,
                                  load_users, match_specificity, parse_source_ip, verify_password,
                                  wildcard_match)
from broker.wire.io.tomlconfig import ConfigError
from tests.paths import REPO

FAST = dict(n=1024, r=8, p=1)          # cheap hashes for tests; the real default is n=16384


# -- wildcard matcher -----------------------------------------------------------------------------

@pytest.mark.parametrize("pattern,address,expected", [
    ("#", "", True),
    ("#", "orders", True),
    ("#", "orders.eu.paris", True),
    ("orders", "orders", True),
    ("orders", "orders.eu", False),
    ("orders", "order", False),
    ("orders.#", "orders", True),            # '#' matches zero words
    ("orders.#", "orders.eu", True),
    ("orders.#", "orders.eu.paris", True),
    ("orders.#", "ordersx", False),
    ("orders.#", "events.orders", False),
    ("orders.*", "orders", False),           # '*' matches exactly one word
    ("orders.*", "orders.eu", True),
    ("orders.*", "orders.eu.paris", False),
    ("*.eu", "orders.eu", True),
    ("*.eu", "eu", False),
    ("*", "orders", True),
    ("*", "orders.eu", False),
    ("#.paris", "paris", True),
    ("#.paris", "orders.eu.paris", True),
    ("#.paris", "orders.paris.eu", False),
    ("a.#.z", "a.z", True),
    ("a.#.z", "a.b.c.z", True),
    ("a.#.z", "a.b.c", False),
    ("a.*.#", "a", False),
    ("a.*.#", "a.b", True),
    ("#.#", "a.b", True),
    ("a.b", "a.b.", False),
    ("sys.*.queue", "sys.x.queue", True),
])
def test_wildcard_match(pattern, address, expected):
    assert wildcard_match(pattern, address) is expected


@pytest.mark.parametrize("more,less", [
    ("orders.eu", "orders.*"),
    ("orders.*", "orders.#"),
    ("orders.#", "*.eu"),          # left-most word decides: literal beats '*'
    ("*.eu", "#"),
    ("orders", "orders.#"),        # a trailing '#' that matches nothing adds nothing
    ("#.eu", "#"),                 # longer beats shorter
    ("orders.eu.#", "orders.#"),
    ("*.*", "*.#"),
])
def test_specificity_order(more, less):
    assert match_specificity(more) > match_specificity(less)


# -- users file -----------------------------------------------------------------------------------

def write_users(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "users.toml"
    p.write_text(textwrap.dedent(body))
    return p


@pytest.fixture(scope="module")
def hashes():
    return {name: hash_password(name + "-pw", **FAST) for name in ("alice", "bob", "carol", "svc")}


@pytest.fixture()
def sec(tmp_path, hashes) -> SecurityConfig:
    return load_users(write_users(tmp_path, f"""
        [users.alice]
        password = "{hashes['alice']}"
        roles = ["admin", "ops"]
        [users.bob]
        password = "{hashes['bob']}"
        roles = ["app"]
        sample = true
        [users.carol]
        password = "{hashes['carol']}"
        roles = ["app"]
        sources = ["10.1.0.0/16", "fd00::/8"]
        [users.svc]
        password = "{hashes['svc']}"
        roles = ["reader"]
        sample = true
        sources = ["127.0.0.2/32"]

        [anonymous]
        enabled = true
        user = "guest"
        roles = ["guest"]

        [[permissions]]
        match = "#"
        send = ["admin"]
        consume = ["admin"]
        manage = ["admin"]
        [[permissions]]
        match = "orders.#"
        send = ["app", "admin"]
        consume = ["app"]
        create-address = ["app"]
        [[permissions]]
        match = "orders.*"
        consume = ["reader"]
        [[permissions]]
        match = "orders.secret"
        [[permissions]]
        match = "orders.*"
        consume = ["never-used: the first of equal patterns wins"]
        [[permissions]]
        match = "*.public"
        send = ["guest"]
        consume = ["guest"]
    """))


@pytest.mark.parametrize("user,password,source,expected", [
    ("alice", "alice-pw", "10.9.9.9", ("alice", ("admin", "ops"))),
    ("alice", "alice-pw", "[2001:db8::1]:5671", ("alice", ("admin", "ops"))),
    ("alice", "wrong", "127.0.0.1", None),                       # wrong password
    ("alice", "", "127.0.0.1", None),
    ("mallory", "alice-pw", "127.0.0.1", None),                  # unknown user
    ("ALICE", "alice-pw", "127.0.0.1", None),                    # names are case-sensitive
    ("bob", "bob-pw", "127.0.0.1", ("bob", ("app",))),           # sample user from loopback
    ("bob", "bob-pw", "127.8.8.8:40000", ("bob", ("app",))),
    ("bob", "bob-pw", "::1", ("bob", ("app",))),                 # IPv6 loopback accepted
    ("bob", "bob-pw", "[::1]:5672", ("bob", ("app",))),
    ("bob", "bob-pw", "::ffff:127.0.0.1", ("bob", ("app",))),    # IPv4-mapped loopback
    ("bob", "bob-pw", "192.168.1.20", None),                     # sample user from the network
    ("bob", "bob-pw", "10.0.0.1:5672", None),
    ("bob", "bob-pw", "[2001:db8::1]:5672", None),
    ("bob", "bob-pw", None, None),                               # unknown source
    ("bob", "bob-pw", "not-an-ip", None),
    ("carol", "carol-pw", "10.1.2.3", ("carol", ("app",))),      # inside her allow-list
    ("carol", "carol-pw", "[fd00::7]:1", ("carol", ("app",))),
    ("carol", "carol-pw", "10.2.0.1", None),                     # outside it
    ("carol", "carol-pw", "127.0.0.1", None),
    ("svc", "svc-pw", "127.0.0.2", ("svc", ("reader",))),        # sample AND sources
    ("svc", "svc-pw", "127.0.0.1", None),
])
def test_authenticate(sec, user, password, source, expected):
    got = sec.authenticate(user, password, source)
    assert got == (Principal(*expected) if expected else None)


def test_successful_verifications_are_cached(sec):
    assert sec.authenticate("alice", "alice-pw", "127.0.0.1")
    calls = sec.scrypt_calls
    for _ in range(5):
        assert sec.authenticate("alice", "alice-pw", "127.0.0.1")
    assert sec.scrypt_calls == calls
    # a failure is never cached, and the cache never bypasses the source rules
    assert sec.authenticate("alice", "nope", "127.0.0.1") is None
    assert sec.authenticate("alice", "nope", "127.0.0.1") is None
    assert sec.scrypt_calls == calls + 2
    assert sec.authenticate("bob", "bob-pw", "127.0.0.1")
    assert sec.authenticate("bob", "bob-pw", "10.0.0.1") is None


def test_verified_logins_are_handed_over_and_adopted_without_a_hash(tmp_path, hashes, sec):
    """An HA backup adopts the logins its primary verified (broker.ha.replication, LOGINS): a
    failed-over client logs in without scrypt, the source rules still apply, and a user whose
    stored hash differs on the backup is not adopted (its password there is another)."""
    assert sec.authenticate("alice", "alice-pw", "127.0.0.1")
    assert sec.authenticate("bob", "bob-pw", "127.0.0.1")
    mark, entries = sec.verified_logins()
    assert [e[0] for e in entries] == ["alice", "bob"] and all(len(e[1]) == 32 and len(e[2]) == 16 for e in entries)
    assert sec.verified_logins(mark) == (mark, [])                    # nothing new since
    other = hash_password("bob-other", **FAST)
    (tmp_path / "b").mkdir()
    backup = load_users(write_users(tmp_path / "b", f"""
        [users.alice]
        password = "{hashes['alice']}"
        roles = ["admin", "ops"]
        [users.bob]
        password = "{other}"
        roles = ["app"]
        """))
    assert backup.adopt_logins(entries) == 1 and backup.logins_adopted == 1
    assert backup.authenticate("alice", "alice-pw", "127.0.0.1") == Principal("alice", ("admin", "ops"))
    assert backup.scrypt_calls == 0
    assert backup.authenticate("alice", "alice-pw", None) is not None      # (any source: no rule for alice)
    assert backup.authenticate("bob", "bob-pw", "127.0.0.1") is None      # bob's password is another here
    assert backup.scrypt_calls == 1
    # adopted logins are handed on in turn (a failback copies them back)
    _m, again = backup.verified_logins()
    assert [e[0] for e in again] == ["alice"]


def test_adopted_logins_keep_the_source_rules(tmp_path, hashes, sec):
    assert sec.authenticate("bob", "bob-pw", "127.0.0.1")           # bob: sample, loopback only
    _m, entries = sec.verified_logins()
    (tmp_path / "b").mkdir()
    backup = load_users(write_users(tmp_path / "b", f"""
        [users.bob]
        password = "{hashes['bob']}"
        roles = ["app"]
        sample = true
        """))
    assert backup.adopt_logins(entries) == 1
    assert backup.authenticate("bob", "bob-pw", "127.0.0.1") is not None and backup.scrypt_calls == 0
    assert backup.authenticate("bob", "bob-pw", "10.0.0.1") is None      # the source rule still holds
    calls = backup.scrypt_calls
    assert backup.authenticate("bob", "wrong", "127.0.0.1") is None and backup.scrypt_calls == calls + 1


def test_certificate_and_anonymous_principals(sec):
    assert sec.principal_for_certificate("alice", "10.0.0.5") == Principal("alice", ("admin", "ops"))
    assert sec.principal_for_certificate("nobody", "127.0.0.1") is None
    assert sec.principal_for_certificate("bob", "10.0.0.5") is None        # sample: loopback only
    assert sec.principal_for_certificate("carol", "10.1.0.1") == Principal("carol", ("app",))
    assert sec.anonymous_principal() == Principal("guest", ("guest",))


def test_warnings_name_each_sample_user(sec):
    assert sec.warnings() == [
        "users.toml: user 'bob' has sample credentials; accepted from loopback only",
        "users.toml: user 'svc' has sample credentials; accepted from loopback only",
    ]


ALICE = Principal("alice", ("admin", "ops"))
BOB = Principal("bob", ("app",))
SVC = Principal("svc", ("reader",))
GUEST = Principal("guest", ("guest",))


@pytest.mark.parametrize("principal,permission,address,expected", [
    (ALICE, "send", "anything", True),                # '#'
    (ALICE, "manage", "activemq.management", True),
    (BOB, "manage", "activemq.management", False),
    (BOB, "send", "anything", False),
    (BOB, "send", "orders", True),                    # orders.# (zero words)
    (BOB, "send", "orders.eu.paris", True),
    (BOB, "createAddress", "orders.new.x", True),
    (BOB, "create-address", "orders.new.x", True),    # TOML spelling accepted
    (BOB, "deleteAddress", "orders.new.x", False),
    (ALICE, "send", "orders.eu.x", True),             # orders.# lists admin for send
    (ALICE, "send", "orders.eu", False),              # ...but orders.* governs two words
    (ALICE, "consume", "orders.eu.x", False),         # most specific wins: no merge with '#'
    (BOB, "consume", "orders.eu", False),             # orders.* beats orders.#
    (SVC, "consume", "orders.eu", True),
    (SVC, "consume", "orders.eu.x", False),           # orders.* does not match 3 words
    (ALICE, "send", "orders.secret", False),          # literal entry with no roles
    (BOB, "send", "orders.secret", False),
    (GUEST, "send", "news.public", True),
    (GUEST, "send", "orders.public", False),          # orders.* beats *.public (left word)
    (GUEST, "send", "news", False),
    (None, "send", "news.public", False),
])
def test_check(sec, principal, permission, address, expected):
    assert sec.check(principal, permission, address) is expected


def test_check_rejects_unknown_permission(sec):
    with pytest.raises(ValueError, match="unknown permission 'browse'"):
        sec.check(ALICE, "browse", "x")


def test_no_matching_entry_denies(tmp_path, hashes):
    s = load_users(write_users(tmp_path, f"""
        [users.alice]
        password = "{hashes['alice']}"
        roles = ["admin"]
        [[permissions]]
        match = "orders"
        send = ["admin"]
    """))
    assert s.check(Principal("alice", ("admin",)), "send", "orders")
    assert not s.check(Principal("alice", ("admin",)), "send", "orders.eu")
    assert s.anonymous_principal() is None and s.warnings() == []


# -- config errors --------------------------------------------------------------------------------

@pytest.mark.parametrize("body,message", [
    ('[users.a]\nroles = ["x"]\n', "users.a.password: missing (required)"),
    ('[users.a]\npassword = "plaintext"\n', "users.a.password: 'plaintext': not a scrypt hash"),
    ('[users.a]\npassword = "scrypt$n=1000,r=8,p=1$AAAAAAAAAAA=$AAAAAAAAAAAAAAAAAAAAAA=="\n',
     "users.a.password: 'scrypt$n=1000,r=8,p=1$AAAAAAAAAAA=$AA...': scrypt n=1000 must be a power of two"),
    ('[users.a]\npassword = "{h}"\nrole = ["x"]\n', "users.a.role: unknown key"),
    ('[users.a]\npassword = "{h}"\nroles = "admin"\n', "users.a.roles: 'admin' must be an array"),
    ('[users.a]\npassword = "{h}"\nsample = "yes"\n', "users.a.sample: 'yes' must be true or false"),
    ('[users.a]\npassword = "{h}"\nsources = ["10.0.0.0/33"]\n',
     "users.a.sources[0]: '10.0.0.0/33' is not a network"),
    ('[anonymous]\nenabled = 1\n', "anonymous.enabled: 1 must be true or false"),
    ('[[permissions]]\nsend = ["a"]\n', "permissions[0].match: missing (required)"),
    ('[[permissions]]\nmatch = "ord*"\n', "permissions[0].match: wildcards must be whole words"),
    ('[[permissions]]\nmatch = "#"\nbrowse = ["a"]\n', "permissions[0].browse: unknown key"),
    ('[user.a]\n', "user: unknown key"),
    ('[users.a\n', "invalid TOML"),
])
def test_config_errors_name_file_key_value(tmp_path, hashes, body, message):
    p = write_users(tmp_path, body.replace("{h}", hashes["alice"]))
    with pytest.raises(ConfigError) as ei:
        load_users(p)
    assert str(ei.value).startswith(f"{p}: "), str(ei.value)
    assert message in str(ei.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_users(tmp_path / "absent.toml")


# -- passwords and the shipped file ---------------------------------------------------------------

def test_hash_format_and_verify():
    h = hash_password("s3cret", **FAST)
    assert h.startswith("scrypt$n=1024,r=8,p=1$")
    assert verify_password(h, "s3cret") and not verify_password(h, "s3cret ")
    assert hash_password("s3cret", **FAST) != h                  # random salt
    assert hash_password("pw").startswith("scrypt$n=16384,r=8,p=1$")


@pytest.mark.parametrize("source,expected", [
    ("127.0.0.1", "127.0.0.1"), ("127.0.0.1:5672", "127.0.0.1"), ("::1", "::1"),
    ("[::1]:5672", "::1"), ("[fe80::1%eth0]:1", "fe80::1"), ("::ffff:10.0.0.1", "10.0.0.1"),
    ("", None), (None, None), ("host.example:5672", None),
])
def test_parse_source_ip(source, expected):
    got = parse_source_ip(source)
    assert (str(got) if got is not None else None) == expected


def test_shipped_users_file():
    s = load_users(REPO / "etc" / "users.toml")
    admin = s.authenticate("admin", "admin", "127.0.0.1:40000")
    app = s.authenticate("app", "app", "[::1]:40000")
    assert admin == Principal("admin", ("admin", "amq")) and app == Principal("app", ("app",))
    assert s.authenticate("admin", "admin", "192.0.2.7:1") is None
    assert s.authenticate("app", "admin", "127.0.0.1") is None
    for perm in ("send", "consume", "createAddress", "deleteAddress", "manage"):
        assert s.check(admin, perm, "any.address"), perm
    assert s.check(app, "send", "q") and s.check(app, "consume", "q") and s.check(app, "createAddress", "q")
    assert not s.check(app, "deleteAddress", "q") and not s.check(app, "manage", "activemq.management")
    assert s.anonymous_principal() is None
    assert s.warnings() == [
        "users.toml: user 'admin' has sample credentials; accepted from loopback only",
        "users.toml: user 'app' has sample credentials; accepted from loopback only",
    ]


# -- CLI ------------------------------------------------------------------------------------------

def test_hash_password_cli_stdin(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("correct horse\n"))
    assert hash_password_main(["--stdin", "--n", "1024"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("scrypt$n=1024,r=8,p=1$") and verify_password(out, "correct horse")


@pytest.mark.parametrize("argv,stdin,err", [
    (["--stdin"], "\n", "empty password"),
    (["--stdin", "--n", "1000"], "pw\n", "power of two"),
    (["--bogus"], "", "unrecognized arguments"),
])
def test_hash_password_cli_errors(monkeypatch, capsys, argv, stdin, err):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert hash_password_main(argv) == 2
    assert err in capsys.readouterr().err


def test_cached_is_the_non_blocking_fast_path_of_authenticate(tmp_path):
    """`cached` answers only for logins verified before, from an allowed source, without scrypt."""
    from broker.wire.io.users import load_users

    sec = load_users(REPO / "etc" / "users.toml")
    assert sec.cached("app", "app", "127.0.0.1") is None          # never verified: not known
    assert sec.authenticate("app", "app", "127.0.0.1") is not None
    calls = sec.scrypt_calls
    p = sec.cached("app", "app", "127.0.0.1")
    assert p is not None and p.user == "app"
    assert sec.cached("app", "wrong", "127.0.0.1") is None        # another password: not known
    assert sec.cached("app", "app", "192.0.2.7") is None          # sample user off loopback: never
    assert sec.cached("nobody", "app", "127.0.0.1") is None
    assert sec.scrypt_calls == calls
