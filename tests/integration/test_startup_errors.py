"""What a newcomer hits at start (issue 8, item 6): "Address already in use" names the address
and port for every listener of both programs, a missing users file names the ``users-file`` key,
and ``lodestone-broker check`` validates like ``lodestone-router check``. Real subprocesses."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.serverproc import REPO

pytestmark = pytest.mark.slow
USERS = REPO / "etc" / "users.toml"


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=60, cwd=cwd)


def _router(tmp_path: Path, *, mgmt: int = 0, acc: int = 0, users: str = str(USERS)) -> Path:
    p = tmp_path / "router.toml"
    p.write_text(f'users-file = "{users}"\n[management]\nport = {mgmt}\n'
                 f'[[acceptors]]\nname = "front"\nport = {acc}\nrouter = "m"\n[routers.m]\n')
    return p


def _broker(tmp_path: Path, *, mgmt: int = 0, acc: int = 0, users: str = str(USERS)) -> Path:
    p = tmp_path / "broker.toml"
    p.write_text(f'[node]\ndata-dir = "{tmp_path / "data"}"\n[security]\nusers-file = "{users}"\n'
                 f'[acceptors.amqp]\nport = {acc}\n[management]\nport = {mgmt}\n')
    return p


def _last_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


@pytest.mark.parametrize("which", ["management", "acceptor"])
def test_router_port_in_use_names_the_address(tmp_path, busy_port, which):
    cfg = _router(tmp_path, **({"mgmt": busy_port} if which == "management" else {"acc": busy_port}))
    out = _run("router", "run", str(cfg), cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    line = _last_line(out.stderr)
    assert f"127.0.0.1:{busy_port}" in line and "in use" in line, out.stderr
    assert ("management" if which == "management" else "acceptors.front") in line
    assert line.startswith(f"lodestone-router: {'management' if which == 'management' else 'acceptors.front'}: "
                           f"cannot listen on 127.0.0.1:{busy_port}: Address already in use")


@pytest.mark.parametrize("which", ["management", "acceptor"])
def test_broker_port_in_use_names_the_address(tmp_path, busy_port, which):
    cfg = _broker(tmp_path, **({"mgmt": busy_port} if which == "management" else {"acc": busy_port}))
    out = _run("broker", "run", str(cfg), cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    line = _last_line(out.stderr)
    assert f"127.0.0.1:{busy_port}" in line and "in use" in line, out.stderr
    assert line == (f"lodestone-broker: {'management' if which == 'management' else 'acceptor amqp'}: "
                    f"cannot listen on 127.0.0.1:{busy_port}: Address already in use")


@pytest.mark.parametrize("command", ["run", "check"])
def test_router_missing_users_file_names_the_key(tmp_path, command):
    cfg = _router(tmp_path, users="nope.toml")
    out = _run("router", command, str(cfg), cwd=tmp_path)
    assert out.returncode == 2
    line = _last_line(out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert str(cfg) in line and "users-file" in line and "nope.toml" in line and "no such file" in line


def test_broker_missing_users_file_names_the_key(tmp_path):
    out = _run("broker", "run", str(_broker(tmp_path, users="nope.toml")), cwd=tmp_path)
    assert out.returncode == 2
    assert "security.users-file" in out.stderr and "nope.toml" in out.stderr


def test_broker_check_ok_with_summary(tmp_path):
    out = _run("broker", "check", str(REPO / "etc" / "broker-1.toml"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{REPO / 'etc' / 'broker-1.toml'}: ok")
    assert "acceptor" in lines[0] and "user" in lines[0]
    assert not (tmp_path / "var").exists()  # check creates no data directory


@pytest.mark.parametrize("case,expect", [
    ("bad-key", "acceptors.amqp.port"),
    ("missing-users", "security.users-file"),
    ("bad-users", "users."),
])
def test_broker_check_errors_are_one_line_exit_2(tmp_path, case, expect):
    if case == "bad-key":
        cfg = _broker(tmp_path)
        cfg.write_text(cfg.read_text().replace("port = 0\n[management]", "port = -4\n[management]"))
    elif case == "missing-users":
        cfg = _broker(tmp_path, users="nope.toml")
    else:
        bad = tmp_path / "users.toml"
        bad.write_text('[users.bob]\npassword = "plain"\nroles = ["x"]\nfavourite-colour = "red"\n')
        cfg = _broker(tmp_path, users=str(bad))
    out = _run("broker", "check", str(cfg), cwd=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert expect in out.stderr, out.stderr
    assert out.stdout == ""
