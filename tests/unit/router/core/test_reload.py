"""``router.core.reload.plan_reload``: a table of real configuration files (read by
``router.config.load_router_config``, as a reload reads them), each edit with the changes it must
report and whether each applies live. Expected answers are written by hand from the rules in
the module's docstring."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import load_router_config
from router.core.reload import plan_reload

BASE = """
name = "edge"
workers = 1
[management]
port = 0
user = "admin"
password = "admin"
[routing-log]
enabled = false
[[acceptors]]
name = "proxy"
port = 5672
router = "main"
mode = "proxy"
idle-timeout-s = 60
[[acceptors]]
name = "tls"
port = 5671
router = "main"
tls-cert = "cert.pem"
tls-key = "key.pem"
[routers.main]
key-type = "CLIENT_ID"
key-filter = "^app-"
[routers.main.policy]
name = "CONSISTENT_HASH"
[routers.main.cache]
timeout = 60000
[routers.main.pool]
check-period = 1000
username = "admin"
password = "secret-one"
[[routers.main.pool.targets]]
name = "b1"
host = "127.0.0.1"
port = 6001
[[routers.main.pool.targets]]
name = "b2"
host = "127.0.0.1"
port = 6002
"""

LIVE, REFUSED = True, False

# (what, old text -> new text replacements, {part: live})
CASES = [
    ("nothing", [], {}),
    ("a key filter", [('key-filter = "^app-"', 'key-filter = "^svc-"')], {"routers.main.key-filter": LIVE}),
    ("a filter removed", [('key-filter = "^app-"\n', "")], {"routers.main.key-filter": LIVE}),
    ("a target added",
     [("port = 6002\n", 'port = 6002\n[[routers.main.pool.targets]]\nname = "b3"\nhost = "127.0.0.1"\nport = 6003\n')],
     {"routers.main.pool.targets.b3": LIVE}),
    ("a target removed", [('[[routers.main.pool.targets]]\nname = "b2"\nhost = "127.0.0.1"\nport = 6002\n', "")],
     {"routers.main.pool.targets.b2": LIVE}),
    ("a target moved", [("port = 6002", "port = 7002")], {"routers.main.pool.targets.b2": LIVE}),
    ("a policy", [('name = "CONSISTENT_HASH"', 'name = "ROUND_ROBIN"')], {"routers.main.policy.name": LIVE}),
    ("the pool's check period and credentials",
     [("check-period = 1000", "check-period = 250"), ('password = "secret-one"', 'password = "secret-two"')],
     {"routers.main.pool.check-period": LIVE, "routers.main.pool.password": LIVE}),
    ("the cache's timeout", [("timeout = 60000", "timeout = 5000")], {"routers.main.cache.timeout": LIVE}),
    ("the cache's store", [("timeout = 60000", 'timeout = 60000\nbackend = "embedded"\npath = "c.log"')],
     {"routers.main.cache.backend": REFUSED, "routers.main.cache.persisted": REFUSED,
      "routers.main.cache.path": REFUSED}),
    ("an acceptor added", [("[routers.main]", '[[acceptors]]\nname = "more"\nport = 5673\nrouter = "main"\n\n'
                                              "[routers.main]")], {"acceptors.more": LIVE}),
    ("an acceptor removed", [('[[acceptors]]\nname = "tls"\nport = 5671\nrouter = "main"\n'
                              'tls-cert = "cert.pem"\ntls-key = "key.pem"\n', "")], {"acceptors.tls": LIVE}),
    ("an acceptor's mode, timeout and limit",
     [('mode = "proxy"\nidle-timeout-s = 60', 'mode = "auto"\nidle-timeout-s = 30\nmax-connections-per-source = 50')],
     {"acceptors.proxy.mode": LIVE, "acceptors.proxy.idle-timeout-s": LIVE,
      "acceptors.proxy.max-connections-per-source": LIVE}),
    ("an acceptor's certificate file", [('tls-cert = "cert.pem"', 'tls-cert = "cert2.pem"')],
     {"acceptors.tls.tls-cert": LIVE}),
    ("an acceptor's port", [("port = 5672", "port = 5674")], {"acceptors.proxy.port": REFUSED}),
    ("workers", [("workers = 1", "workers = 2")], {"workers": REFUSED}),
    ("the management port", [("port = 0\nuser", "port = 8161\nuser")], {"management.port": REFUSED}),
    ("the key type", [('key-type = "CLIENT_ID"', 'key-type = "SNI_HOST"')], {"routers.main.key-type": REFUSED}),
    ("a live change and a refused one together",
     [('key-filter = "^app-"', 'key-filter = "^svc-"'), ("workers = 1", "workers = 2")],
     {"routers.main.key-filter": LIVE, "workers": REFUSED}),
    ("the routing log", [("enabled = false", 'enabled = true\npath = "route.log"')],
     {"routing-log.enabled": LIVE, "routing-log.path": LIVE}),
    ("a router added",
     [("[routers.main]", '[routers.other]\nkey-type = "SOURCE_IP"\n[routers.other.pool]\n'
                         '[[routers.other.pool.targets]]\nname = "x"\nhost = "127.0.0.1"\nport = 6100\n\n[routers.main]')],
     {"routers.other": LIVE}),
]


def _load(tmp_path: Path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return load_router_config(path)


def _edit(text: str, edits) -> str:
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    return text


@pytest.mark.parametrize("what,edits,expected", CASES, ids=[c[0] for c in CASES])
def test_each_change_is_reported_live_or_refused(tmp_path, what, edits, expected):
    old = _load(tmp_path, "old.toml", BASE)
    new = _load(tmp_path, "new.toml", _edit(BASE, edits))
    plan = plan_reload(old, new)
    assert {c.part: c.live for c in plan.changes} == expected, plan.summary()
    assert plan.ok == all(expected.values())
    if not expected:
        assert plan.summary() == "no changes"
    elif plan.ok:
        assert plan.summary().startswith(f"{len(expected)} change")
    else:   # the whole reload is refused, naming only what cannot apply, and why
        summary = plan.summary()
        assert summary.startswith("refused: ") and "cannot change live" in summary
        for part, live in expected.items():
            assert (part + ":" in summary) == (not live), summary


def test_a_certificate_renewed_in_place_is_a_change(tmp_path):
    old = _load(tmp_path, "old.toml", BASE)
    new = _load(tmp_path, "new.toml", BASE)
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    same = plan_reload(old, new, old_files={cert: "aa", key: "bb"}, new_files={cert: "aa", key: "bb"})
    assert same.changes == ()
    renewed = plan_reload(old, new, old_files={cert: "aa", key: "bb"}, new_files={cert: "cc", key: "dd"})
    assert {c.part: c.live for c in renewed.changes} == {"acceptors.tls.tls-cert": True, "acceptors.tls.tls-key": True}
    assert "content changed" in renewed.summary()


def test_secrets_never_appear_in_the_plan(tmp_path):
    old = _load(tmp_path, "old.toml", BASE)
    new = _load(tmp_path, "new.toml", _edit(BASE, [('password = "secret-one"', 'password = "secret-two"'),
                                                    ('password = "admin"', 'password = "other"')]))
    text = plan_reload(old, new).summary()
    assert "secret" not in text and "other" not in text and "admin" not in text.replace("management", "")
    assert "routers.main.pool.password: changed" in text and "management.password: changed" in text


def test_the_shipped_sample_reloads_onto_itself_with_no_changes():
    repo = Path(__file__).resolve().parents[4]
    cfg = load_router_config(repo / "etc" / "router.toml")
    assert plan_reload(cfg, load_router_config(repo / "etc" / "router.toml")).changes == ()
