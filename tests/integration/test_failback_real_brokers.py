"""Fail-back of sticky keys when their broker returns (``[routers.<r>.cache] fail-back``), with
real broker processes behind a real router process: kill one broker, connect a key, restart the
broker, connect again — where does the key land under ``stay`` (Artemis) and ``return``?"""

from __future__ import annotations


import pytest
from proton.utils import BlockingConnection

from tests.brokerproc import start_broker
from tests.routerproc import start_router
from tests.serverproc import REPO, free_ports
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


def _router_toml(brokers, fail_back: str | None) -> str:
    lines = ['name = "r"', f'users-file = "{REPO / "etc" / "users.toml"}"',
             '[management]', 'port = 0', 'user = "admin"', 'password = "admin"',
             '[[acceptors]]', 'name = "proxy"', 'port = 0', 'router = "main"', 'mode = "proxy"',
             '[routers.main]', 'key-type = "CLIENT_ID"',
             '[routers.main.policy]', 'name = "CONSISTENT_HASH"',
             '[routers.main.cache]'] + ([f'fail-back = "{fail_back}"'] if fail_back else []) + [
             '[routers.main.pool]', 'check-period = 200', 'quorum-size = 1', 'quorum-timeout = 0',
             'username = "admin"', 'password = "admin"']
    for i, b in enumerate(brokers):
        lines += ['[[routers.main.pool.targets]]', f'name = "b{i}"', 'host = "127.0.0.1"',
                  f'port = {b.port}', f'management-url = "{b.management_url}"']
    return "\n".join(lines) + "\n"


def _landed(brokers, router, key: str) -> int:
    """Connect through the proxy acceptor with container-id ``key``; the index of the broker
    whose own management API lists that connection."""
    conn = BlockingConnection(router.url("proxy"), container_id=key, user="app", password="app",
                              allowed_mechs="PLAIN", allow_insecure_mechs=True, timeout=10)
    try:
        def where():
            found = [i for i, b in enumerate(brokers) if b.proc.poll() is None
                     and any(c["container_id"] == key for c in b.management_get("/api/v1/connections")[1])]
            return found or None
        found = wait_for(where, 10)
        assert len(found) == 1
        return found[0]
    finally:
        conn.close()


def _cached(router, key: str) -> str | None:
    status, page = router.get("/api/v1/routers/main/cache?limit=1000")
    assert status == 200, page
    return next((e["node_id"] for e in page["entries"] if e["key"] == key), None)


def _ready(router) -> list[bool]:
    return [t["ready"] for t in router.get("/api/v1/routers/main/pool")[1]["targets"]]


@pytest.mark.parametrize("fail_back", [None, "stay", "return"])
def test_sticky_keys_when_their_broker_returns(tmp_path, fail_back):
    brokers = []
    for i in range(2):
        amqp, mgmt = free_ports(2)
        brokers.append(start_broker(tmp_path, name=f"b{i}",
                                    config={"acceptors.amqp": {"port": amqp}, "management": {"port": mgmt}}))
    router = start_router(tmp_path / "router", _router_toml(brokers, fail_back), expect=2)
    try:
        wait_for(lambda: _ready(router) == [True, True], 15)
        ids = [b.node_id for b in brokers]
        # two keys that consistent hashing puts on b0: `moved` connects while b0 is down,
        # `pinned` does not
        on_b0 = []
        for i in range(200):
            key = f"fb-{i}"
            if _landed(brokers, router, key) == 0:
                on_b0.append(key)
            if len(on_b0) == 2:
                break
        moved, pinned = on_b0
        assert _cached(router, moved) == _cached(router, pinned) == ids[0]

        brokers[0].kill()
        wait_for(lambda: _ready(router) == [False, True], 15)
        assert _landed(brokers, router, moved) == 1          # its broker is down: b1
        # stay (and the default): the new choice replaces the entry; return: the entry keeps b0
        expect_entry = ids[0] if fail_back == "return" else ids[1]
        assert _cached(router, moved) == expect_entry
        assert _cached(router, pinned) == ids[0]

        brokers[0].start()                                   # same data dir, node id, ports
        assert brokers[0].node_id == ids[0]
        wait_for(lambda: _ready(router) == [True, True], 15)
        # by hand: stay keeps `moved` where it went (b1); return sends it back to b0.
        # `pinned` never left its entry: back on b0 under every setting.
        assert _landed(brokers, router, moved) == (0 if fail_back == "return" else 1)
        assert _cached(router, moved) == (ids[0] if fail_back == "return" else ids[1])
        assert _landed(brokers, router, pinned) == 0
    finally:
        router.terminate()
        for b in brokers:
            b.kill()


def test_fail_back_rejects_unknown_values(tmp_path):
    import subprocess
    import sys

    cfg = tmp_path / "router.toml"
    cfg.write_text('[routers.m.cache]\nfail-back = "sometimes"\n')
    out = subprocess.run([sys.executable, "-m", "router", "check", str(cfg)], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 2
    assert "routers.m.cache.fail-back" in out.stderr and "'sometimes' must be one of stay, return" in out.stderr
