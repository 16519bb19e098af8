"""Stickiness survives a router restart with the embedded persisted cache: a real router process
is SIGKILLed (no clean shutdown) and a new one takes over the same cache file."""

from __future__ import annotations

import pytest

from routing_cache_helpers import TargetSockets, Worker, router_toml

pytestmark = pytest.mark.slow


@pytest.fixture
def targets():
    t = TargetSockets(3)
    yield t
    t.close()


def test_stickiness_survives_router_crash(tmp_path, targets):
    cfg = tmp_path / "router.toml"
    cfg.write_text(router_toml(targets.ports, 'persisted = true\ntimeout = 0\npath = "cache.log"'))
    keys = [f"client-{i}" for i in range(40)]
    a = Worker(cfg, seed=1)
    try:
        first = {k: a.route(k) for k in keys}
        assert all(r["outcome"] == "OK" and r["cache"] == "miss" for r in first.values())
        assert len({r["node_id"] for r in first.values()}) == 3  # round robin spread them
        a.wait_status(lambda s: s["counters"]["persist_writes"] >= 1)
    finally:
        a.kill()  # SIGKILL: only what was flushed survives
    # a second router with another seed: without the cache its round robin would differ
    b = Worker(cfg, seed=2)
    try:
        for k in keys:
            r = b.route(k)
            assert r["outcome"] == "OK" and r["cache"] == "hit"
            assert r["node_id"] == first[k]["node_id"], k
        fresh = [b.route(f"new-{i}")["node_id"] for i in range(6)]
        assert len(set(fresh)) == 3
    finally:
        b.quit()
    c = Worker(cfg, seed=3)  # a clean shutdown (quit) flushed the new keys too
    try:
        assert c.route("new-0")["cache"] == "hit"
    finally:
        c.quit()


def test_cached_target_down_then_new_choice_persists(tmp_path, targets):
    cfg = tmp_path / "router.toml"
    cfg.write_text(router_toml(targets.ports, 'persisted = true\npath = "cache.log"',
                               policy="FIRST_ELEMENT"))
    a = Worker(cfg, seed=1)
    try:
        assert a.route("k")["node_id"] == "node-0"
        targets.socks[0].close()  # broker 0 goes away: TCP probe fails within a check period
        a.wait_status(lambda s: not s["pool"]["targets"][0]["ready"])
        r = a.route("k")
        assert r["node_id"] == "node-1" and r["cache"] == "stale"
        a.wait_status(lambda s: s["counters"]["persist_writes"] >= 2)
    finally:
        a.kill()
    b = Worker(cfg, seed=1)
    try:
        assert b.route("k") == {"key": "k", "outcome": "OK", "node_id": "node-1", "cache": "hit",
                                "tier": "local"}
    finally:
        b.quit()
