"""Run the vendored proton and rhea example programs (``tests/e2e/examples/``) against a real broker.

Each example is a separate process; the tests give it only what its own options take (URL or
host/port, credentials, counts). ``run`` waits for a program that ends by itself, ``running``
holds one that does not (``server.py``) and always stops it: no process outlives its test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from proton import Message
from proton.utils import BlockingConnection

from tests.brokerproc import ADMIN, BrokerProcess, start_broker, write_users_file
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
PROTON_EXAMPLES = REPO / "tests" / "e2e" / "examples" / "proton"
RHEA_EXAMPLES = REPO / "tests" / "e2e" / "examples" / "rhea"
NODE_MODULES = REPO / "clients" / "node" / "node_modules"
APP = ("app", "app-pw")
ADDRESS = "examples"  # the node every example uses by default


def examples_broker(tmp_path: Path, **config) -> BrokerProcess:
    """A broker for the examples: PLAIN for ``app``, anonymous access (SASL ANONYMOUS, and no SASL
    at all, as rhea connects without a user name) with the ``app`` role."""
    users = write_users_file(tmp_path / "users.toml", {ADMIN[0]: (ADMIN[1], ["admin"]), APP[0]: (APP[1], ["app"])},
                             anonymous_roles=["app"])
    return start_broker(tmp_path, users_file=users, mechanisms=("PLAIN", "ANONYMOUS"),
                        config={"acceptors.amqp": {"allow-no-sasl": True}, **config})


def proton_url(broker: BrokerProcess) -> str:
    return f"amqp://{APP[0]}:{APP[1]}@{broker.host}:{broker.port}/{ADDRESS}"


def proton_cmd(example: str, *args: str) -> list[str]:
    return [sys.executable, str(PROTON_EXAMPLES / example), *args]


def node_env() -> dict[str, str]:
    # rhea and minimist resolve from clients/node (the examples are kept byte for byte)
    return {**os.environ, "NODE_PATH": str(NODE_MODULES)}


def _env(env: dict[str, str] | None) -> dict[str, str]:
    return {**(env or os.environ), "PYTHONUNBUFFERED": "1"}


def run(cmd: list[str], *, timeout_s: float = 30.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a program that ends by itself; killed (and reaped) if it outlives ``timeout_s``."""
    with subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=_env(env)) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{cmd} did not end within {timeout_s}s\nstdout:\n{out}\nstderr:\n{err}") from None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def lines(cp: subprocess.CompletedProcess) -> list[str]:
    assert cp.returncode == 0, (cp.args, cp.returncode, cp.stdout, cp.stderr)
    return cp.stdout.splitlines()


class Background:
    """A program that runs until stopped; ``stop()`` sends SIGINT (proton's examples catch
    KeyboardInterrupt and exit), then SIGKILL if it is still there."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None):
        self.cmd = cmd
        # SIGINT back to its default in the program, so Python turns it into KeyboardInterrupt even
        # when the suite itself runs with SIGINT ignored (a background job of a non-interactive shell)
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=_env(env),
                                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.stdout = self.stderr = ""
        self.stopped = False

    def stop(self, grace_s: float = 10.0) -> int:
        """Stop it (once; later calls return the same status) and collect its output."""
        if self.stopped:
            return self.proc.returncode
        self.stopped = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            out, err = self.proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        self.stdout, self.stderr = out, err
        return self.proc.returncode


@contextmanager
def running(cmd: list[str], env: dict[str, str] | None = None):
    bg = Background(cmd, env)
    try:
        yield bg
    finally:
        bg.stop()


def wait_consumers(broker: BrokerProcess, name: str, n: int, timeout_s: float = 15.0) -> None:
    wait_for(lambda: (broker.queue(name) or {}).get("consumers") == n, timeout_s)


def depth(broker: BrokerProcess, name: str = ADDRESS) -> int | None:
    q = broker.queue(name)
    return None if q is None else q["depth"]


def send(broker: BrokerProcess, messages: list[Message], address: str = ADDRESS) -> None:
    """Send with a blocking proton sender (each message accepted before the next)."""
    conn = BlockingConnection(broker.amqp_url, timeout=10, user=APP[0], password=APP[1], allowed_mechs="PLAIN")
    try:
        snd = conn.create_sender(address)
        for m in messages:
            snd.send(m)
    finally:
        conn.close()


def drain(broker: BrokerProcess, address: str = ADDRESS, timeout_s: float = 3.0) -> list[Message]:
    """Consume (and accept) everything waiting on ``address``."""
    conn = BlockingConnection(broker.amqp_url, timeout=10, user=APP[0], password=APP[1], allowed_mechs="PLAIN")
    try:
        rcv = conn.create_receiver(address, credit=100)
        got = []
        while True:
            try:
                m = rcv.receive(timeout=timeout_s)
            except Exception:  # proton's Timeout: nothing more
                break
            got.append(m)
            rcv.accept()
            timeout_s = 1.0
        return got
    finally:
        conn.close()


REQUESTS = ["Twas brillig, and the slithy toves",
            "Did gire and gymble in the wabe.",
            "All mimsy were the borogroves,",
            "And the mome raths outgrabe."]
# what client.py, sync_client.py and client.js print against server.py (proton's and rhea's own example tests)
CLIENT_OUTPUT = [f"{r} => {r.upper()}" for r in REQUESTS]
