"""The sticky cache's tiers through the service: the embedded file (torn tails, odd keys),
expire-after-access, and the Redis tier (compare-and-set, degraded mode, client errors, close).

Moved from the issue #3 review files (``test_routing_review_*``); each bug test failed before
its fix, its docstring says what was wrong.
"""

from __future__ import annotations

import pytest
import trio

from router.cache_embedded import EmbeddedCacheStore
from router.config import CacheConfig, PolicyConfig, PoolConfig, RouterConfig, TargetConfig
from router.core.cache import StickyCache
from router.core.decide import Router
from router.core.keys import ConnectionInfo, KeyResolver, KeyType
from router.core.pool import Pool
from router.errors import CacheBackendError
from router.policies import Target, create_policy
from router.service import RouterService
from tests.waiting import wait_for_async


# -- Redis tier -----------------------------------------------------------------------------
class FakeRedis:
    """In-memory stand-in with RedisCache's methods (the real server is in the integration
    tests); records deletes so a test can see what the write-behind sent."""

    def __init__(self):
        self.data: dict[str, str] = {}
        self.deleted: list[str] = []
        self.gets = 0
        self.fail = False

    def _check(self):
        if self.fail:
            raise CacheBackendError("redis failed: connection refused")

    def get(self, key):
        self.gets += 1
        self._check()
        return self.data.get(key)

    def write(self, puts, touches, deletes):
        self._check()
        conflicts = {}
        for key, ident, old in puts:
            cur = self.data.get(key)
            if cur is None or cur in (ident, old):
                self.data[key] = ident
            else:
                conflicts[key] = cur
        for key in deletes:
            self.deleted.append(key)
            self.data.pop(key, None)
        return conflicts

    def ping(self):
        self._check()

    def close(self):
        pass

async def _no_probes(task_status=trio.TASK_STATUS_IGNORED):
    task_status.started()
    await trio.sleep_forever()

def redis_service(fake, *, policy="FIRST_ELEMENT", timeout_ms=0) -> RouterService:
    cache = CacheConfig(backend="redis", redis_url="redis://unused", timeout_ms=timeout_ms)
    cfg = RouterConfig("r", key_type=KeyType.CLIENT_ID, policy=PolicyConfig(policy),
                       cache=cache, pool=PoolConfig(targets=tuple(
                           TargetConfig(f"t{i}", "h", 1 + i) for i in range(3))))
    svc = RouterService(cfg, redis_cache=fake)
    for i in range(3):
        svc.pool.report_probe(f"t{i}", True, node_id=f"n{i}")
    svc._health_task = _no_probes
    return svc

# -- embedded cache -------------------------------------------------------------------------
def test_embedded_torn_tail_does_not_swallow_the_next_record(tmp_path):
    """A crash mid-write leaves a torn last line without a newline. The next append used to be
    glued onto it, so the first record written after the restart failed its CRC and was lost."""
    path = tmp_path / "cache.log"
    a = EmbeddedCacheStore(path, fsync=False)
    a.write([("k1", "n1", 1.0, 1.0), ("k2", "n2", 1.0, 1.0)], [], [])
    a.close()
    with open(path, "ab") as fh:
        fh.write(b'1234abcd ["P","k3","n')  # torn: no newline
    b = EmbeddedCacheStore(path, fsync=False)
    assert set(b.load()) == {"k1", "k2"} and b.skipped == 1
    b.write([("k4", "n4", 2.0, 2.0)], [], [])
    b.close()
    c = EmbeddedCacheStore(path, fsync=False)
    assert set(c.load()) == {"k1", "k2", "k4"} and c.skipped == 0

async def test_embedded_torn_tail_through_the_service(tmp_path):
    path = tmp_path / "cache.log"
    path.write_bytes(b'0badc0de ["P","half')
    cache = CacheConfig(persisted=True, backend="embedded", path=path)
    cfg = RouterConfig("r", key_type=KeyType.CLIENT_ID, policy=PolicyConfig("FIRST_ELEMENT"),
                       cache=cache, pool=PoolConfig(targets=(TargetConfig("t0", "h", 1),)))
    a = RouterService(cfg)
    a.pool.report_probe("t0", True, node_id="n0")
    assert (await a.route(ConnectionInfo("1:1", container_id="k"))).explanation.cache == "miss"
    await a.aclose()
    b = RouterService(cfg)
    b.pool.report_probe("t0", True, node_id="n0")
    assert (await b.route(ConnectionInfo("1:1", container_id="k"))).explanation.cache == "hit"
    await b.aclose()

def test_embedded_store_round_trips_non_ascii_and_lone_surrogates(tmp_path):
    keys = ["ключ", "中文", "😀", "\ud800", "a\nb", "x" * 100_000]
    a = EmbeddedCacheStore(tmp_path / "c.log", fsync=False)
    a.write([(k, "n", 1.0, 1.0) for k in keys], [], [])
    a.close()
    b = EmbeddedCacheStore(tmp_path / "c.log", fsync=False)
    assert sorted(b.load()) == sorted(keys) and b.skipped == 0

def test_embedded_complete_last_record_without_newline_is_kept(tmp_path):
    path = tmp_path / "c.log"
    a = EmbeddedCacheStore(path, fsync=False)
    a.write([("k1", "n1", 1.0, 1.0)], [], [])
    a.close()
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # crash right before the newline
    b = EmbeddedCacheStore(path, fsync=False)
    assert set(b.load()) == {"k1"}
    b.write([("k2", "n2", 1.0, 1.0)], [], [])
    b.close()
    assert set(EmbeddedCacheStore(path).load()) == {"k1", "k2"}

# -- expire after access --------------------------------------------------------------------
def test_router_cache_expires_after_access_not_after_write():
    pool = Pool([Target(None, "h", i, name=f"t{i}") for i in range(3)])
    for i in range(3):
        pool.set_ready(f"t{i}", True, f"n{i}")
    r = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy("ROUND_ROBIN"),
               pool=pool, cache=StickyCache(500))
    c = ConnectionInfo("1:1", container_id="k")
    first = r.decide(c, 0.0).target
    for t in (0.4, 0.8, 1.2, 1.6):  # 1.6 s after the write, never 0.5 s idle
        d = r.decide(c, t)
        assert d.explanation.cache == "hit" and d.target == first
        assert d.explanation.cache_age_s == pytest.approx(t)
    assert r.decide(c, 2.2).explanation.cache == "miss"  # 0.6 s idle

async def test_redis_repointing_our_own_decision_is_not_a_conflict(nursery):
    """(Held before the review: the stale entry's Redis read supplies the replaced value.)"""
    fake = FakeRedis()
    svc = redis_service(fake)
    await nursery.start(svc.run)
    c = ConnectionInfo("1:1", container_id="k")
    assert (await svc.route(c)).target.node_id == "n0"
    await wait_for_async(lambda: fake.data.get("k") == "n0", 5, interval_s=0.01)
    svc.pool.report_probe("t0", False, error="down")
    d = await svc.route(c)
    assert d.target.node_id == "n1" and d.explanation.cache == "stale"
    await wait_for_async(lambda: fake.data.get("k") == "n1", 5, interval_s=0.01)
    assert svc.counters["redis_conflicts"] == 0
    assert svc.core.cache.entries["k"][0] == "n1"
    assert (await svc.route(c)).explanation.cache == "hit"

async def test_redis_repointing_while_degraded_does_not_adopt_the_dead_node(nursery):
    """Re-decided while Redis was down, a key's queued write carried no "replaced" value, so when
    Redis came back the CAS refused it and the replica adopted the dead node it had just left:
    Redis kept pointing at the dead node and the next connection was re-decided once more."""
    fake = FakeRedis()
    svc = redis_service(fake)
    await nursery.start(svc.run)
    c = ConnectionInfo("1:1", container_id="k")
    assert (await svc.route(c)).target.node_id == "n0"
    await wait_for_async(lambda: fake.data.get("k") == "n0", 5, interval_s=0.01)
    fake.fail = True
    svc.pool.report_probe("t0", False, error="down")
    d = await svc.route(c)
    assert d.ok and d.target.node_id == "n1" and svc.degraded
    fake.fail = False
    await wait_for_async(lambda: not svc.degraded and fake.data.get("k") == "n1", 5, interval_s=0.01)
    assert svc.core.cache.entries["k"][0] == "n1" and svc.counters["redis_conflicts"] == 0

async def test_redis_local_expiry_does_not_delete_the_shared_entry(nursery):
    """Redis keeps the TTL (refreshed by every replica's hits). A replica's *local* idle expiry
    used to DELETE the shared key, breaking stickiness for replicas still using it."""
    fake = FakeRedis()
    svc = redis_service(fake, timeout_ms=100)
    await nursery.start(svc.run)
    await svc.route(ConnectionInfo("1:1", container_id="k"))
    await wait_for_async(lambda: fake.data.get("k") == "n0", 5, interval_s=0.01)
    await wait_for_async(lambda: "k" not in svc.core.cache.entries, 5, interval_s=0.01)  # local tier expired it
    await trio.sleep(0.3)  # the thing under test: several write-behind rounds send no delete
    assert fake.deleted == [] and fake.data.get("k") == "n0"

async def test_redis_client_error_outside_redis_error_degrades_instead_of_crashing(nursery):
    """Only ``CacheBackendError`` was handled: any other exception from the Redis client
    (e.g. redis-py failing to encode a key) killed ``run()`` and with it the router's tasks."""
    fake = FakeRedis()

    def bad_write(puts, touches, deletes):
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    fake.write = bad_write
    svc = redis_service(fake)
    await nursery.start(svc.run)
    d = svc.route_for_key("\ud800")  # the management API can pass any JSON string
    assert d.ok
    await wait_for_async(lambda: svc.degraded, 5, interval_s=0.01)
    assert (await svc.route(ConnectionInfo("1:1", container_id="after"))).ok

def test_redis_cache_round_trips_lone_surrogates():
    """redis-py's default strict encoding raised UnicodeEncodeError (not a RedisError)."""
    from router.cache_redis import RedisCache

    rc = RedisCache("redis://127.0.0.1:1", router="r", socket_timeout_s=0.05)
    assert rc.client.get_encoder().encode("\ud800") == b"\xed\xa0\x80"
    rc.close()

async def test_redis_client_is_closed_when_the_service_stops(nursery):
    """``RouterService.close`` was never called: the Redis client's connections stayed open
    until the process exited. ``run`` ends with ``aclose`` (and the server calls it again at
    shutdown: idempotent)."""
    fake = FakeRedis()
    closed = []
    fake.close = lambda: closed.append(True)
    svc = redis_service(fake)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as n:
            await n.start(svc.run)
            assert (await svc.route(ConnectionInfo("1:1", container_id="k"))).ok
            scope.cancel()
    assert closed == [True]
    await svc.aclose()
    assert closed == [True]
