"""Run real broker nodes as subprocesses, for integration and end-to-end tests.

    from tests.brokerproc import start_broker

    b = start_broker(tmp_path)                          # etc/users.toml, PLAIN, ports from the OS
    b.amqp_url, b.management_url, b.node_id, b.pid
    b.kill(); b.restart()                               # kill -9, then start again on the same data dir
    b.terminate()                                       # SIGTERM; returns the exit status

The helper writes a config file (``<tmp>/<name>/broker.toml``) with port 0 everywhere and learns
the real ports from the ``listening amqp|amqps|management <url>`` lines the broker prints. Extra
config goes in ``config={"table": {"key": value}}`` (dotted table names allowed, e.g.
``{"address-defaults": {"max-delivery-count": 2}}``). ``tls=trustme.CA()`` adds an ``amqps``
acceptor with a server certificate for 127.0.0.1/localhost issued by that CA (which also verifies
client certificates for EXTERNAL). Every process started is killed at interpreter exit if a
test forgot it.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.serverproc import REPO, ServerProcessMixin, http_json, toml_value
from tests.waiting import wait_for  # noqa: F401  (kept importable from here; new code imports tests.waiting)

USERS_FILE = REPO / "etc" / "users.toml"
ADMIN = ("admin", "admin")


def _table_name(name: str) -> str:
    return ".".join(p if p.replace("-", "").replace("_", "").isalnum() else json.dumps(p)
                    for p in name.split("\x00"))


@dataclass(eq=False)
class BrokerProcess(ServerProcessMixin):
    """A broker subprocess and what it printed. Create with :func:`start_broker`."""

    workdir: Path
    config_path: Path
    proc: subprocess.Popen | None = None
    urls: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    start_timeout_s: float = 30.0
    preexec: Any = None     # a network namespace to run in (tests/netns.py, Network.enter)

    # -- lifecycle (kill, terminate, stderr_text, pid: ServerProcessMixin) ---------------------
    def start(self) -> "BrokerProcess":
        want = {"amqp", "management"} | ({"amqps"} if "[acceptors.amqps" in self.config_path.read_text() else set())
        self._spawn(["broker", "run", str(self.config_path)], lambda urls: want <= set(urls),
                    self.start_timeout_s, "broker", preexec_fn=self.preexec)
        return self

    def restart(self) -> "BrokerProcess":
        """Start again with the same config and data directory (new OS-chosen ports)."""
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()
        return self.start()

    stop = ServerProcessMixin.terminate

    # -- what it offers ----------------------------------------------------------------------
    @property
    def amqp_url(self) -> str:
        return self.urls["amqp"]

    @property
    def amqps_url(self) -> str:
        return self.urls["amqps"]

    @property
    def management_url(self) -> str:
        return self.urls["management"]

    @property
    def host(self) -> str:
        return self.amqp_url.split("://", 1)[1].rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        return int(self.amqp_url.rsplit(":", 1)[1])

    @property
    def data_dir(self) -> Path:
        return self.workdir / "data"

    @property
    def node_id(self) -> str:
        return (self.data_dir / "node.id").read_text().strip()

    def management_get(self, path: str, auth: tuple[str, str] | None = ADMIN) -> tuple[int, Any]:
        """GET a management route (blocking, urllib); returns (status, decoded JSON or text)."""
        return http_json(self.management_url + path, auth=auth, timeout_s=10)

    def queue(self, name: str) -> dict | None:
        status, qs = self.management_get("/api/v1/queues")
        assert status == 200, qs
        return next((q for q in qs if q["name"] == name), None)


def write_config(workdir: Path, *, name: str = "broker", users_file: Path | None = USERS_FILE,
                 mechanisms: tuple[str, ...] = ("PLAIN",), tls=None, config: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write a broker config for tests (ports 0, data dir ``<workdir>/data``); returns its path."""
    workdir.mkdir(parents=True, exist_ok=True)
    tables: dict[str, dict[str, Any]] = {
        "node": {"name": name, "data-dir": str(workdir / "data")},
        "acceptors\x00amqp": {"host": "127.0.0.1", "port": 0, "sasl-mechanisms": list(mechanisms)},
        "management": {"host": "127.0.0.1", "port": 0},
        "security": {},
        "activity-log": {"flush-interval-s": 1.0},
    }
    if users_file is not None:
        tables["security"]["users-file"] = str(users_file)
    if tls is not None:
        cert = tls.issue_cert("127.0.0.1", "localhost")
        cert.private_key_and_cert_chain_pem.write_to_path(str(workdir / "server.pem"))
        tls.cert_pem.write_to_path(str(workdir / "ca.pem"))
        tables["acceptors\x00amqps"] = {"host": "127.0.0.1", "port": 0,
                                        "sasl-mechanisms": list(dict.fromkeys([*mechanisms, "EXTERNAL"]))}
        tables["acceptors\x00amqps\x00tls"] = {"cert-file": str(workdir / "server.pem"),
                                              "key-file": str(workdir / "server.pem"),
                                              "ca-file": str(workdir / "ca.pem")}
    for tname, values in (config or {}).items():
        head = tname.split(".", 1)[0]
        key = "\x00".join(tname.split(".", 1)) if head in ("address-settings", "addresses") else \
            tname.replace(".", "\x00")
        tables.setdefault(key, {}).update(values)
    lines = []
    for tname, values in tables.items():
        lines.append(f"[{_table_name(tname)}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        lines.append("")
    path = workdir / "broker.toml"
    path.write_text("\n".join(lines))
    return path


def start_broker(tmp_path: Path, *, name: str = "broker", **kw) -> BrokerProcess:
    """Write a config under ``tmp_path/name`` and start a broker on it (see the module docstring).

    Keyword arguments go to :func:`write_config` (``users_file``, ``mechanisms``, ``tls``,
    ``config``). ANONYMOUS needs a users file with ``[anonymous] enabled = true``
    (:func:`write_users_file`).
    """
    workdir = Path(tmp_path) / name
    path = write_config(workdir, name=name, **kw)
    return BrokerProcess(workdir, path).start()


_HASHES: dict[str, str] = {}


def write_users_file(path: Path, users: dict[str, tuple[str, list[str]]], *,
                     permissions: list[dict[str, Any]] | None = None,
                     anonymous_roles: list[str] | None = None) -> Path:
    """Write a users file (``users = {name: (password, roles)}``); hashes use a cheap scrypt cost.

    ``permissions`` are ``[[permissions]]`` tables, default: role ``admin`` may do everything on
    ``#``, role ``app`` may send, consume and create addresses. ``anonymous_roles`` enables
    ANONYMOUS with those roles.
    """
    from broker.wire.io.users import hash_password

    if permissions is None:
        permissions = [{"match": "#", "send": ["admin", "app"], "consume": ["admin", "app"],
                        "create-address": ["admin", "app"], "delete-address": ["admin"],
                        "manage": ["admin"]}]
    lines = []
    for name, (password, roles) in users.items():
        h = _HASHES.get(password)
        if h is None:
            h = _HASHES[password] = hash_password(password, n=1024)
        lines += [f"[users.{json.dumps(name)}]", f"password = {json.dumps(h)}",
                  f"roles = {toml_value(roles)}", ""]
    if anonymous_roles is not None:
        lines += ["[anonymous]", "enabled = true", f"roles = {toml_value(anonymous_roles)}", ""]
    for perm in permissions:
        lines.append("[[permissions]]")
        lines += [f"{k} = {toml_value(v)}" for k, v in perm.items()]
        lines.append("")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


