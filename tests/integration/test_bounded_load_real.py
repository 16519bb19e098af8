"""LOAD_FACTOR counts live assignments, seen through a real router in front of real brokers
(issue 8, item 5): proxied connections hold an assignment while open (no cache) or while
their cache entry lives (cache with a timeout); management lookups never count."""

from __future__ import annotations

import pytest
from proton.utils import BlockingConnection

from tests.brokerproc import start_broker, write_users_file
from tests.routerproc import start_router, toml_str
from tests.waiting import wait_for

pytestmark = pytest.mark.slow

USERS = {"admin": ("admin-pw", ["admin"]), "alice": ("alice-pw", ["app"])}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bounded-load")
    users = write_users_file(tmp / "users.toml", USERS)
    brokers = [start_broker(tmp, name=f"b{i}", users_file=users) for i in (1, 2)]

    def router(name, cache_lines=()):
        out = [f"[routers.{name}]", 'key-type = "CLIENT_ID"', f"[routers.{name}.policy]", 'name = "CONSISTENT_HASH"',
               f"[routers.{name}.policy.properties]", 'LOAD_FACTOR = "1.0"', *cache_lines,
               f"[routers.{name}.pool]", "check-period = 200", 'username = "admin"', 'password = "admin-pw"']
        for i, b in enumerate(brokers):
            out += [f"[[routers.{name}.pool.targets]]", f'name = "b{i + 1}"', 'host = "127.0.0.1"', f"port = {b.port}",
                    f"management-url = {toml_str(b.management_url)}"]
        return out + ["[[acceptors]]", f'name = "{name}"', "port = 0", f'router = "{name}"', 'mode = "proxy"',
                      "idle-timeout-s = 30"]

    text = "\n".join([f"users-file = {toml_str(users)}", "[management]", "port = 0",
                      "[routing-log]", "enabled = false",
                      *router("nocache"), *router("cached", ["[routers.cached.cache]", "timeout = 600"])]) + "\n"
    r = start_router(tmp / "router", text, expect=3, auth=("admin", "admin-pw"))
    for name in ("nocache", "cached"):
        wait_for(lambda name=name: r.get(f"/api/v1/routers/{name}/pool")[1]["ready"] == 2, 15)
    try:
        yield r
    finally:
        status = r.terminate()
        for b in brokers:
            b.kill()
        assert status == 0, r.stderr_text()


def live(router, name) -> int:
    status, body = router.get(f"/api/v1/routers/{name}")
    assert status == 200, body
    return sum(body["live_assignments"].values())


def open_conn(router, name, cid) -> BlockingConnection:
    return BlockingConnection(router.url(name), timeout=15, user="alice", password="alice-pw",
                              allowed_mechs="PLAIN", container_id=cid)


def test_without_cache_open_connections_are_the_load(env):
    for i in range(20):
        assert env.target_for("nocache", f"lookup-{i}")["outcome"] == "OK"
    assert live(env, "nocache") == 0  # management lookups do not count
    conns = [open_conn(env, "nocache", f"c{i}") for i in range(4)]
    try:
        wait_for(lambda: live(env, "nocache") == 4, 10)
        _, body = env.get("/api/v1/routers/nocache")
        assert body["live_assignments"] == {"b1": 2, "b2": 2}  # cap ceil(1.0 * 4 / 2)
        for c in conns[:3]:
            c.close()
        wait_for(lambda: live(env, "nocache") == 1, 10)
    finally:
        for c in conns:
            c.close()
    wait_for(lambda: live(env, "nocache") == 0, 10)


def test_with_cache_the_entry_holds_the_load_until_it_expires(env):
    conns = [open_conn(env, "cached", f"k{i}") for i in range(3)]
    wait_for(lambda: live(env, "cached") == 3, 10)
    for c in conns:
        c.close()
    assert live(env, "cached") == 3  # closed, but the cache still sends k0..k2 there
    wait_for(lambda: live(env, "cached") == 0, 10)  # entries idle > 600 ms expire
    env.target_for("cached", "k-managed")
    assert live(env, "cached") == 0
