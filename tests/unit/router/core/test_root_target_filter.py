"""``root-target-filter``: keys that match it whole go to the cluster's root (OpenAMQ's model,
docs/cluster.md), before pins and the cache, never cached; no root or the root not ready:
REFUSED_UNAVAILABLE. Pure: a pool whose root is set by hand, as a cluster source sets it."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import load_router_config
from router.core.cache import StickyCache
from router.core.decide import Outcome, Router
from router.core.filters import compile_key_filter, compile_local_filter
from router.core.keys import ConnectionInfo, KeyResolver, KeyType
from router.core.pins import parse_pins
from router.core.pool import Pool, TargetState
from router.policies import Target, create_policy
from broker.wire.io.tomlconfig import ConfigError


def _router(*, pins=None, local=None):
    targets = [Target(None, "127.0.0.1", 6000 + i, name=f"t{i}", management_url=f"http://x/{i}") for i in range(3)]
    pool = Pool(targets, local_target=local)
    for i in range(3):
        pool.report_probe(f"t{i}", True, node_id=f"n{i}", connection_count=0, now=1.0)
    r = Router("r", KeyResolver(KeyType.CLIENT_ID, compile_key_filter(None)),
               policy=create_policy("FIRST_ELEMENT", {}), pool=pool, cache=StickyCache(0),
               root_filter=compile_local_filter("critical-.*", from_config=True), pins=pins)
    return r, pool


def C(cid: str) -> ConnectionInfo:
    return ConnectionInfo(source="10.0.0.1:5000", container_id=cid)


def test_matching_keys_follow_the_root_and_are_never_cached():
    r, pool = _router()
    pool.root = "n2"
    d = r.decide(C("critical-orders"), 2.0)
    assert d.outcome is Outcome.OK and d.target.node_id == "n2"
    assert "root-target-filter matched: the cluster's root n2" in d.explanation.reason
    assert r.cache.get("critical-orders", 2.0) is None          # the root moves: nothing cached
    # a key that does not match whole follows the policy (FIRST_ELEMENT: n0) and is cached
    d = r.decide(C("x-critical-orders"), 2.0)
    assert d.target.node_id == "n0" and r.cache.get("x-critical-orders", 2.0) is not None
    pool.root = "n1"                                            # a new root elected
    assert r.decide(C("critical-orders"), 3.0).target.node_id == "n1"


def test_no_root_or_a_root_not_ready_is_unavailable():
    r, pool = _router()
    d = r.decide(C("critical-a"), 2.0)
    assert d.outcome is Outcome.REFUSED_UNAVAILABLE and "has no root now" in d.explanation.reason
    pool.root = "n1"
    pool.report_probe("t1", False, error="down", now=2.0)
    d = r.decide(C("critical-a"), 2.0)
    assert d.outcome is Outcome.REFUSED_UNAVAILABLE and "the root n1 is not ready" in d.explanation.reason


def test_the_root_wins_over_pins_and_a_broker_on_the_root_keeps_the_client():
    r, pool = _router(pins=parse_pins('{"key": "critical-a", "node_id": "n0"}\n'))
    pool.root = "n2"
    assert r.decide(C("critical-a"), 2.0).target.node_id == "n2"
    local = Target("me", "127.0.0.1", 7000, name="me")
    r, pool = _router(local=local)
    r.local = TargetState(local, local=True)
    r.local.ready = True
    pool.root = "me"
    d = r.decide(C("critical-a"), 2.0)
    assert d.outcome is Outcome.OK and d.local and d.target is local


def test_config_needs_a_cluster_pool(tmp_path: Path):
    base = '[routers.main]\nkey-type = "CLIENT_ID"\nroot-target-filter = "critical-.*"\n'
    p = tmp_path / "router.toml"
    p.write_text(base + '[routers.main.policy]\nname = "FIRST_ELEMENT"\n[routers.main.pool]\nsource = "cluster"\n'
                        'seed-connectors = ["http://127.0.0.1:8161"]\n')
    assert load_router_config(p).routers["main"].root_target_filter == "critical-.*"
    p.write_text(base + '[routers.main.policy]\nname = "FIRST_ELEMENT"\n[[routers.main.pool.targets]]\nhost = "h"\nport = 1\n')
    with pytest.raises(ConfigError) as e:
        load_router_config(p)
    assert e.value.path == "routers.main.root-target-filter" and "needs a pool with source" in str(e.value)
    p.write_text(base.replace('"critical-.*"', '"critical-("'))
    with pytest.raises(ConfigError) as e:
        load_router_config(p)
    assert e.value.path == "routers.main.root-target-filter"
