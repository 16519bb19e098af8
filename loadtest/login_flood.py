#!/usr/bin/env python3
"""A wrong-password login flood against an AMQP 1.0 acceptor (a broker's or the router's).

``--concurrency`` connections per source address (``--sources 127.0.0.2,127.0.0.3,…``: each
connection binds one of them, so the target sees several clients; loopback only), each in a
loop: connect, SASL header + sasl-init PLAIN with ``--user`` and a fresh random password, read
the sasl-outcome (or whatever the target answers), close, again. An unknown user can be mixed
in (``--unknown-share``). Runs ``--duration-s`` (bounded), then prints one JSON line:
attempts, outcomes (auth refused, refused with an AMQP error, closed/reset, timeouts), attempts
per second, and the answer time percentiles.

Used by ``tests/integration/test_login_flood.py`` and ``loadtest/bench_login_flood.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import time

import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from broker.wire.frames import FRAME_SASL, SASL_HEADER, SaslInit, encode_frame  # noqa: E402

_ADDRESS_OK = ("127.", "::1")


def sasl_init(user: str, password: str) -> bytes:
    response = b"\0" + user.encode() + b"\0" + password.encode()
    return SASL_HEADER + encode_frame(FRAME_SASL, 0, SaslInit("PLAIN", response))


async def _attempt(host: str, port: int, source: str, data: bytes, timeout_s: float) -> str:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        await sock.bind((source, 0))
        with trio.fail_after(timeout_s):
            await sock.connect((host, port))
            await sock.send(data)
            got = b""
            while True:
                chunk = await sock.recv(65536)
                if not chunk:
                    break
                got += chunk
                # sasl-outcome descriptor 0x44; an AMQP Close after an AMQP header: refused
                if b"\x53\x44" in got:
                    return "auth_refused"
                if b"AMQP\x00" in got and b"\x53\x18" in got:
                    return "amqp_refused"
        return "closed"
    except trio.TooSlowError:
        return "timeout"
    except OSError:
        return "reset"
    finally:
        sock.close()


async def flood(host: str, port: int, sources: list[str], concurrency: int, duration_s: float,
                user: str, unknown_share: float = 0.0, timeout_s: float = 15.0, seed: int = 1) -> dict:
    for s in [host, *sources]:
        if not s.startswith(_ADDRESS_OK):
            raise SystemExit(f"login_flood: {s} is not a loopback address")
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    times: list[float] = []
    deadline = trio.current_time() + duration_s

    async def worker(source: str) -> None:
        while trio.current_time() < deadline:
            name = f"nobody{rng.randrange(1 << 30)}" if rng.random() < unknown_share else user
            data = sasl_init(name, f"wrong-{rng.randrange(1 << 62):x}")
            t0 = time.perf_counter()
            out = await _attempt(host, port, source, data, timeout_s)
            times.append(time.perf_counter() - t0)
            outcomes[out] = outcomes.get(out, 0) + 1
            if out in ("reset", "closed", "amqp_refused"):
                await trio.sleep(0.01)   # as a client library would before reconnecting

    t0 = time.perf_counter()
    with trio.move_on_after(duration_s + timeout_s + 5):
        async with trio.open_nursery() as n:
            for src in sources:
                for _ in range(concurrency):
                    n.start_soon(worker, src)
    elapsed = time.perf_counter() - t0
    times.sort()

    def pct(p: float) -> float | None:
        return round(times[min(len(times) - 1, int(p * len(times)))] * 1000, 1) if times else None

    attempts = sum(outcomes.values())
    return {"attempts": attempts, "outcomes": outcomes, "elapsed_s": round(elapsed, 2),
            "attempts_per_s": round(attempts / elapsed, 1) if elapsed else 0,
            "answer_ms_p50": pct(0.5), "answer_ms_p99": pct(0.99),
            "answer_ms_mean": round(statistics.fmean(times) * 1000, 1) if times else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--sources", default="127.0.0.2,127.0.0.3,127.0.0.4,127.0.0.5")
    ap.add_argument("--concurrency", type=int, default=50, help="connections per source")
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--user", default="app")
    ap.add_argument("--unknown-share", type=float, default=0.0)
    ap.add_argument("--ready-file", help="touched once the flood has started")
    args = ap.parse_args(argv)
    sources = [s.strip() for s in args.sources.split(",") if s.strip()]
    if args.ready_file:
        open(args.ready_file, "w").close()
    result = trio.run(flood, args.host, args.port, sources, args.concurrency, args.duration_s,
                      args.user, args.unknown_share)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
