#!/usr/bin/env python3
"""How many sticky-cache misses actually read Redis, under connection load (issue 7).

Starts a real ``redis-server`` (no persistence) and a real router process (redirect acceptor,
``CLIENT_ID`` key, ``backend = "redis"``, ``redis-timeout-ms`` as given, PLAIN logins against a
users file, targets probed by TCP connect), then opens ``--connections`` AMQP connections,
``--concurrency`` at a time, each with a new container-id (every decision is a cache miss), and
reads the router's counters. Prints one JSON line:

    {"connections", "seconds", "cache_miss", "redis_reads", "redis_reads_skipped",
     "redis_read_timeouts", "redis_errors", "miss_share_read": redis_reads / cache_miss}

    .venv/bin/python loadtest/bench_redis_tier.py [--connections 6000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))

from broker.wire.codec import Symbol  # noqa: E402
from broker.wire.frames import (AMQP_HEADER, FRAME_AMQP, FRAME_SASL, SASL_HEADER, Open,  # noqa: E402
                                SaslInit, encode_frame)
from routing_cache_helpers import RedisServer, TargetSockets  # noqa: E402
from tests.brokerproc import write_users_file  # noqa: E402
from tests.routerproc import start_router, toml_str  # noqa: E402


def handshake(container_id: str) -> bytes:
    return (SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit(Symbol("PLAIN"), b"\0app\0app-pw"))
            + AMQP_HEADER + encode_frame(FRAME_AMQP, 0, Open(container_id=container_id)))


async def one(port: int, cid: str) -> None:
    s = await trio.open_tcp_stream("127.0.0.1", port)
    try:
        await s.send_all(handshake(cid))
        with trio.move_on_after(10):
            while await s.receive_some(65536):  # the redirect Close, then the router's EOF
                pass
    finally:
        await trio.aclose_forcefully(s)


async def load(port: int, n: int, concurrency: int, prefix: str) -> None:
    limiter = trio.CapacityLimiter(concurrency)

    async def guarded(i: int) -> None:
        async with limiter:
            try:
                await one(port, f"{prefix}-{i}")
            except OSError:
                pass

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(guarded, i)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--connections", type=int, default=6000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--redis-timeout-ms", type=int, default=50)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-redis-"))
    server = RedisServer(tmp)
    targets = TargetSockets(3)
    users = write_users_file(tmp / "users.toml", {"admin": ("admin", ["admin"]), "app": ("app-pw", ["app"])})
    lines = [f"users-file = {toml_str(users)}", "[management]", "port = 0", "user = \"admin\"",
             "password = \"admin\"", "[routing-log]", "enabled = false",
             "[routers.r]", 'key-type = "CLIENT_ID"', "[routers.r.policy]", 'name = "CONSISTENT_HASH"',
             "[routers.r.cache]", 'backend = "redis"', f"redis-url = {toml_str(server.url)}",
             "timeout = 600000", f"redis-timeout-ms = {args.redis_timeout_ms}",
             "[routers.r.pool]", "check-period = 1000", "quorum-timeout = 0"]
    for i, port in enumerate(targets.ports):
        lines += ["[[routers.r.pool.targets]]", f'name = "b{i}"', 'host = "127.0.0.1"', f"port = {port}",
                  f'node-id = "node-{i}"']
    lines += ["[[acceptors]]", 'name = "a"', "port = 0", 'router = "r"', 'sasl-mechanisms = ["PLAIN"]']
    router = start_router(tmp / "router", "\n".join(lines) + "\n", expect=2)
    try:
        port = router.port("a")
        trio.run(load, port, 20, 4, "warm")  # the first PLAIN login (scrypt) and first connections
        before = router.get("/api/v1/counters")[1]["routers"]["r"]
        t0 = time.monotonic()
        trio.run(load, port, args.connections, args.concurrency, f"run{int(t0)}")
        secs = time.monotonic() - t0
        after = router.get("/api/v1/counters")[1]["routers"]["r"]
        d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        out = {"connections": args.connections, "seconds": round(secs, 2),
               **{k: d.get(k) for k in ("cache_miss", "redis_reads", "redis_reads_skipped",
                                        "redis_read_timeouts", "redis_errors", "redis_misses",
                                        "redis_writes")}}
        out["miss_share_read"] = round(d.get("redis_reads", 0) / max(1, d.get("cache_miss", 0)), 3)
        print(json.dumps(out))
    finally:
        router.terminate()
        server.kill()
        targets.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
