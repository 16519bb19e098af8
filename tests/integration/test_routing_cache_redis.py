"""The Redis cache tier against a real redis-server: two router processes share stickiness,
and killing (or hanging) Redis mid-run fails no decision."""

from __future__ import annotations


import pytest
import redis

from routing_cache_helpers import RedisServer, TargetSockets, Worker, router_toml
from tests.waiting import wait_for

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    yield server
    server.kill()


@pytest.fixture
def targets():
    t = TargetSockets(3)
    yield t
    t.close()


def redis_cfg(tmp_path, targets, server, timeout_ms=0):
    cfg = tmp_path / "router.toml"
    cfg.write_text(router_toml(targets.ports, f'backend = "redis"\nredis-url = "{server.url}"\n'
                                              f'timeout = {timeout_ms}\nredis-timeout-ms = 50'))
    return cfg


def test_two_routers_share_stickiness(tmp_path, targets, redis_server):
    cfg = redis_cfg(tmp_path, targets, redis_server, timeout_ms=60000)
    keys = [f"client-{i}" for i in range(30)]
    a, b = Worker(cfg, seed=1), Worker(cfg, seed=2)
    try:
        first = {k: a.route(k)["node_id"] for k in keys}
        assert len(set(first.values())) == 3
        a.wait_status(lambda s: s["counters"]["redis_writes"] >= len(keys))
        r = redis.Redis(port=redis_server.port, decode_responses=True)
        assert r.get("lodestone:r:client-0") == first["client-0"]
        assert 0 < r.pttl("lodestone:r:client-0") <= 60000  # TTL kept by Redis
        for k in keys:  # b has never seen these keys: its local tier misses, Redis hits
            got = b.route(k)
            assert got["node_id"] == first[k] and got["cache"] == "hit" and got["tier"] == "redis"
        for k in keys:  # and now b answers from its local tier without a round trip
            got = b.route(k)
            assert got["node_id"] == first[k] and got["tier"] == "local"
        st = b.status()
        assert st["counters"]["redis_hits"] == len(keys) and not st["degraded"]
        # b decides new keys; a sees b's decisions
        mine = {f"b-{i}": b.route(f"b-{i}")["node_id"] for i in range(6)}
        wait_for(lambda: all(r.get(f"lodestone:r:{k}") == v for k, v in mine.items()), 10, interval_s=0.02,
                 what="b's decisions to reach Redis")
        assert {k: a.route(k)["node_id"] for k in mine} == mine
        r.close()
    finally:
        a.quit()
        b.quit()


def test_killing_redis_mid_run_fails_no_decision(tmp_path, targets, redis_server):
    cfg = redis_cfg(tmp_path, targets, redis_server)
    a = Worker(cfg, seed=1)
    try:
        before = {f"k{i}": a.route(f"k{i}")["node_id"] for i in range(20)}
        a.wait_status(lambda s: s["counters"]["redis_writes"] >= 20)
        redis_server.kill()
        res = a.ask("routemany 300 during-")  # misses: each would ask Redis
        assert res == {"ok": 300, "failed": 0}
        st = a.wait_status(lambda s: s["degraded"])
        assert st["counters"]["redis_errors"] >= 1
        assert "redis cache tier unavailable" in st["io_errors"]["redis"]   # /health lists it (component redis)
        for k, node in before.items():  # stickiness kept by the local tier
            got = a.route(k)
            assert got["outcome"] == "OK" and got["node_id"] == node
        # Redis comes back (empty): the router leaves degraded mode and writes what queued up
        redis_server.start()
        st = a.wait_status(lambda s: not s["degraded"], timeout=15)
        assert "redis" not in st["io_errors"]
        r = redis.Redis(port=redis_server.port, decode_responses=True)
        wait_for(lambda: r.get("lodestone:r:during-299") is not None, 10, what="the queued writes flushed")
        r.close()
    finally:
        a.quit()


def test_hung_redis_fails_no_decision(tmp_path, targets, redis_server):
    cfg = redis_cfg(tmp_path, targets, redis_server)
    a = Worker(cfg, seed=1)
    try:
        redis_server.pause()
        try:
            res = a.ask("routemany 50 hung-")
            assert res == {"ok": 50, "failed": 0}
            st = a.status()
            assert st["degraded"] and "timeout" in st["degraded_reason"]
        finally:
            redis_server.resume()
        a.wait_status(lambda s: not s["degraded"], timeout=15)
    finally:
        a.quit()


def test_redis_cache_keeps_non_ascii_huge_and_lone_surrogate_keys(redis_server):
    """Keys are Python str (JSON from the management API may hold a lone surrogate); the real
    client must round-trip them, not raise UnicodeEncodeError out of the write-behind."""
    from router.cache_redis import RedisCache

    rc = RedisCache(redis_server.url, router="r", timeout_ms=60000)
    keys = ["ключ", "中文😀", "\ud800", "x" * 100_000]
    try:
        assert rc.write([(k, f"node-{i}", "") for i, k in enumerate(keys)], [], []) == {}
        assert [rc.get(k) for k in keys] == [f"node-{i}" for i in range(len(keys))]
        assert rc.write([("\ud800", "other", "")], ["中文😀"], ["ключ"]) == {"\ud800": "node-2"}
        assert rc.get("ключ") is None
    finally:
        rc.close()
