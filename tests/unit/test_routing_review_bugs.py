"""Regression tests for bugs found in the routing-core review (issue #3).

Each test failed before its fix; the docstring says what was wrong.
"""

from __future__ import annotations

import math
import random
import textwrap

import trio

from router.cache_embedded import EmbeddedCacheStore
from router.config import (CacheConfig, PinsConfig, PolicyConfig, PoolConfig, RouterConfig,
                           TargetConfig, import_artemis_xml)
from router.core.keys import ConnectionInfo, KeyType, lodestone_source_key
from router.errors import CacheBackendError
from router.policies import Target, create_policy
from router.service import RouterService


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


# -- pins -----------------------------------------------------------------------------------
async def test_pins_bad_lines_are_counted_and_skipped(tmp_path):
    """One bad line used to discard the whole pins file (no pin applied at all)."""
    pins = tmp_path / "pins.jsonl"
    pins.write_text(textwrap.dedent("""\
        {"key": "gold", "node_id": "n1"}
        {broken
        {"key": "x"}
        {"pattern": "^EQ_.*", "node_id": "n0"}
    """))
    cfg = RouterConfig("r", key_type=KeyType.CLIENT_ID, policy=PolicyConfig("FIRST_ELEMENT"),
                       pool=PoolConfig(targets=(TargetConfig("t0", "h", 1),
                                                TargetConfig("t1", "h", 2))),
                       pins=PinsConfig(pins))
    svc = RouterService(cfg)
    svc.pool.report_probe("t0", True, node_id="n0")
    svc.pool.report_probe("t1", True, node_id="n1")
    assert len(svc.core.pins) == 2
    assert svc.counters["pins_bad_lines"] == 2
    assert f"{pins}:2: invalid JSON" in svc.pins_error and f"{pins}:3:" in svc.pins_error
    d = await svc.route(ConnectionInfo("1:1", container_id="gold"))
    assert d.target.node_id == "n1" and d.explanation.pin == "gold"
    assert (await svc.route(ConnectionInfo("1:1", container_id="EQ_1"))).explanation.pin


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


async def _until(pred, timeout=5.0):
    with trio.fail_after(timeout):
        while not pred():
            await trio.sleep(0.01)


async def test_redis_repointing_our_own_decision_is_not_a_conflict(nursery):
    """(Held before the review: the stale entry's Redis read supplies the replaced value.)"""
    fake = FakeRedis()
    svc = redis_service(fake)
    await nursery.start(svc.run)
    c = ConnectionInfo("1:1", container_id="k")
    assert (await svc.route(c)).target.node_id == "n0"
    await _until(lambda: fake.data.get("k") == "n0")
    svc.pool.report_probe("t0", False, error="down")
    d = await svc.route(c)
    assert d.target.node_id == "n1" and d.explanation.cache == "stale"
    await _until(lambda: fake.data.get("k") == "n1")
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
    await _until(lambda: fake.data.get("k") == "n0")
    fake.fail = True
    svc.pool.report_probe("t0", False, error="down")
    d = await svc.route(c)
    assert d.ok and d.target.node_id == "n1" and svc.degraded
    fake.fail = False
    await _until(lambda: not svc.degraded and fake.data.get("k") == "n1")
    assert svc.core.cache.entries["k"][0] == "n1" and svc.counters["redis_conflicts"] == 0


async def test_redis_local_expiry_does_not_delete_the_shared_entry(nursery):
    """Redis keeps the TTL (refreshed by every replica's hits). A replica's *local* idle expiry
    used to DELETE the shared key, breaking stickiness for replicas still using it."""
    fake = FakeRedis()
    svc = redis_service(fake, timeout_ms=100)
    await nursery.start(svc.run)
    await svc.route(ConnectionInfo("1:1", container_id="k"))
    await _until(lambda: fake.data.get("k") == "n0")
    await _until(lambda: "k" not in svc.core.cache.entries)  # local tier expired it
    await trio.sleep(0.3)  # several write-behind rounds
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
    await _until(lambda: svc.degraded)
    assert (await svc.route(ConnectionInfo("1:1", container_id="after"))).ok


def test_redis_cache_round_trips_lone_surrogates():
    """redis-py's default strict encoding raised UnicodeEncodeError (not a RedisError)."""
    from router.cache_redis import RedisCache

    rc = RedisCache("redis://127.0.0.1:1", router="r", socket_timeout_s=0.05)
    assert rc.client.get_encoder().encode("\ud800") == b"\xed\xa0\x80"
    rc.close()


# -- policies -------------------------------------------------------------------------------
def test_bounded_load_cap_holds_when_a_target_has_no_ring_point():
    """Artemis ring (VIRTUAL_NODES=1) with colliding node ids: one target owns no point, the
    walk never reaches it, and the fallback put the key on the full ring owner anyway."""
    p = create_policy("CONSISTENT_HASH", {"HASH": "FNV1A", "VIRTUAL_NODES": "1",
                                          "LOAD_FACTOR": "1.0"})
    targets = [Target(n, "h", 1, name=n) for n in ("collide-63438", "broker-1",
                                                    "collide-318226")]
    rng = random.Random(7)
    for total in range(1, 301):
        p.select_target(targets, f"key-{rng.getrandbits(40)}")
        assert max(p.loads.values()) <= math.ceil(1.0 * total / 3), total


# -- config ---------------------------------------------------------------------------------
def test_xml_local_target_filter_is_trimmed(tmp_path):
    """Artemis's XML parser trims element text; a pretty-printed local-target-filter kept its
    whitespace and never full-matched."""
    p = tmp_path / "broker.xml"
    p.write_text("""<configuration xmlns="urn:activemq"><core xmlns="urn:activemq:core">
      <connection-routers><connection-router name="lp">
        <key-type>CLIENT_ID</key-type>
        <local-target-filter>
            ^FOO.*
        </local-target-filter>
      </connection-router></connection-routers></core></configuration>""")
    rc = import_artemis_xml(p, local_target=TargetConfig("local", "127.0.0.1", 5672))["lp"]
    assert rc.local_target_filter == "^FOO.*"


# -- keys -----------------------------------------------------------------------------------
def test_bare_ipv4_mapped_source_is_the_ipv4_client():
    """``[::ffff:10.0.0.1]:5000`` gave ``10.0.0.1`` but the bare form kept the v6 text, so the
    same client got two keys depending on how the edge printed the peer."""
    assert lodestone_source_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert lodestone_source_key("[::ffff:10.0.0.1]:5000") == "10.0.0.1"



# -- hashing --------------------------------------------------------------------------------
def test_murmur3_policies_survive_a_lone_surrogate_key():
    """mmh3 5.x segfaults on a str with a lone surrogate, and MURMUR3 is the default hash: one
    management lookup of the JSON key "\\ud800" killed the whole router process. Run in a child
    process so a regression fails this test instead of the test run."""
    import subprocess
    import sys

    code = textwrap.dedent("""
        from router.core.decide import Router
        from router.core.keys import KeyResolver, KeyType
        from router.core.pool import Pool
        from router.policies import Target, create_policy, murmur3
        import mmh3
        pool = Pool([Target(f"n{i}", "h", i, name=f"t{i}") for i in range(3)])
        for i in range(3):
            pool.set_ready(f"t{i}", True)
        for name, props in (("CONSISTENT_HASH", {}), ("CONSISTENT_HASH_MODULO", {"MODULO": "3"})):
            r = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy(name, props),
                       pool=pool)
            r.decide_for_key("\\ud800", 0.0)
            r.decide_for_key("x\\udfffy", 0.0)
        assert murmur3("é中😀") == mmh3.hash("é中😀") and murmur3("abc") == mmh3.hash("abc")
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", (res.returncode, res.stderr)


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
