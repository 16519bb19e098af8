"""Run the real router as a subprocess (``python -m router run <config>``) for e2e tests.

    r = start_router(tmp_path, toml_text)
    r.url("redir")            # amqp[s]://127.0.0.1:<port> of acceptor "redir"
    r.management_url          # http://127.0.0.1:<port>
    r.get("/api/v1/counters") # (status, json) with the management credentials
    r.terminate()             # SIGTERM (drain) → exit status

Ports come from the ``listening <acceptor name> <url>`` / ``listening management <url>`` lines.
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
_LIVE: set["RouterProcess"] = set()


@dataclass(eq=False)
class RouterProcess:
    workdir: Path
    config_path: Path
    auth: tuple[str, str] | None = ("admin", "admin")
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    urls: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)

    def start(self, expect: int, timeout_s: float = 30.0) -> "RouterProcess":
        stderr = open(self.workdir / "router.stderr.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "router", "run", str(self.config_path), *self.extra_args],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        stderr.close()
        _LIVE.add(self)
        done = threading.Event()

        def reader() -> None:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").strip()
                self.lines.append(line)
                parts = line.split()
                if len(parts) == 3 and parts[0] == "listening":
                    self.urls[parts[1]] = parts[2]
                    if len(self.urls) >= expect:
                        done.set()
            self.proc.stdout.close()
            done.set()

        threading.Thread(target=reader, daemon=True).start()
        if not done.wait(timeout_s) or len(self.urls) < expect:
            self.kill()
            raise RuntimeError(f"router did not start (stdout {self.lines!r}); stderr:\n{self.stderr_text()}")
        return self

    def url(self, acceptor: str, userinfo: str | None = None) -> str:
        u = self.urls[acceptor]
        if userinfo:
            scheme, rest = u.split("://", 1)
            u = f"{scheme}://{userinfo}@{rest}"
        return u

    def port(self, acceptor: str) -> int:
        return int(self.urls[acceptor].rsplit(":", 1)[1])

    @property
    def management_url(self) -> str:
        return self.urls["management"]

    def request(self, method: str, path: str, body: Any = None, auth: tuple[str, str] | None | str = "default"):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.management_url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        creds = self.auth if auth == "default" else auth
        if creds is not None:
            req.add_header("Authorization", "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode())
        try:
            with urllib.request.urlopen(req, timeout=15) as resp:
                status, raw, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            status, raw, ctype = exc.code, exc.read(), exc.headers.get("Content-Type", "")
        return status, (json.loads(raw) if "json" in ctype else raw.decode())

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)

    def counters(self, acceptor: str | None = None) -> dict[str, int]:
        status, body = self.get("/api/v1/counters")
        assert status == 200, body
        return body["edge"] if acceptor is None else body["acceptors"][acceptor]["counters"]

    def target_for(self, router: str, key: str) -> dict:
        from urllib.parse import quote

        status, body = self.get(f"/api/v1/routers/{router}/target?key={quote(key, safe='')}")
        assert status == 200, body
        return body

    def terminate(self, timeout_s: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise
        _LIVE.discard(self)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        _LIVE.discard(self)

    def stderr_text(self) -> str:
        try:
            return (self.workdir / "router.stderr.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""


def start_router(workdir: Path, toml_text: str, *, expect: int, auth: tuple[str, str] | None = ("admin", "admin"),
                 extra_args: list[str] | None = None) -> RouterProcess:
    """Write ``router.toml`` in ``workdir`` and start the router; ``expect`` = number of
    ``listening`` lines (acceptors + management) to wait for."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "router.toml"
    path.write_text(toml_text)
    return RouterProcess(workdir, path, auth, list(extra_args or [])).start(expect)


def toml_str(v: Any) -> str:
    """A TOML literal for a str/int/bool/list value (json-compatible quoting)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_str(x) for x in v) + "]"
    return json.dumps(str(v))


@atexit.register
def _kill_leftovers() -> None:
    for r in list(_LIVE):
        r.kill()
