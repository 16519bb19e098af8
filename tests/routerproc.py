"""Run the real router as a subprocess (``python -m router run <config>``) for e2e tests.

    r = start_router(tmp_path, toml_text)
    r.url("redir")            # amqp[s]://127.0.0.1:<port> of acceptor "redir"
    r.management_url          # http://127.0.0.1:<port>
    r.get("/api/v1/counters") # (status, json) with the management credentials
    r.terminate()             # SIGTERM (drain) → exit status

Ports come from the ``listening <acceptor name> <url>`` / ``listening management <url>`` lines.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.serverproc import REPO, ServerProcessMixin, http_json, toml_value


@dataclass(eq=False)
class RouterProcess(ServerProcessMixin):
    workdir: Path
    config_path: Path
    auth: tuple[str, str] | None = ("admin", "admin")
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None
    urls: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    preexec_fn: Any = None  # e.g. lower RLIMIT_NOFILE in the child

    STDERR_NAME = "router.stderr.log"
    TERMINATE_TIMEOUT_S = 30.0

    def start(self, expect: int, timeout_s: float = 30.0) -> "RouterProcess":
        self._spawn(["router", "run", str(self.config_path), *self.extra_args],
                    lambda urls: len(urls) >= expect, timeout_s, "router", preexec_fn=self.preexec_fn)
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
        return http_json(self.management_url + path, method, body, self.auth if auth == "default" else auth)

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


def start_router(workdir: Path, toml_text: str, *, expect: int, auth: tuple[str, str] | None = ("admin", "admin"),
                 extra_args: list[str] | None = None, preexec_fn=None) -> RouterProcess:
    """Write ``router.toml`` in ``workdir`` and start the router; ``expect`` = number of
    ``listening`` lines (acceptors + management) to wait for."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "router.toml"
    path.write_text(toml_text)
    return RouterProcess(workdir, path, auth, list(extra_args or []), preexec_fn=preexec_fn).start(expect)


toml_str = toml_value  # the name the router tests use


def run_dry_run(*args: str) -> subprocess.CompletedProcess:
    """``python -m router dry-run ARGS`` from the repository's root; its output, not checked."""
    return subprocess.run([sys.executable, "-m", "router", "dry-run", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
