"""Policy properties that hold for any key: bounded load, seeded round robin, huge and non-ASCII
keys (moved from the issue #3 review files). Lone surrogates through MURMUR3, in a child process:
tests/integration/test_router_hash_lone_surrogate.py."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from router.config import PolicyConfig, PoolConfig, RouterConfig, TargetConfig
from router.core.cache import StickyCache
from router.core.decide import Router
from router.core.keys import ConnectionInfo, KeyResolver, KeyType
from router.core.pool import Pool
from router.policies import Target, create_policy, fnv1a_utf16
from router.service import RouterService


POLICIES = [("FIRST_ELEMENT", {}), ("ROUND_ROBIN", {}), ("LEAST_CONNECTIONS", {}),
            ("CONSISTENT_HASH", {}), ("CONSISTENT_HASH", {"HASH": "FNV1A", "VIRTUAL_NODES": "1"}),
            ("CONSISTENT_HASH", {"LOAD_FACTOR": "1.25"})]

def svc_config(n=2, *, policy="FIRST_ELEMENT", props=None, quorum=1, quorum_timeout=3000,
               cache=None, local=None, local_enabled=False) -> RouterConfig:
    return RouterConfig("r", key_type=KeyType.CLIENT_ID, policy=PolicyConfig(policy, props or {}),
                        cache=cache, local_target=local,
                        pool=PoolConfig(quorum_size=quorum, quorum_timeout_ms=quorum_timeout,
                                        local_target_enabled=local_enabled,
                                        targets=tuple(TargetConfig(f"t{i}", "h", 1 + i)
                                                      for i in range(n))))

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

# -- round robin from the seeded rng --------------------------------------------------------
async def test_round_robin_start_comes_from_the_seeded_rng():
    starts = []
    for seed in (11, 11, 12):
        svc = RouterService(svc_config(7, policy="ROUND_ROBIN"), rng=random.Random(seed))
        for i in range(7):
            svc.pool.report_probe(f"t{i}", True, node_id=f"n{i}")
        starts.append((await svc.route(ConnectionInfo("1:1", container_id="k"))).target.name)
        assert starts[-1] == f"t{random.Random(seed).randrange(2**31 - 1) % 7}"
    assert starts[0] == starts[1]

# -- bounded load ---------------------------------------------------------------------------
@pytest.mark.parametrize("factor", ["1.0", "1.1", "1.25", "2"])
def test_bounded_load_never_exceeds_ceil_factor_times_mean(factor):
    """Exact bound (no slack): max load <= ceil(c * total / n) after every assignment."""
    p = create_policy("CONSISTENT_HASH", {"LOAD_FACTOR": factor})
    ts = [Target(f"node-{i}", "h", i, name=f"t{i}") for i in range(5)]
    c = Fraction(factor)
    for total in range(1, 3001):
        p.select_target(ts, f"key-{total}")
        assert max(p.loads.values()) <= math.ceil(c * total / 5), total

# -- keys: huge and non-ASCII ---------------------------------------------------------------
@pytest.mark.parametrize("name,props", POLICIES)
@pytest.mark.parametrize("key", ["k" * 1_000_000, "ключ-é-中文-😀", "\ud800lone", "", "NULL"])
def test_huge_and_non_ascii_keys_route(name, props, key):
    pool = Pool([Target(f"node-{i}", "h", i, name=f"t{i}") for i in range(3)])
    for i in range(3):
        pool.set_ready(f"t{i}", True)
    r = Router("r", KeyResolver(KeyType.CLIENT_ID), policy=create_policy(name, props),
               pool=pool, cache=StickyCache(0))
    d = r.decide(ConnectionInfo("1:1", container_id=key), 0.0)
    assert d.ok and d.explanation.key == key
    assert r.decide(ConnectionInfo("1:1", container_id=key), 1.0).target == d.target
    if name == "CONSISTENT_HASH" and props.get("VIRTUAL_NODES") == "1" and key:
        h = fnv1a_utf16(key)  # Artemis: floor, else the smallest point
        pts = sorted((fnv1a_utf16(f"node-{i}"), i) for i in range(3))
        below = [i for hp, i in pts if hp <= h]
        assert d.target.name == f"t{below[-1] if below else pts[0][1]}"
