"""The lodestone-broker command line: help, config errors (one line, status 2), hash-password."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.brokerproc import REPO

pytestmark = pytest.mark.slow


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "broker", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, input=stdin)


def test_help():
    p = run("--help")
    assert p.returncode == 0 and "run" in p.stdout and "hash-password" in p.stdout
    p = run("run", "--help")
    assert p.returncode == 0 and "--amqp-port" in p.stdout


def test_console_script_help():
    exe = Path(sys.executable).with_name("lodestone-broker")
    if not exe.exists():
        pytest.skip("the package is not installed in this environment (pip install -e .)")
    p = subprocess.run([str(exe), "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.startswith("usage: lodestone-broker") and "run" in p.stdout


@pytest.mark.parametrize("body,expected", [
    ("[acceptors.amqp]\nport = 70000\n", "acceptors.amqp.port: 70000 must be <= 65535"),
    ("[acceptors.amqp]\nport = 0\nbogus = 1\n", "acceptors.amqp.bogus: unknown key (value 1)"),
    ("[acceptors.amqp\n", "invalid TOML"),
    ("[acceptors.amqp]\nport = 0\nsasl-mechanisms = ['PLAIN', 'KERBEROS']\n",
     "acceptors.amqp.sasl-mechanisms[1]: 'KERBEROS' must be one of PLAIN, ANONYMOUS, EXTERNAL"),
    ("[acceptors.amqp]\nport = 0\n[journal]\nsync = 'sometimes'\n", "journal.sync: 'sometimes'"),
    ("[acceptors.amqp]\nport = 0\n[amqp]\nhandshake-timeout-s = 0\n", "amqp.handshake-timeout-s: 0"),
])
def test_config_error_is_one_line_exit_2(tmp_path, body, expected):
    (tmp_path / "users.toml").write_text("")
    cfg = tmp_path / "broker.toml"
    cfg.write_text(body)
    p = run("run", str(cfg))
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and str(cfg) in lines[0] and expected in lines[0]
    assert p.stdout == ""


def test_missing_config_file(tmp_path):
    p = run("run", str(tmp_path / "nope.toml"))
    assert p.returncode == 2 and "no such file" in p.stderr


def test_bad_users_file_is_a_config_error(tmp_path):
    (tmp_path / "users.toml").write_text("[users.x]\npassword = 'plain'\n")
    cfg = tmp_path / "broker.toml"
    cfg.write_text(f"[node]\ndata-dir = 'd'\n[acceptors.amqp]\nport = 0\n")
    p = run("run", str(cfg))
    assert p.returncode == 2 and "users.toml" in p.stderr and "users.x.password" in p.stderr


def test_hash_password():
    p = run("hash-password", "--stdin", stdin="s3cret\n")
    assert p.returncode == 0 and p.stdout.startswith("scrypt$")


def test_sighup_is_logged_and_ignored_not_a_stop(tmp_path):
    """A service manager's "reload" (SIGHUP) must not end a broker (the default action would,
    silently, with a status systemd counts as clean)."""
    import signal

    from tests.brokerproc import BrokerProcess, write_config
    from tests.waiting import wait_for

    b = BrokerProcess(tmp_path / "b", write_config(tmp_path / "b", name="b")).start()
    try:
        b.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "signal SIGHUP ignored" in b.stderr_text(), 10, what="the SIGHUP line")
        assert b.proc.poll() is None
        assert b.management_get("/api/v1/broker")[0] == 200
    finally:
        assert b.terminate() == 0
