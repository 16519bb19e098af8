"""Several router worker processes sharing the acceptor ports with ``SO_REUSEPORT``.

Theory of operation
-------------------
With ``workers = 1`` (the default) ``lodestone-router run`` is one trio process and this module is
not used. With ``workers = N > 1`` the command becomes a small supervisor (plain Python, no trio):

1. For every acceptor whose port is 0 it binds a placeholder socket with ``SO_REUSEPORT`` (never
   listening, so it receives no connections) to learn a free port, and keeps it bound until all
   workers are up so the port cannot be taken meanwhile.
2. It starts N processes ``python -m router worker --index i --count N --ports ... <config>``.
   Each binds every acceptor port itself with ``SO_REUSEPORT`` and listens; the kernel spreads
   new connections over the N accept queues.
3. Worker 0 is the *primary*: it alone serves the management API and prints the
   ``listening ...`` lines (the other workers print nothing on stdout). Every worker runs its own
   routing services (pool, health probes, cache) — health probes are therefore sent N times per
   check-period, and without the Redis cache tier sticky-cache entries are per worker (the hash
   policies need no cache to agree). Each worker writes its own routing-log file
   (``routing-w<i>.log``), so no two processes share a file.
4. SIGTERM/SIGINT to the supervisor is forwarded to every worker (each drains); if a worker dies
   the supervisor stops the others and exits non-zero.

Runtime filter changes made through the management API apply to the primary worker only (its
response says so in ``"applies_to"``); use one worker when runtime filters must be exact.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time


def reserve_ports(acceptors) -> tuple[dict[str, int], list[socket.socket]]:
    """Pick the port for each acceptor (``name -> port``); for port 0, bind a placeholder with
    SO_REUSEPORT and return it so the caller keeps it until the workers have bound."""
    ports: dict[str, int] = {}
    held: list[socket.socket] = []
    for acc in acceptors:
        if acc.port != 0:
            ports[acc.name] = acc.port
            continue
        infos = socket.getaddrinfo(acc.host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, type_, proto, _c, sockaddr = infos[0]
        s = socket.socket(family, type_, proto)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(sockaddr)
        ports[acc.name] = s.getsockname()[1]
        held.append(s)
    return ports, held


def run_supervisor(config_path: str, acceptors, workers: int, *, log_level_args: list[str] | None = None) -> int:
    """Run ``workers`` worker processes until they exit or we are signalled. Returns the exit status."""
    ports, held = reserve_ports(acceptors)
    port_arg = json.dumps(ports)
    procs: list[subprocess.Popen] = []
    stopping = False

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass

    old_term = signal.signal(signal.SIGTERM, forward)
    old_int = signal.signal(signal.SIGINT, forward)
    try:
        for i in range(workers):
            argv = [sys.executable, "-m", "router", "worker", "--index", str(i), "--count", str(workers),
                    "--ports", port_arg, config_path] + list(log_level_args or [])
            procs.append(subprocess.Popen(argv, stdout=None if i == 0 else subprocess.DEVNULL))
        # Give workers time to bind before the placeholders go (they never listened; closing
        # them only frees the reservation).
        time.sleep(0.5)
        for s in held:
            s.close()
        held.clear()
        status = 0
        while True:
            alive = [p for p in procs if p.poll() is None]
            if not alive:
                break
            dead = [p for p in procs if p.poll() is not None and p.returncode != 0]
            if dead and not stopping:
                print(f"lodestone-router: worker pid {dead[0].pid} exited with status {dead[0].returncode}; "
                      "stopping the others", file=sys.stderr)
                status = 1
                forward(signal.SIGTERM, None)
            time.sleep(0.2)
        if not status:
            status = max((p.returncode or 0) for p in procs)
            if status < 0:
                status = 0 if stopping else 1
        return status
    finally:
        for s in held:
            s.close()
        signal.signal(signal.SIGTERM, old_term)
        signal.signal(signal.SIGINT, old_int)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def default_workers() -> int:
    """Workers that use every core (``workers = "auto"``)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
