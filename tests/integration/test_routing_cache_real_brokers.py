"""RouterService against real broker processes: probes learn node ids over the real management
API, the sticky cache holds while the broker is up, and a killed broker's keys move."""

from __future__ import annotations

import random

import pytest
import trio

from router.config import CacheConfig, PolicyConfig, PoolConfig, RouterConfig, TargetConfig
from router.core.keys import ConnectionInfo, KeyType
from router.service import RouterService
from tests.brokerproc import start_broker
from tests.waiting import wait_for_async

pytestmark = pytest.mark.slow


@pytest.fixture
def brokers(tmp_path):
    bs = [start_broker(tmp_path, name=f"b{i}") for i in range(2)]
    yield bs
    for b in bs:
        b.kill()


async def test_probes_and_stickiness_with_real_brokers(brokers):
    targets = []
    for i, b in enumerate(brokers):
        host, port = b.amqp_url.rsplit("//", 1)[1].rsplit(":", 1)
        targets.append(TargetConfig(f"b{i}", host, int(port), management_url=b.management_url))
    cfg = RouterConfig("r", key_type=KeyType.CLIENT_ID, policy=PolicyConfig("CONSISTENT_HASH", {}),
                       cache=CacheConfig(),
                       pool=PoolConfig(check_period_ms=500, quorum_size=2, quorum_timeout_ms=300,
                                       username="admin",
                                       password="admin", targets=tuple(targets)))
    svc = RouterService(cfg, rng=random.Random(1))
    async with trio.open_nursery() as nursery:
        await nursery.start(svc.run)
        # normally the first round; a loaded machine may need more
        await wait_for_async(lambda: svc.pool.quorum_met, 10, what="the pool's quorum")
        snap = svc.pool.snapshot()
        assert [t["node_id"] for t in snap["targets"]] == [b.node_id for b in brokers]
        assert all(isinstance(t["connection_count"], int) for t in snap["targets"])
        keys = [f"c{i}" for i in range(40)]
        first = {k: (await svc.route(ConnectionInfo("127.0.0.1:1", container_id=k))).node_id
                 for k in keys}
        assert set(first.values()) == {b.node_id for b in brokers}
        brokers[0].kill()
        await wait_for_async(lambda: svc.pool.ready_count == 1, 10, what="the killed broker not ready")
        err = svc.pool.snapshot()["targets"][0]["last_error"]
        assert err and "api/v1/broker" in err
        for k in keys:
            d = await svc.route(ConnectionInfo("127.0.0.1:1", container_id=k))
            if first[k] == brokers[1].node_id:  # cache hits ignore the quorum (as Artemis)
                assert d.ok and d.node_id == brokers[1].node_id and d.explanation.cache == "hit"
            else:  # its broker is gone and 1 of 2 is below quorum: refused after the wait
                assert d.outcome.value == "REFUSED_UNAVAILABLE"
                assert d.explanation.cache == "stale" and d.explanation.waited_s >= 0.3
        svc.pool.quorum_size = 1  # (an operator lowering the quorum) → the stale keys move
        d = await svc.route(ConnectionInfo("127.0.0.1:1", container_id=next(
            k for k in keys if first[k] == brokers[0].node_id)))
        assert d.ok and d.node_id == brokers[1].node_id and d.explanation.cache == "stale"
        nursery.cancel_scope.cancel()
