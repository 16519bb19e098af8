"""Pure table of fail-back (``[routers.<r>.cache] fail-back``): a key's cached target goes down,
the key connects, the target returns, the key connects again."""

from __future__ import annotations

import pytest

from router.core.cache import StickyCache
from router.core.decide import Router
from router.core.keys import ConnectionInfo, KeyResolver, KeyType
from router.core.pool import Pool
from router.policies import Target, create_policy


def _router(fail_back: str) -> tuple[Router, Pool]:
    pool = Pool([Target(None, "127.0.0.1", 6000 + i, name=f"t{i}") for i in range(2)])
    for i in range(2):
        pool.report_probe(f"t{i}", True, node_id=f"n{i}")
    r = Router("r", KeyResolver(KeyType.CLIENT_ID, None), policy=create_policy("FIRST_ELEMENT", {}),
               pool=pool, cache=StickyCache(0), fail_back=fail_back)
    return r, pool


@pytest.mark.parametrize("fail_back,during,entry_during,after", [
    ("stay", "n1", "n1", "n1"),      # Artemis: the new choice overwrites the entry
    ("return", "n1", "n0", "n0"),    # the entry waits for its target
])
def test_fail_back(fail_back, during, entry_during, after):
    r, pool = _router(fail_back)
    c = ConnectionInfo("10.0.0.1:1", container_id="k")
    assert r.decide(c, 0.0).node_id == "n0"
    pool.report_probe("t0", False, error="down")
    d = r.decide(c, 1.0)
    assert d.node_id == during and d.explanation.cache == "stale"
    assert r.cache.peek("k", 1.0)[0] == entry_during
    assert ("fail-back = return" in d.explanation.reason) == (fail_back == "return")
    pool.report_probe("t0", True, node_id="n0")
    assert r.decide(c, 2.0).node_id == after


def test_return_replaces_an_entry_whose_target_left_the_pool():
    r, pool = _router("return")
    c = ConnectionInfo("10.0.0.1:1", container_id="k")
    r.cache.put("k", "gone-node", 0.0)
    assert r.decide(c, 1.0).node_id == "n0"
    assert r.cache.peek("k", 1.0)[0] == "n0"

