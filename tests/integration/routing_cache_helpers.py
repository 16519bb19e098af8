"""Helpers shared by the routing cache integration tests: target sockets, worker processes,
a real redis-server. (Not a test module.)"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from tests.waiting import wait_for

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "routing_cache_worker.py"


class TargetSockets:
    """N listening sockets standing in for brokers' AMQP ports (probed by TCP connect)."""

    def __init__(self, n: int) -> None:
        self.socks = []
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen(64)
            self.socks.append(s)
        self.ports = [s.getsockname()[1] for s in self.socks]

    def close(self) -> None:
        for s in self.socks:
            s.close()


def router_toml(ports: list[int], cache: str, policy: str = "ROUND_ROBIN") -> str:
    lines = ['[routers.r]', 'key-type = "CLIENT_ID"', '[routers.r.policy]', f'name = "{policy}"',
             '[routers.r.cache]', cache, '[routers.r.pool]', 'check-period = 200',
             'quorum-timeout = 0']
    for i, port in enumerate(ports):
        lines += ['[[routers.r.pool.targets]]', f'name = "b{i}"', 'host = "127.0.0.1"',
                  f'port = {port}', f'node-id = "node-{i}"']
    return "\n".join(lines) + "\n"


class Worker:
    """One router process (routing_cache_worker.py) driven over stdin/stdout."""

    def __init__(self, config: Path, seed: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(config), "r", str(seed)], cwd=REPO,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            bufsize=1)
        first = self.proc.stdout.readline()
        if not first:
            raise RuntimeError("worker died: " + self.proc.stderr.read())
        assert json.loads(first) == {"ready": True}

    def ask(self, cmd: str):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("worker died: " + self.proc.stderr.read())
        return json.loads(line)

    def route(self, key: str) -> dict:
        return self.ask(f"route {key}")

    def status(self) -> dict:
        return self.ask("status")

    def wait_status(self, pred, timeout: float = 10.0) -> dict:
        """The worker's status once ``pred(status)`` holds (on timeout: the last status)."""
        return wait_for(self.status, timeout, until=pred, what="the worker's status")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()

    def quit(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


class RedisServer:
    """A real redis-server on a free port (no persistence), startable again on the same port."""

    def __init__(self, tmp: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not installed")
        self.exe = exe
        self.dir = tmp
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        self.port = s.getsockname()[1]
        s.close()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def pong() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError("redis-server did not start: it exited")
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                return c.recv(16).startswith(b"+PONG")
        wait_for(pong, 10, ignore=OSError, what="redis-server to answer PING")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def pause(self) -> None:
        os.kill(self.proc.pid, 19)  # SIGSTOP: a hung Redis

    def resume(self) -> None:
        os.kill(self.proc.pid, 18)  # SIGCONT
