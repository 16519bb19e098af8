"""Routing decisions through the service: quorum waits, the local target first, pinned routes,
IPv4-mapped sources, explanations (moved from the issue #3 review files)."""

from __future__ import annotations

import json
import textwrap

import pytest
import trio

from router.config import (CacheConfig, PinsConfig, PolicyConfig, PoolConfig, RouterConfig,
                           TargetConfig)
from router.core.cache import StickyCache
from router.core.decide import Outcome, Router
from router.core.keys import ConnectionInfo, KeyResolver, KeyType, lodestone_source_key
from router.core.pool import Pool
from router.policies import Target, create_policy
from router.service import RouterService


def svc_config(n=2, *, policy="FIRST_ELEMENT", props=None, quorum=1, quorum_timeout=3000,
               cache=None, local=None, local_enabled=False) -> RouterConfig:
    return RouterConfig("r", key_type=KeyType.CLIENT_ID, policy=PolicyConfig(policy, props or {}),
                        cache=cache, local_target=local,
                        pool=PoolConfig(quorum_size=quorum, quorum_timeout_ms=quorum_timeout,
                                        local_target_enabled=local_enabled,
                                        targets=tuple(TargetConfig(f"t{i}", "h", 1 + i)
                                                      for i in range(n))))

# -- quorum ---------------------------------------------------------------------------------
async def test_quorum_wait_blocks_only_the_waiting_connection(autojump_clock):
    """Below quorum a cache miss waits; meanwhile a cache hit (quorum ignored) is served."""
    svc = RouterService(svc_config(2, quorum=2, cache=CacheConfig()))
    svc.pool.report_probe("t0", True, node_id="n0")
    svc.pool.report_probe("t1", True, node_id="n1")
    assert (await svc.route(ConnectionInfo("1:1", container_id="hot"))).target.node_id == "n0"
    svc.pool.report_probe("t1", False, error="down")  # 1 of 2 ready: below quorum
    got = {}

    async def cold():
        got["cold"] = await svc.route(ConnectionInfo("1:1", container_id="cold"))
        got["cold_at"] = trio.current_time()

    async def hot():
        await trio.sleep(0.1)   # the thing under test: a cache hit arriving during the quorum wait
        got["hot"] = await svc.route(ConnectionInfo("1:1", container_id="hot"))
        got["hot_at"] = trio.current_time()

    start = trio.current_time()
    async with trio.open_nursery() as n:
        n.start_soon(cold)
        n.start_soon(hot)
        await trio.sleep(1.0)   # the thing under test: time passes below quorum (autojump clock)
        assert "cold" not in got
        assert got["hot"].ok and got["hot"].explanation.cache == "hit"
        assert got["hot_at"] - start == pytest.approx(0.1)
        svc.pool.report_probe("t1", True, node_id="n1")
    assert got["cold"].ok and got["cold_at"] - start == pytest.approx(1.0)
    assert got["cold"].explanation.waited_s == pytest.approx(1.0)

def test_below_quorum_offers_no_targets_to_the_policy():
    seen = []

    class Spy(create_policy("FIRST_ELEMENT").__class__):
        def select_target(self, targets, key):
            seen.append(tuple(targets))
            return super().select_target(targets, key)

    pool = Pool([Target(None, "h", i, name=f"t{i}") for i in range(3)], quorum_size=2)
    r = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=Spy(), pool=pool)
    pool.set_ready("t0", True, "n0")
    d = r.decide(ConnectionInfo("1:1", container_id="k"), 0.0)
    assert d.outcome is Outcome.REFUSED_UNAVAILABLE and seen == [()]
    assert not d.explanation.quorum_met and d.explanation.ready_targets == 1

# -- local target first ---------------------------------------------------------------------
async def test_service_local_target_enabled_is_first():
    local = TargetConfig("local", "127.0.0.1", 5999, node_id="local-id")
    svc = RouterService(svc_config(2, local=local, local_enabled=True))
    assert [st.target.name for st in svc.pool.members] == ["local", "t0", "t1"]
    for name in ("t1", "t0", "local"):
        svc.pool.report_probe(name, True)
    d = await svc.route(ConnectionInfo("1:1", container_id="x"))
    assert d.local and d.target.name == "local"
    svc.pool.report_probe("local", False, error="down")
    d = await svc.route(ConnectionInfo("1:1", container_id="x"))
    assert not d.local and d.target.name == "t0"

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

# -- keys -----------------------------------------------------------------------------------
def test_bare_ipv4_mapped_source_is_the_ipv4_client():
    """``[::ffff:10.0.0.1]:5000`` gave ``10.0.0.1`` but the bare form kept the v6 text, so the
    same client got two keys depending on how the edge printed the peer."""
    assert lodestone_source_key("::ffff:10.0.0.1") == "10.0.0.1"
    assert lodestone_source_key("[::ffff:10.0.0.1]:5000") == "10.0.0.1"

def test_explanations_stay_json_with_odd_keys():
    pool = Pool([Target("n0", "h", 1, name="t0")])
    pool.set_ready("t0", True)
    r = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy("FIRST_ELEMENT"),
               pool=pool, cache=StickyCache(0))
    d = r.decide(ConnectionInfo("1:1", container_id="ключ\x00"), 0.0)
    assert json.loads(json.dumps(d.to_dict()))["explanation"]["key"] == "ключ\x00"
