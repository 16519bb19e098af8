"""``fail-back`` with the Redis tier: two router processes share one redis-server; one routes a
key while its target is down, the other asks Redis afterwards. Real redis-server, targets probed
by TCP connect (a listening socket closed and reopened on the same port)."""

from __future__ import annotations

import socket

import pytest
import redis

from routing_cache_helpers import RedisServer, TargetSockets, Worker, router_toml

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _ready(w: Worker) -> list[bool]:
    return [t["ready"] for t in w.status()["pool"]["targets"]]


@pytest.mark.parametrize("fail_back", ["stay", "return"])
def test_fail_back_through_redis(tmp_path, fail_back):
    server = RedisServer(tmp_path)
    targets = TargetSockets(2)
    a = b = None
    try:
        cfg = tmp_path / "router.toml"
        cfg.write_text(router_toml(targets.ports, f'backend = "redis"\nredis-url = "{server.url}"\n'
                                                  f'fail-back = "{fail_back}"', policy="FIRST_ELEMENT"))
        r = redis.Redis(port=server.port, decode_responses=True)
        a = Worker(cfg, seed=1)
        a.wait_status(lambda s: [t["ready"] for t in s["pool"]["targets"]] == [True, True])
        assert a.route("k")["node_id"] == "node-0"
        a.wait_status(lambda s: s["counters"]["redis_writes"] >= 1)
        assert r.get("lodestone:r:k") == "node-0"

        targets.socks[0].close()                       # b0 goes down
        b = Worker(cfg, seed=2)                        # a second replica: its local tier is empty
        b.wait_status(lambda s: [t["ready"] for t in s["pool"]["targets"]] == [False, True])
        got = b.route("k")                             # Redis says node-0, which is not ready
        # stay: a not-ready Redis entry is ignored (a local miss) and replaced; return: it is
        # restored as a stale entry and kept
        assert got["node_id"] == "node-1" and got["cache"] == ("stale" if fail_back == "return" else "miss")
        if fail_back == "stay":
            b.wait_status(lambda s: s["counters"]["redis_writes"] >= 1)
            assert r.get("lodestone:r:k") == "node-1"
        else:
            assert b.status()["counters"]["redis_writes"] == 0
            assert r.get("lodestone:r:k") == "node-0"

        s = socket.socket()                            # b0 comes back on the same port
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", targets.ports[0]))
        s.listen(64)
        targets.socks[0] = s
        b.wait_status(lambda st: [t["ready"] for t in st["pool"]["targets"]] == [True, True])
        assert b.route("k")["node_id"] == ("node-0" if fail_back == "return" else "node-1")
    finally:
        for w in (a, b):
            if w is not None:
                w.quit()
        targets.close()
        server.kill()
