"""A router process for the cache integration tests (not a test module).

Usage: python routing_cache_worker.py ROUTER_TOML ROUTER_NAME SEED
Runs the RouterService of one router (its probes, persistence, Redis sync) and answers commands
on stdin, one JSON line per answer on stdout:

  route <container-id>   → {"key", "outcome", "node_id", "cache", "tier"}
  routemany <n> <prefix> → {"ok": count of OK decisions, "failed": count of others}
  status                 → RouterService.status()
  quit

It prints {"ready": true} once ``run`` has started (first probe round done).
"""

from __future__ import annotations

import json
import random
import sys

import trio

from router.config import load_router_config
from router.core.keys import ConnectionInfo
from router.service import RouterService


def out(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def main(path: str, name: str, seed: int) -> None:
    cfg = load_router_config(path)
    svc = RouterService(cfg.routers[name], rng=random.Random(seed))
    async with trio.open_nursery() as nursery:
        await nursery.start(svc.run)
        out({"ready": True})
        stdin = trio.lowlevel.FdStream(0)
        buf = b""
        while True:
            while b"\n" not in buf:
                data = await stdin.receive_some(4096)
                if not data:
                    nursery.cancel_scope.cancel()
                    return
                buf += data
            line, buf = buf.split(b"\n", 1)
            cmd = line.decode().split()
            if not cmd:
                continue
            if cmd[0] == "route":
                d = await svc.route(ConnectionInfo("127.0.0.1:40000", container_id=cmd[1]))
                out({"key": cmd[1], "outcome": d.outcome.value, "node_id": d.node_id,
                     "cache": d.explanation.cache, "tier": d.explanation.cache_tier})
            elif cmd[0] == "routemany":
                ok = failed = 0
                for i in range(int(cmd[1])):
                    d = await svc.route(ConnectionInfo("127.0.0.1:40000",
                                                       container_id=f"{cmd[2]}{i}"))
                    if d.ok:
                        ok += 1
                    else:
                        failed += 1
                    await trio.sleep(0.002)  # pacing the routes, not a wait
                out({"ok": ok, "failed": failed})
            elif cmd[0] == "status":
                out(svc.status())
            elif cmd[0] == "quit":
                nursery.cancel_scope.cancel()
                return


if __name__ == "__main__":
    trio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
