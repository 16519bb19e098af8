"""The README's commands, run as written, from the repository the tests run in (CI: a fresh clone).

The README starts with exactly two commands: the main job and the test command. The test runs
the main job (``bash etc/run-local.sh``) on its fixed ports, sends a few messages through the
front door so the logs have lines, then runs every other command of the README's ``sh`` blocks
with bash in the repository's root, exactly as a person pastes it, and checks each exits 0 and
does what the README says beside it. Only the test command itself is not run (it is what runs
this test), and the two "each program on its own" commands run after the deployment stopped (they
use the same ports). The deployment writes under ``var/`` (as for a person); the test removes
the state it made (``var/local``, the router's cache and routing log, ``var/gravity``) when done.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess

import pytest
from proton import Message
from proton.utils import BlockingConnection

from tests.paths import REPO
from tests.serverproc import read_banner
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

#: every port the sample deployment listens on (etc/*.toml), and the dry-run example's free one
FIXED_PORTS = [5672, 5673, 5674, 8160, 15672, 15673, 15674, 18161, 18162, 18163, 18164]


def readme_blocks() -> list[list[str]]:
    """Each ``sh`` block of README.md as its commands: continuation lines joined, comments and
    comment-only lines dropped."""
    text = (REPO / "README.md").read_text()
    blocks = []
    for body in re.findall(r"```sh\n(.*?)```", text, re.S):
        commands, current = [], ""
        for line in body.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            code = re.sub(r"\s+#\s.*$", "", line).rstrip()
            if code.endswith("\\"):
                current += code[:-1].rstrip() + " "
                continue
            commands.append((current + code.strip()).strip())
            current = ""
        blocks.append(commands)
    return blocks


def _busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _run(command: str, *, stdin: str | None = None, timeout_s: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run(["bash", "-c", command], cwd=REPO, input=stdin, capture_output=True, text=True,
                          timeout=timeout_s, start_new_session=True)   # no terminal: getpass reads stdin
    assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def _clean() -> None:
    for rel in ("var/local", "var/gravity"):
        subprocess.run(["rm", "-rf", str(REPO / rel)], check=False)
    for f in ("var/router/cache-main.log", "var/router/pins.jsonl"):
        (REPO / f).unlink(missing_ok=True)


def test_the_readme_starts_with_the_main_job_and_the_test_command():
    assert readme_blocks()[0] == ["bash etc/run-local.sh", "bash etc/run-tests.sh"]


def test_every_readme_command_runs_as_written():
    busy = [p for p in FIXED_PORTS if _busy(p)]
    assert not busy, f"ports {busy} are in use: stop the local deployment (etc/run-local.sh) before this test"
    blocks = readme_blocks()
    main_job = blocks[0][0]
    others = [c for block in blocks[1:] for c in block]
    on_its_own = [c for c in others if re.search(r"lodestone-(broker|router) run ", c)]
    rest = [c for c in others if c not in on_its_own]
    assert len(on_its_own) == 2 and rest, others
    _clean()
    deployment = subprocess.Popen(["bash", "-c", main_job], cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        read_banner(deployment, 120)
        # traffic: a few clients through the front door, so the logs the commands read have lines
        for i in range(6):
            conn = BlockingConnection("amqp://127.0.0.1:5672", timeout=20, container_id=f"readme-{i}",
                                      user="app", password="app", allowed_mechs="PLAIN")
            try:
                conn.create_sender(f"readme.{i}").send(Message(body=i, durable=True))
                receiver = conn.create_receiver(f"readme.{i}")
                assert receiver.receive(timeout=20).body == i
                receiver.accept()
            finally:
                conn.close()
        for command in rest:
            if "run-tests.sh" in command:
                continue
            stdin = "readme-secret\nreadme-secret\n" if "hash-password" in command else None
            out = _run(command, stdin=stdin)
            if "hash-password" in command:
                assert out.stdout.strip().startswith("scrypt"), out.stdout
            if " dry-run " in command:
                assert "broker-4" in out.stdout, out.stdout
            if "/api/v1/reload" in command:
                assert '"applied"' in out.stdout, out.stdout
            if "lodestone-gravity" in command:
                assert (REPO / "var" / "gravity").is_dir()
    finally:
        if deployment.poll() is None:
            os.killpg(deployment.pid, signal.SIGINT)
            try:
                deployment.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(deployment.pid, signal.SIGKILL)
                deployment.wait()
        deployment.stdout.close()
    wait_for(lambda: not any(_busy(p) for p in FIXED_PORTS), 30, what="the deployment's ports free again")
    try:
        for command in on_its_own:   # each program on its own: it starts, says where it listens, stops
            proc = subprocess.Popen(["bash", "-c", f"exec {command}"], cwd=REPO, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, start_new_session=True)
            try:
                seen = []
                while True:
                    line = proc.stdout.readline()
                    assert line, f"{command} exited before listening:\n{''.join(seen)}"
                    seen.append(line)
                    if line.startswith("listening "):
                        break
            finally:
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=60) == 0, "".join(seen)
                proc.stdout.close()
    finally:
        _clean()
