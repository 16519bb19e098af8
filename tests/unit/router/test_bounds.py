"""Issue 7, the router's bounds (pure parts): LRU cap of the sticky cache, paging, key-length
refusal, bounded routing-log fields, embedded-file compaction and torn-write rollback,
routing-log write errors that never escape, config keys."""

from __future__ import annotations

import json
import os

import pytest

from broker.wire.io.tomlconfig import ConfigError
from router.cache_embedded import EmbeddedCacheStore
from router.config import CacheConfig, load_router_config
from router.core.cache import StickyCache, page
from router.core.decide import Outcome
from router.core.keys import ConnectionInfo, KeyType
from router.routelog import RouteLog, json_str_bounded, truncate_field
from tests.unit.router.test_service import static_pool_service


# -- LRU ------------------------------------------------------------------------------------
@pytest.mark.parametrize("touch, expect_kept", [
    (None, {"k2", "k3", "k4"}),          # no access: the oldest puts go first
    ("k0", {"k0", "k3", "k4"}),          # a get makes k0 the most recently used
])
def test_lru_evicts_least_recently_used_and_counts(touch, expect_kept):
    c = StickyCache(max_entries=3, track_changes=True)
    for i in range(3):
        c.put(f"k{i}", "n", float(i))
    if touch:
        assert c.get(touch, 10.0) is not None
    c.drain()
    c.put("k3", "n", 11.0)
    c.put("k4", "n", 12.0)
    assert set(c.entries) == expect_kept
    assert c.evictions == 2 and len(c) == 3
    changes, _ = c.drain()
    # an eviction is logged as a deletion (the embedded file forgets it as well)
    assert {k for k, v in changes.items() if v is None} == {"k0", "k1", "k2"} - expect_kept


def test_lru_eviction_does_not_delete_a_shared_tier_entry():
    c = StickyCache(max_entries=1, track_changes=True, log_expiry=False)
    c.put("a", "n", 0.0)
    c.put("b", "n", 1.0)
    changes, _ = c.drain()
    assert changes == {"a": "n", "b": "n"} and c.evictions == 1


def test_restore_respects_the_cap_and_put_same_value_refreshes_order():
    c = StickyCache(max_entries=2)
    c.restore("a", "n", 0.0, 0.0)
    c.restore("b", "n", 0.0, 0.0)
    c.put("a", "n", 5.0)         # unchanged value: only the access order moves
    c.restore("c", "n", 6.0, 6.0)
    assert list(c.entries) == ["a", "c"] and c.evictions == 1


# -- paging -----------------------------------------------------------------------------------
@pytest.mark.parametrize("n, limit", [(0, 5), (3, 5), (5, 5), (11, 5), (100, 7), (10, 1)])
def test_paging_walks_every_key_once_in_order(n, limit):
    rows = [(f"k{i:03d}", i) for i in reversed(range(n))]
    seen, after, pages = [], None, 0
    while True:
        got, nxt = page(iter(rows), after=after, limit=limit)
        assert len(got) <= limit
        seen += [r[0] for r in got]
        pages += 1
        if nxt is None:
            break
        assert nxt == got[-1][0]
        after = nxt
    assert seen == sorted(r[0] for r in rows)
    assert pages == max(1, -(-n // limit))


# -- truncation -------------------------------------------------------------------------------
@pytest.mark.parametrize("value, limit, expected", [
    ("abc", 3, "abc"),
    ("abcd", 3, "abc...[truncated, 4 chars]"),
    ("é" * 70_000, 5, "ééééé...[truncated, 70000 chars]"),
])
def test_truncate_field(value, limit, expected):
    assert truncate_field(value, limit) == expected
    assert json.loads(json_str_bounded(value, limit)) == expected


@pytest.mark.parametrize("value", [None, "", "x" * 64, 'quote"and\\back\n'])
def test_bounded_json_matches_json_dumps_when_short(value):
    assert json_str_bounded(value, 64) == json.dumps(value, ensure_ascii=False)


# -- key length -------------------------------------------------------------------------------
async def test_a_key_over_max_key_length_is_refused_and_never_cached():
    svc = static_pool_service(cache=CacheConfig(max_entries=10), key_type=KeyType.CLIENT_ID,
                              max_key_length=16)
    svc.pool.report_probe("t0", True, node_id="n0")
    ok = await svc.route(ConnectionInfo("1.1.1.1:1", container_id="x" * 16))
    assert ok.outcome is Outcome.OK
    d = await svc.route(ConnectionInfo("1.1.1.1:1", container_id="x" * 60_000))
    assert d.outcome is Outcome.REFUSED_USE_ANOTHER
    assert d.explanation.reason == "key too long (60000 characters; max-key-length is 16)"
    assert d.explanation.key == "NULL" and d.explanation.cache == "skipped"
    assert [e["key"] for e in svc.cache_entries()] == ["x" * 16]
    assert svc.counters["key_too_long"] == 1
    assert svc.key_too_long("y" * 17) is not None and svc.key_too_long("y" * 16) is None
    assert svc.route_for_key("y" * 17).outcome is Outcome.REFUSED_USE_ANOTHER


async def test_cache_page_of_the_service_and_eviction_counter():
    svc = static_pool_service(cache=CacheConfig(max_entries=5), key_type=KeyType.CLIENT_ID)
    svc.pool.report_probe("t0", True, node_id="n0")
    for i in range(8):
        await svc.route(ConnectionInfo("1:1", container_id=f"c{i}"))
    assert svc.counters["cache_evictions"] == 3
    p1 = svc.cache_page(after=None, limit=2)
    assert p1["total"] == 5 and [e["key"] for e in p1["entries"]] == ["c3", "c4"] and p1["next"] == "c4"
    p3 = svc.cache_page(after="c6", limit=2)
    assert [e["key"] for e in p3["entries"]] == ["c7"] and p3["next"] is None


# -- embedded file ----------------------------------------------------------------------------
def test_embedded_file_compaction_follows_live_entries(tmp_path):
    store = EmbeddedCacheStore(tmp_path / "c.log", fsync=False, compact_min_records=16)
    live = {}
    for i in range(200):
        live[f"k{i % 8}"] = ("n", float(i), float(i))
        store.write([(f"k{i % 8}", "n", float(i), float(i))], [], [])
        if store.needs_compaction(len(live)):
            store.compact([(k, *v) for k, v in live.items()])
    assert store.records <= 16 + 1
    assert EmbeddedCacheStore(tmp_path / "c.log").load() == live


def test_embedded_write_failure_leaves_no_torn_record(tmp_path):
    path = tmp_path / "c.log"
    store = EmbeddedCacheStore(path, fsync=False)
    store.write([("a", "n", 1.0, 1.0)], [], [])
    size = path.stat().st_size
    real_write = os.write

    def failing_write(fd, data):  # half a record, then ENOSPC
        os.write = real_write
        real_write(fd, bytes(data[:7]))
        raise OSError(28, "No space left on device")

    os.write = failing_write
    try:
        with pytest.raises(OSError):
            store.write([("b", "n", 2.0, 2.0)], [], [])
    finally:
        os.write = real_write
    assert path.stat().st_size == size
    store.write([("b", "n", 2.0, 2.0)], [], [])
    loaded = EmbeddedCacheStore(path).load()
    assert set(loaded) == {"a", "b"}


# -- routing log errors -----------------------------------------------------------------------
async def test_routing_log_write_error_is_reported_retried_and_never_raised(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    log = RouteLog(tmp_path / "logs" / "r.log", flush_interval_s=3600)
    log.path = blocker / "r.log"  # open() fails with ENOTDIR, as EMFILE/ENOSPC would
    log.write({"i": 1})
    await log.flush(force=True)
    assert log.error is not None and "not-a-dir" in log.error
    assert log.write_errors == 1 and log.lines_written == 0 and len(log._buffer) == 1
    log.write({"i": 2})
    log.path = tmp_path / "logs" / "r.log"  # the disk is back
    await log.flush(force=True)
    assert log.error is None and log.lines_written == 2
    assert [json.loads(x)["i"] for x in log.path.read_text().splitlines()] == [1, 2]
    await log.aclose()


def test_routing_log_buffer_is_bounded_in_bytes(tmp_path):
    log = RouteLog(tmp_path / "r.log", max_buffered_bytes=1000, flush_interval_s=3600)
    for _ in range(50):
        log.write_line('{"pad":"' + "x" * 100 + '"}')
    assert log._buffered <= 1000 + 120 and log.lines_dropped >= 40


# -- config -----------------------------------------------------------------------------------
BASE = """
[routing-log]
{log}
[routers.r]
key-type = "CLIENT_ID"
{router}
[routers.r.cache]
{cache}
[[acceptors]]
name = "a"
port = 0
router = "r"
"""


def _load(tmp_path, log="", router="", cache=""):
    p = tmp_path / "router.toml"
    p.write_text(BASE.format(log=log, router=router, cache=cache))
    return load_router_config(p)


def test_config_defaults_and_errors(tmp_path):
    cfg = _load(tmp_path)
    rc = cfg.routers["r"]
    assert rc.max_key_length == 255 and rc.cache.max_entries == 100_000
    assert cfg.routing_log.max_field_chars == 1024 and rc.cache.redis_connect_timeout_ms == 1000
    cfg = _load(tmp_path, router="max-key-length = 1000", cache="max-entries = 7")
    assert cfg.routers["r"].max_key_length == 1000 and cfg.routers["r"].cache.max_entries == 7
    with pytest.raises(ConfigError, match=r"routers\.r\.max-key-length: 2000 must be <= "
                                          r"routing-log\.max-field-chars \(1024\)"):
        _load(tmp_path, router="max-key-length = 2000")
    with pytest.raises(ConfigError, match=r"max-entries: 0 must be > 0"):
        _load(tmp_path, cache="max-entries = 0")
    with pytest.raises(ConfigError, match=r"max-key-length: 0 must be > 0"):
        _load(tmp_path, router="max-key-length = 0")


# -- the pump's shared poller: no descriptor per connection -------------------------------------
import trio  # noqa: E402

from router.net import proxy as proxy_mod  # noqa: E402
from tests.unit.router.net import test_proxy as pump_tests  # noqa: E402
from tests.waiting import wait_for_async  # noqa: E402


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("use_splice", [True, False])
async def test_the_pump_tests_pass_through_the_shared_poller(use_splice):
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy_mod.SharedPoller().run)
        assert proxy_mod.active_poller() is not None
        await pump_tests.test_bytes_both_ways_and_half_close(use_splice)
        await pump_tests.test_upstream_reset_ends_both_directions(use_splice)
        await pump_tests.test_idle_timeout_ends_a_silent_connection(use_splice)
        nursery.cancel_scope.cancel()
    assert proxy_mod.active_poller() is None


async def test_small_phase_costs_no_descriptor_per_connection():
    n = 40
    poller = proxy_mod.SharedPoller()
    async with trio.open_nursery() as nursery:
        await nursery.start(poller.run)
        pairs = []
        for _ in range(n):
            client_app, client_side = await pump_tests._pair()
            upstream_side, broker_app = await pump_tests._pair()
            pairs.append((client_app, client_side, upstream_side, broker_app))
        baseline = _open_fds()
        results = []

        async def one(client_side, upstream_side):
            results.append(await proxy_mod.pump(client_side, upstream_side, idle_timeout_s=10))

        for _app, cs, us, _b in pairs:
            nursery.start_soon(one, cs, us)
        # every connection is parked in the small phase: its two sockets in the shared epoll set
        await wait_for_async(lambda: len(poller._owners) == 2 * n, 5, interval_s=0.01,
                             what=f"{n} connections parked in the shared poller")
        during = _open_fds()
        for client_app, _cs, _us, broker_app in pairs:  # a frame each way, then both close
            await client_app.send_all(b"open")
            assert await broker_app.receive_some(10) == b"open"
            await broker_app.send_all(b"ok")
            assert await client_app.receive_some(10) == b"ok"
            await client_app.send_eof()
            await broker_app.send_eof()
        await wait_for_async(lambda: len(results) == n, 10, interval_s=0.01, what=f"{n} pumps ended")
        nursery.cancel_scope.cancel()
    assert during == baseline  # the old pump held one epoll descriptor per connection here
    assert all(r.reason is proxy_mod.EndReason.CLOSED and r.bytes_up == 4 and r.bytes_down == 2
               for r in results)
    for group in pairs:
        for s in group:
            await s.aclose()


# -- descriptor budget --------------------------------------------------------------------------
def test_budget_warning_counts_two_descriptors_per_proxied_connection():
    from router.config import AcceptorConfig
    from router.fdlimit import budget_warning, needed_descriptors

    proxy = AcceptorConfig("p", "127.0.0.1", 0, "r", mode="proxy", max_connections=10_000)
    redirect = AcceptorConfig("d", "127.0.0.1", 0, "r", max_connections=1_000)
    assert needed_descriptors([proxy, redirect]) == 64 + 20_000 + 1_000
    assert needed_descriptors([AcceptorConfig("u", "127.0.0.1", 0, "r", max_connections=0)]) is None
    assert budget_warning([proxy, redirect], 1 << 20) is None
    w = budget_warning([proxy, redirect], 1024)
    assert w.startswith("max-connections needs about 21064 file descriptors (p 10000 x 2, d 1000 x 1 + "
                        "64 overhead) but the open-files limit is 1024: only about 960")


def test_check_prints_the_budget_warning_and_still_exits_0(tmp_path, capsys):
    import resource

    from router.__main__ import main

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    too_many = (1 << 21) if hard == resource.RLIM_INFINITY else hard  # proxy: 2 per connection
    p = tmp_path / "router.toml"
    p.write_text(BASE.format(log="", router="", cache="").replace(
        'router = "r"', f'router = "r"\nmode = "proxy"\nmax-connections = {too_many}'))
    assert main(["check", str(p)]) == 0
    out = capsys.readouterr()
    assert "ok (1 router(s), 1 acceptor(s))" in out.out
    assert "warning: max-connections needs about" in out.err
