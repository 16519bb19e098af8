"""Shutdown closes every routing service: ``serve_router`` (a router process, or a worker) ends
with ``RouterService.aclose`` — the embedded cache file flushed and closed, a Redis client
released — however it ends (here: cancelled, as the drain's end cancels it)."""

from __future__ import annotations

import trio

from router.config import load_router_config
from router.core.keys import ConnectionInfo
from router.server import serve_router


async def test_serve_router_closes_its_services(tmp_path):
    (tmp_path / "router.toml").write_text("\n".join([
        "[management]", "port = 0", 'user = "ops"', 'password = "ops-pw"',
        "[routing-log]", "enabled = false",
        "[routers.main]", 'key-type = "CLIENT_ID"', "[routers.main.policy]", 'name = "FIRST_ELEMENT"',
        "[routers.main.cache]", "persisted = true", 'backend = "embedded"', 'path = "cache.log"',
        "[routers.main.pool]", "check-period = 60000",
        "[[routers.main.pool.targets]]", 'name = "b1"', 'host = "127.0.0.1"', "port = 1",
        "[[acceptors]]", 'name = "auto"', "port = 0", 'router = "main"', 'mode = "auto"',
    ]) + "\n")
    cfg = load_router_config(tmp_path / "router.toml")
    async with trio.open_nursery() as nursery:
        running = await nursery.start(lambda task_status: serve_router(cfg, print_lines=False,
                                                                       task_status=task_status))
        svc = running.services["main"]
        svc.pool.report_probe("b1", True, node_id="n1")
        assert (await svc.route(ConnectionInfo("1.2.3.4:5", container_id="k"))).ok
        assert not svc._closed
        nursery.cancel_scope.cancel()
    assert svc._closed
    assert '"k"' in (tmp_path / "cache.log").read_text()  # flushed at shutdown
