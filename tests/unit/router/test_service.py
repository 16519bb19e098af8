"""RouterService shell: health probes against a fake management endpoint (h11 over trio),
quorum waits, filters, pins reload and the embedded cache within one process."""

from __future__ import annotations

import base64
import json
from dataclasses import replace
from functools import partial

import h11
import pytest
import trio

from router.config import (CacheConfig, PinsConfig, PolicyConfig, PoolConfig, RouterConfig,
                           TargetConfig)
from router.core.decide import Outcome
from router.core.keys import ConnectionInfo, KeyType
from router.health import probe_target
from router.policies import Target
from router.service import RouterService
from tests.waiting import wait_for_async


class FakeManagement:
    """A stand-in broker management endpoint: GET /api/v1/broker with Basic auth."""

    def __init__(self, node_id: str, *, active=True, count=0, user="admin", password="pw"):
        self.node_id, self.active, self.count = node_id, active, count
        self.auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.requests = 0
        self.status_override: int | None = None

    async def handle(self, stream):
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    conn.receive_data(data)
                    continue
                if isinstance(ev, h11.Request):
                    req = ev
                elif isinstance(ev, h11.EndOfMessage):
                    break
            self.requests += 1
            headers = dict((k.decode().lower(), v.decode()) for k, v in req.headers)
            if self.status_override:
                status, body = self.status_override, b"{}"
            elif headers.get("authorization") != self.auth:
                status, body = 401, b'{"error": "unauthorized"}'
            elif req.target != b"/api/v1/broker":
                status, body = 404, b"{}"
            else:
                status = 200
                body = json.dumps({"node_id": self.node_id, "name": self.node_id,
                                   "active": self.active, "connection_count": self.count,
                                   "version": "0", "uptime_s": 1}).encode()
            data = conn.send(h11.Response(status_code=status, headers=[
                ("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                ("Connection", "close")]))
            data += conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage())
            await stream.send_all(data)
        finally:
            await trio.aclose_forcefully(stream)


async def start_fake(nursery, fake: FakeManagement) -> str:
    listeners = await nursery.start(partial(trio.serve_tcp, fake.handle, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rconfig(targets, *, policy="FIRST_ELEMENT", props=None, quorum=1, quorum_timeout=3000,
            check_period=100, cache=None, key_type=KeyType.CLIENT_ID, **kw) -> RouterConfig:
    return RouterConfig(
        "r", key_type=key_type, policy=PolicyConfig(policy, props or {}), cache=cache,
        pool=PoolConfig(check_period_ms=check_period, quorum_size=quorum,
                        quorum_timeout_ms=quorum_timeout, username="admin", password="pw",
                        targets=tuple(targets)), **kw)


async def test_probe_learns_node_id_counts_and_errors(nursery):
    good = FakeManagement("uuid-a", count=7)
    inactive = FakeManagement("uuid-b", active=False)
    url_a, url_b = await start_fake(nursery, good), await start_fake(nursery, inactive)
    cfg = rconfig([TargetConfig("a", "127.0.0.1", 1, management_url=url_a),
                   TargetConfig("b", "127.0.0.1", 2, management_url=url_b),
                   TargetConfig("c", "127.0.0.1", 3,
                                management_url=f"http://127.0.0.1:{closed_port()}")],
                  policy="LEAST_CONNECTIONS")
    svc = RouterService(cfg)
    await nursery.start(svc.run)  # started after the first probe round
    snap = {t["name"]: t for t in svc.pool.snapshot()["targets"]}
    assert snap["a"]["ready"] and snap["a"]["node_id"] == "uuid-a"
    assert snap["a"]["connection_count"] == 7 and snap["a"]["last_error"] is None
    assert not snap["b"]["ready"] and "not active" in snap["b"]["last_error"]
    assert not snap["c"]["ready"] and "Error" in snap["c"]["last_error"]
    assert svc.policy.counts == {"a": 7}
    d = await svc.route(ConnectionInfo("10.0.0.1:5", container_id="x"))
    assert d.ok and d.target.node_id == "uuid-a"
    good.active = False
    await wait_for_async(lambda: svc.pool.ready_count == 0, 5, interval_s=0.02, what="no target ready")
    assert "not active" in svc.pool.snapshot()["targets"][0]["last_error"]


async def test_probe_wrong_password_and_tcp_probe(nursery):
    fake = FakeManagement("uuid-a", password="other")
    url = await start_fake(nursery, fake)
    res = await probe_target(Target(None, "127.0.0.1", 1, management_url=url),
                             username="admin", password="pw", timeout_s=2)
    assert not res.ok and "HTTP 401" in res.error
    listeners = await nursery.start(partial(trio.serve_tcp, trio.aclose_forcefully, 0,
                                            host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    assert (await probe_target(Target(None, "127.0.0.1", port))).ok
    bad = await probe_target(Target(None, "127.0.0.1", closed_port()))
    assert not bad.ok and bad.error.startswith("tcp connect")


def static_pool_service(n=2, **kw) -> RouterService:
    targets = [TargetConfig(f"t{i}", "127.0.0.1", 5000 + i) for i in range(n)]
    return RouterService(rconfig(targets, **kw))


async def test_quorum_wait_does_not_block_others(autojump_clock):
    local = TargetConfig("local", "127.0.0.1", 4999)
    svc = static_pool_service(quorum=2, quorum_timeout=3000, local_target=local,
                              local_target_filter="loc.*")
    svc.pool.report_probe("local", True, node_id="local-id")
    svc.pool.report_probe("t0", True, node_id="n0")
    results = {}

    async def waiter():
        results["wait"] = await svc.route(ConnectionInfo("1.1.1.1:1", container_id="k"))
        results["wait_at"] = trio.current_time()

    async def other():
        await trio.sleep(0.1)   # the thing under test: a connection arriving during the quorum wait
        results["local"] = await svc.route(ConnectionInfo("1.1.1.1:1", container_id="local1"))
        results["local_at"] = trio.current_time()

    start = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(waiter)
        n.start_soon(other)
        await trio.sleep(1.0)   # the thing under test: time passes below quorum (autojump clock)
        assert "wait" not in results  # still waiting for quorum...
        assert results["local"].local and results["local_at"] - start < 0.2  # ...others are not
        svc.pool.report_probe("t1", True, node_id="n1")
    d = results["wait"]
    assert d.ok and d.explanation.waited_s == pytest.approx(1.0, abs=0.01)
    assert svc.counters["quorum_waits"] == 1 and svc.counters["quorum_wait_timeouts"] == 0


async def test_quorum_wait_times_out(autojump_clock):
    svc = static_pool_service(quorum=2, quorum_timeout=3000)
    svc.pool.report_probe("t0", True, node_id="n0")
    start = trio.current_time()
    d = await svc.route(ConnectionInfo("1.1.1.1:1", container_id="k"))
    assert d.outcome is Outcome.REFUSED_UNAVAILABLE
    assert trio.current_time() - start == pytest.approx(3.0, abs=0.01)
    assert d.explanation.waited_s == pytest.approx(3.0, abs=0.01)
    assert svc.counters["quorum_wait_timeouts"] == 1
    assert svc.counters["route_refused_unavailable"] == 1
    svc2 = static_pool_service(quorum=2, quorum_timeout=0)
    start = trio.current_time()
    assert (await svc2.route(ConnectionInfo("1.1.1.1:1", container_id="k"))).outcome is \
        Outcome.REFUSED_UNAVAILABLE
    assert trio.current_time() == start


async def test_counters_filters_and_route_for_key():
    svc = static_pool_service(cache=CacheConfig(), key_type=KeyType.CLIENT_ID)
    svc.pool.report_probe("t0", True, node_id="n0")
    c = ConnectionInfo("1.1.1.1:1", container_id="abc.def")
    assert (await svc.route(c)).explanation.cache == "miss"
    assert (await svc.route(c)).explanation.cache == "hit"
    assert svc.counters["route_ok"] == 2 and svc.counters["cache_hit"] == 1
    assert svc.counters["cache_miss"] == 1
    svc.set_key_filter("^[^.]+")
    assert svc.get_key_filter() == "^[^.]+"
    assert (await svc.route(c)).explanation.key == "abc"
    d = svc.route_for_key("abc.def")  # management path: no key filter
    assert d.explanation.key == "abc.def"
    svc.set_key_filter(" ")
    assert svc.get_key_filter() is None
    with pytest.raises(ValueError, match="no local target"):
        svc.set_local_target_filter("x")
    assert {e["key"] for e in svc.cache_entries()} == {"abc.def", "abc"}
    assert json.dumps(svc.status())


async def test_embedded_cache_survives_restart_in_process(tmp_path):
    cache = CacheConfig(timeout_ms=0, persisted=True, backend="embedded",
                        path=tmp_path / "cache.log")
    a = static_pool_service(n=3, policy="ROUND_ROBIN", cache=cache)
    for i in range(3):
        a.pool.report_probe(f"t{i}", True, node_id=f"n{i}")
    first = {k: (await a.route(ConnectionInfo("1:1", container_id=k))).target.node_id
             for k in (f"c{i}" for i in range(30))}
    assert len(set(first.values())) == 3
    await a.aclose()
    b = static_pool_service(n=3, policy="ROUND_ROBIN", cache=cache)
    for i in range(3):
        b.pool.report_probe(f"t{i}", True, node_id=f"n{i}")
    for k, node in first.items():
        d = await b.route(ConnectionInfo("1:1", container_id=k))
        assert d.target.node_id == node and d.explanation.cache == "hit"


async def test_embedded_cache_expiry_survives_restart(tmp_path):
    now = [100.0]
    wall = [1_000_000.0]
    cache = CacheConfig(timeout_ms=1000, persisted=True, backend="embedded",
                        path=tmp_path / "c.log")
    a = RouterService(rconfig([TargetConfig("t0", "h", 1)], cache=cache),
                      clock=lambda: now[0], wall=lambda: wall[0])
    a.pool.report_probe("t0", True, node_id="n0")
    await a.route(ConnectionInfo("1:1", container_id="old"))
    now[0] += 0.6
    await a.route(ConnectionInfo("1:1", container_id="young"))
    await a.aclose()
    # restart 0.5 s later (wall clock), with a new monotonic origin
    b = RouterService(rconfig([TargetConfig("t0", "h", 1)], cache=cache),
                      clock=lambda: 5.0, wall=lambda: wall[0] + 1.1)
    assert [e["key"] for e in b.cache_entries()] == ["young"]
    await b.aclose()
    assert "old" not in b._store.load()


async def test_pins_reload(tmp_path, autojump_clock, nursery):
    pins = tmp_path / "pins.jsonl"
    pins.write_text('{"key": "gold", "node_id": "n1"}\n')
    svc = static_pool_service(n=2, pins=PinsConfig(pins), check_period=1000)
    svc.pool.report_probe("t0", True, node_id="n0")
    svc.pool.report_probe("t1", True, node_id="n1")
    # no management URL: the run() probes are TCP connects to closed ports; replace them
    svc._health_task = _no_probes
    await nursery.start(svc.run)
    assert (await svc.route(ConnectionInfo("1:1", container_id="gold"))).target.node_id == "n1"
    reloads = svc.counters["pins_reloads"]
    pins.write_text('{"key": "gold", "node_id": "n0"}\n{"key": "silver", "node_id": "n1"}\n')
    import os
    os.utime(pins, ns=(1, 1))
    await wait_for_async(lambda: svc.counters["pins_reloads"] > reloads, 5, what="the pins reload")
    assert (await svc.route(ConnectionInfo("1:1", container_id="gold"))).target.node_id == "n0"
    pins.write_text("{broken\n")
    os.utime(pins, ns=(2, 2))
    await wait_for_async(lambda: svc.counters["pins_errors"] > 0, 5, what="the broken pins read")
    assert svc.pins_error and "invalid JSON" in svc.pins_error
    assert (await svc.route(ConnectionInfo("1:1", container_id="gold"))).target.node_id == "n0"


async def _no_probes(task_status=trio.TASK_STATUS_IGNORED):
    task_status.started()
    await trio.sleep_forever()


def test_frozen_decision_replace():
    svc = static_pool_service()
    svc.pool.report_probe("t0", True, node_id="n0")
    d = svc.route_for_key("k")
    assert replace(d.explanation, waited_s=1.0).waited_s == 1.0


class CountingRedis:
    """A small in-memory stand-in for RedisCache (same methods) to count round trips."""

    def __init__(self):
        self.data: dict[str, str] = {}
        self.gets = 0
        self.writes: list = []
        self.fail = False

    def get(self, key):
        from router.errors import CacheBackendError
        self.gets += 1
        if self.fail:
            raise CacheBackendError("redis GET failed: connection refused")
        return self.data.get(key)

    def write(self, puts, touches, deletes):
        from router.errors import CacheBackendError
        if self.fail:
            raise CacheBackendError("redis write failed: connection refused")
        conflicts = {}
        for key, ident, old in puts:
            cur = self.data.get(key)
            if cur is None or cur in (ident, old):
                self.data[key] = ident
            else:
                conflicts[key] = cur
        self.writes.append((list(puts), list(touches), list(deletes)))
        return conflicts

    def ping(self):
        from router.errors import CacheBackendError
        if self.fail:
            raise CacheBackendError("redis PING failed")

    def close(self):
        pass


def redis_service(fake, policy="ROUND_ROBIN"):
    cache = CacheConfig(backend="redis", redis_url="redis://unused", timeout_ms=0)
    svc = RouterService(rconfig([TargetConfig(f"t{i}", "h", 1 + i) for i in range(3)],
                                policy=policy, cache=cache), redis_cache=fake)
    for i in range(3):
        svc.pool.report_probe(f"t{i}", True, node_id=f"n{i}")
    svc._health_task = _no_probes
    return svc


async def test_redis_tier_hot_hit_has_no_round_trip_and_conflicts_converge(nursery):
    fake = CountingRedis()
    svc = redis_service(fake)
    await nursery.start(svc.run)
    c = ConnectionInfo("1:1", container_id="k")
    d = await svc.route(c)
    assert fake.gets == 1 and d.explanation.cache == "miss"
    for _ in range(5):
        assert (await svc.route(c)).explanation.cache_tier == "local"
    assert fake.gets == 1  # hits never ask Redis
    await wait_for_async(lambda: fake.data.get("k") == d.target.node_id, 5, interval_s=0.01,
                         what="the write-behind of k")
    # another replica decided "k2" first: our write-behind loses and we adopt its choice
    fake.data["k2"] = "n2"
    svc.core.cache.put("k2", "n0", svc.clock())
    await wait_for_async(lambda: svc.core.cache.entries["k2"][0] == "n2", 5, interval_s=0.01,
                         what="the other replica's choice adopted")
    assert svc.counters["redis_conflicts"] == 1
    # a Redis value pointing to a node that is down is stale: the policy decides and replaces it
    fake.data["k3"] = "n1"
    svc.pool.report_probe("t1", False, error="down")
    d3 = await svc.route(ConnectionInfo("1:1", container_id="k3"))
    assert d3.ok and d3.target.node_id != "n1"
    await wait_for_async(lambda: fake.data["k3"] == d3.target.node_id, 5, interval_s=0.01,
                         what="the stale entry replaced")


async def test_redis_down_degrades_without_failing(nursery):
    # real clock: with an autojump clock the 50 ms Redis deadline fires before the worker
    # thread even runs
    fake = CountingRedis()
    fake.fail = True
    svc = redis_service(fake)
    await nursery.start(svc.run)
    ds = [await svc.route(ConnectionInfo("1:1", container_id=f"k{i}")) for i in range(20)]
    assert all(d.ok for d in ds) and svc.degraded and fake.gets == 1  # no reads while degraded
    fake.fail = False
    # the writer pings once a second, then flushes the queue
    await wait_for_async(lambda: not svc.degraded and {f"k{i}" for i in range(20)} <= set(fake.data), 5,
                         what="back from degraded, the queue flushed")


async def test_local_target_without_a_pool_probes_with_its_own_credentials(tmp_path):
    """A pool-less router's local target must be probed with the credentials given on it."""
    import json as _json

    import trio as _trio

    from broker.wire.io.http import json_response, require_basic_auth, serve_http
    from router.config import load_router_config
    from router.service import build_services

    async def broker_mgmt(request):
        require_basic_auth(request, lambda u, p: (u, p) == ("ops", "secret"))
        return json_response({"node_id": "n-local", "active": True, "connection_count": 0})

    async with _trio.open_nursery() as nursery:
        host, port = await nursery.start(lambda task_status: serve_http(broker_mgmt, "127.0.0.1", 0,
                                                                         task_status=task_status))
        cfg_file = tmp_path / "r.toml"
        cfg_file.write_text(
            '[routers.r]\nkey-type = "CLIENT_ID"\nlocal-target-filter = "NULL|0"\n'
            '[routers.r.local-target]\nhost = "127.0.0.1"\nport = 5672\n'
            f'management-url = "http://{host}:{port}"\nusername = "ops"\npassword = "secret"\n'
            '[routers.r.policy]\nname = "CONSISTENT_HASH_MODULO"\nproperties = { MODULO = 2 }\n')
        service = build_services(load_router_config(cfg_file))["r"]
        await nursery.start(service.run)
        snapshot = _json.dumps(service.pool.snapshot(), default=str)
        assert "n-local" in snapshot, snapshot
        nursery.cancel_scope.cancel()


# -- one key per connection ----------------------------------------------------------------------
class FilterFlippingRedis(CountingRedis):
    """A Redis read during which the operator replaces the key filter (management PUT)."""

    def __init__(self, svc_box):
        super().__init__()
        self.svc_box = svc_box
        self.keys_read: list[str] = []

    def get(self, key):
        self.keys_read.append(key)
        self.svc_box[0].set_key_filter("^[^.]+")
        return super().get(key)


async def test_a_key_filter_replaced_during_the_redis_read_does_not_split_the_connection(nursery):
    """The key used to be resolved again after the Redis read: the read was for ``abc.def``,
    the decision and its cache entry for ``abc`` (and the write-behind for yet another key)."""
    box = []
    fake = FilterFlippingRedis(box)
    svc = redis_service(fake)
    box.append(svc)
    await nursery.start(svc.run)
    d = await svc.route(ConnectionInfo("1.1.1.1:1", container_id="abc.def"))
    assert fake.keys_read == ["abc.def"]
    assert d.ok and d.explanation.key == "abc.def" and d.explanation.raw_key == "abc.def"
    assert "abc.def" in svc.core.cache.entries and "abc" not in svc.core.cache.entries
    # the next connection resolves with the new filter
    assert (await svc.route(ConnectionInfo("1.1.1.1:1", container_id="abc.def"))).explanation.key == "abc"


async def test_route_resolves_the_key_once_through_a_quorum_wait(autojump_clock):
    svc = static_pool_service(quorum=2, quorum_timeout=3000)
    svc.pool.report_probe("t0", True, node_id="n0")
    core_resolve = svc.core.resolve
    calls = []

    def counting(conn):
        calls.append(conn)
        return core_resolve(conn)

    svc.core.resolve = counting
    async with trio.open_nursery() as n:
        async def flap():
            # the thing under test: the pool flapping over time (autojump clock) while the
            # connection waits; pool changes wake the waiter, which decides again each time
            for _ in range(3):
                await trio.sleep(0.5)
                svc.pool.report_probe("t0", False)
                await trio.sleep(0.1)
                svc.pool.report_probe("t0", True, node_id="n0")
            await trio.sleep(0.5)
            svc.pool.report_probe("t1", True, node_id="n1")

        n.start_soon(flap)
        d = await svc.route(ConnectionInfo("1.1.1.1:1", container_id="k"))
    assert d.ok and d.explanation.waited_s > 2
    assert len(calls) == 1
