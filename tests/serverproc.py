"""What every real-process test helper shares (``brokerproc``, ``routerproc``).

A Lodestone server announces each bound socket on stdout as ``listening <what> <url>``. The
mixin here starts such a subprocess, collects those lines into ``urls`` (every stdout line also
goes to ``lines``), waits until the caller's ``ready(urls)`` holds, and offers ``kill`` (kill -9),
``terminate`` (SIGTERM, returns the exit status) and ``stderr_text``. Every process still alive
at interpreter exit is killed.
"""

from __future__ import annotations

import atexit
import base64
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
_LIVE: set = set()


class ServerProcessMixin:
    """Lifecycle of a server subprocess; the using dataclass has ``workdir``, ``proc``, ``urls``, ``lines``."""

    STDERR_NAME = "stderr.log"
    TERMINATE_TIMEOUT_S = 20.0
    _reader: threading.Thread | None = None

    def _spawn(self, module_args: list[str], ready: Callable[[dict[str, str]], bool], timeout_s: float,
               what: str, preexec_fn: Callable[[], None] | None = None) -> None:
        stderr = open(self.workdir / self.STDERR_NAME, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", *module_args], cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=stderr, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=preexec_fn)
        stderr.close()
        _LIVE.add(self)
        self.urls = {}
        self.lines = []
        done = threading.Event()
        proc = self.proc

        def reader() -> None:
            for raw in proc.stdout:
                line = raw.decode(errors="replace").strip()
                self.lines.append(line)
                parts = line.split()
                if len(parts) == 3 and parts[0] == "listening":
                    self.urls[parts[1]] = parts[2]
                    if ready(self.urls):
                        done.set()
            done.set()

        self._reader = threading.Thread(target=reader, daemon=True)
        self._reader.start()
        if not done.wait(timeout_s) or not ready(self.urls):
            self.kill()
            raise RuntimeError(f"{what} did not start (stdout {self.lines!r}); stderr:\n{self.stderr_text()}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self) -> None:
        """kill -9 and reap."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._release()

    def terminate(self, timeout_s: float | None = None) -> int:
        """SIGTERM; wait for a clean exit and return the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.TERMINATE_TIMEOUT_S if timeout_s is None else timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        self._release()
        return self.proc.returncode

    def _release(self) -> None:
        _LIVE.discard(self)
        if self.proc is not None:
            if self._reader is not None:
                self._reader.join(5)  # EOF once the process is gone
                self._reader = None
            if self.proc.stdout is not None and not self.proc.stdout.closed:
                self.proc.stdout.close()

    def stderr_text(self) -> str:
        try:
            return (self.workdir / self.STDERR_NAME).read_text(errors="replace")
        except FileNotFoundError:
            return ""


def metric_by_label(metrics_text: str, name: str) -> dict[str, float]:
    """A Prometheus series with one label, from ``/metrics`` text: label value -> value."""
    out = {}
    for line in metrics_text.splitlines():
        if line.startswith(name + "{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def http_json(url: str, method: str = "GET", body: Any = None, auth: tuple[str, str] | None = None,
              timeout_s: float = 15.0) -> tuple[int, Any]:
    """One management-API request (blocking, urllib); returns (status, decoded JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if auth is not None:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        status, raw, ctype = exc.code, exc.read(), exc.headers.get("Content-Type", "")
    return status, (json.loads(raw) if raw and "json" in ctype else raw.decode())


def free_ports(n: int) -> list[int]:
    """``n`` TCP ports free on 127.0.0.1 right now (for configs that must name their ports up front)."""
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def toml_value(v: Any) -> str:
    """A TOML literal for a bool, number, string, path or list of those."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (str, os.PathLike)):
        return json.dumps(str(v))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):   # an inline table: [ha] manager = { type = "zookeeper", ... }
        return "{ " + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} as TOML")


@atexit.register
def _kill_leftovers() -> None:
    for p in list(_LIVE):
        p.kill()


def read_banner(proc, timeout_s: float = 90.0) -> str:
    """``lodestone-local``'s start-up output up to its last line (``Ctrl-C …``); fails with what
    it printed if that line does not come within ``timeout_s`` (or the process ends first)."""
    import time

    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("Ctrl-C"):
            break
    assert lines and lines[-1].startswith("Ctrl-C"), "".join(lines)
    return "".join(lines)
