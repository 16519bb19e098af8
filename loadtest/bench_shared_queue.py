#!/usr/bin/env python3
"""Shared queue benchmark: producer and consumer on a broker that is not the root, a shared queue
beside a local queue, same run (docs/cluster.md "Shared queues").

Two broker processes form a cluster with ``primaries = [A, B]`` (OpenAMQ's model): A starts
first and is elected root once B is up (2 of 2). Ports are chosen before start (a primary finds
itself in ``primaries`` by its connector); each node has its own scratch folder. The client is
``loadtest/amqp_client.py`` (python-qpid-proton, one process: producer and consumer), as in
``bench_cluster.py``. Per round, durability and body size, two workloads on B, alternating which
goes first:

* **local**: address ``local.q`` (an ordinary queue on B): B alone does the work; A is idle;
* **shared**: address ``work`` (``shared = true``): B relays every send to the root A and answers
  the producer once A holds it; A routes it to B's consumer (store and forward back to B). The
  consumer attaches first; the client holds its first send until A knows B's consumer.

Figures: msgs/s end to end (first send -> last receipt) and broker CPU µs per message (utime+
stime from /proc): B's for local, A's + B's for shared. Ratios: shared ÷ local, median over
rounds of each round's ratio; goal ≥ 0.5 for msgs/s (the issue's).

    .venv/bin/python loadtest/bench_shared_queue.py [--n 10000] [--rounds 3] [--sizes 100]
        [--durable | --non-durable] [--warmup 1000] [--json]
"""

from __future__ import annotations

import shutil
import socket
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cluster import Node, client_run, common_args, fmt, run_rounds, summary_rows, wait_until  # noqa: E402

LOCAL_ADDRESS = "local.q"
SHARED_ADDRESS = "work"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_cluster(work: Path) -> tuple[Node, Node]:
    """A (started first: the root) and B, both defined primaries, ``work`` a shared queue."""
    ports = free_ports(2)
    primaries = ", ".join(f'"amqp://127.0.0.1:{p}"' for p in ports)
    extra = (f"primaries = [{primaries}]\n"
             f'[addresses.{SHARED_ADDRESS}]\nrouting-types = ["anycast"]\nshared = true\n')
    a = Node(work, "A", port=ports[0], cluster_extra=extra)
    try:
        b = Node(work, "B", port=ports[1], cluster_extra=extra)
    except BaseException:
        a.stop()
        raise
    try:
        wait_until(lambda: all(n.get("/api/v1/cluster")["root"] == a.node_id for n in (a, b)),
                   "A elected root on both nodes")
    except BaseException:
        a.stop()
        b.stop()
        raise
    return a, b


def main() -> int:
    ap = common_args(__doc__, n=10000, sizes="100", warmup=1000)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="lodestone-bench-shared-"))
    results: dict = {}
    failed = False
    left: dict = {}
    relays: dict = {}
    nodes: tuple[Node, ...] = ()
    try:
        nodes = start_cluster(work)
        root, b = nodes

        def run(shared: bool, durable: bool, size: int, n: int, tail_s: float) -> dict:
            # producer and consumer on B; CPU read for B, then A (the root)
            if shared:
                return client_run(b, b, root, SHARED_ADDRESS, (b, root), durable, size, n, tail_s, work)
            return client_run(b, b, None, LOCAL_ADDRESS, (b, root), durable, size, n, tail_s, work)

        results, failed = run_rounds(run, a, (False, True), sizes)
        left = {f"{n.name}:{q}": (n.queue(q) or {}).get("depth", 0) for n in nodes
                for q in (LOCAL_ADDRESS, SHARED_ADDRESS)}
        relays = b.get("/api/v1/cluster")["shared"]["counters"]
    finally:
        for n in nodes:
            n.stop()
        shutil.rmtree(work, ignore_errors=True)
    rows = summary_rows(results, a.durability, sizes)
    print(f"\nproducer and consumer on B (not the root): local.q (B alone) or the shared queue work "
          f"(B -> root A -> B); n={a.n}, median of {a.rounds} rounds; python-qpid-proton client (amqp_client.py)")
    print("\nmsgs/s, end to end (first send -> last receipt); client CPU µs/msg for comparison (not in any ratio)")
    print(f"{'workload':<22}{'local':>10}{'shared':>11}{'shared ÷ local':>16}{'   goal ≥ 0.5':<14}"
          f"{'client µs/msg local':>21}{'shared':>8}")
    for r in rows:
        ok = "-" if r["rate_r"] != r["rate_r"] else ("met" if r["rate_r"] >= 0.5 else "MISSED")
        print(f"{r['name']:<22}{fmt(r['l_rate'], ',.0f', 10)}{fmt(r['f_rate'], ',.0f', 11)}"
              f"{fmt(r['rate_r'], '.2f', 16)}   {ok:<11}{fmt(r['l_client'], '.1f', 21)}{fmt(r['f_client'], '.1f', 8)}")
    print("\nbroker CPU µs/msg (utime+stime from /proc): local = B alone (A, the root, is idle: shown, not counted); "
          "shared = B + A")
    print(f"{'workload':<22}{'local B':>9}{'(A idle)':>10}{'shared B+A':>12}{'= B':>7}{'+ A':>7}{'shared ÷ local':>16}")
    for r in rows:
        print(f"{r['name']:<22}{fmt(r['l_a'], '.1f', 9)}{fmt(r['l_b'], '.1f', 10)}{fmt(r['f_ab'], '.1f', 12)}"
              f"{fmt(r['f_a'], '.1f', 7)}{fmt(r['f_b'], '.1f', 7)}{fmt(r['cpu_r'], '.2f', 16)}")
    print("ratios: median over rounds of shared ÷ local within the round")
    print(f"queue depths after the run (expect 0): {left}")
    print(f"B's relays to the root: {relays}")
    return 1 if failed or any(left.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
