"""A real RabbitMQ (Debian's ``rabbitmq-server``, AMQP 1.0 plugin) for tests and benchmarks.

Run from a scratch folder on loopback, on OS-chosen free ports, with the ``rabbitmq_amqp1_0``
plugin enabled offline; nothing in /etc is touched and the packaged service is never started.
Installed with apt-get when missing (``etc/run-tests.sh`` installs it for the test suite).
Queues are declared with ``rabbitmqctl eval`` and addressed over AMQP 1.0 as ``/amq/queue/<name>``;
the user is RabbitMQ's ``guest`` (loopback only).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

__all__ = ["RabbitMQ"]

SBIN = Path("/usr/lib/rabbitmq/bin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RabbitMQ:
    """One RabbitMQ node; :meth:`start` it, :meth:`stop` (or :meth:`restart`) it on the same port."""

    def __init__(self, work: Path, *, name: str = "lodestone-test") -> None:
        if not (SBIN / "rabbitmq-server").exists():
            print("installing rabbitmq-server (apt-get) ...", file=sys.stderr, flush=True)
            subprocess.run(["apt-get", "install", "-y", "rabbitmq-server"], check=True,
                           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, stdout=subprocess.DEVNULL)
        self.dir = Path(work) / "rmq"
        for d in ("home", "log", "mnesia"):
            (self.dir / d).mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        dist = _free_port()
        self.nodename = f"{name}-{os.getpid()}@localhost"
        self.env = {**os.environ,
                    "HOME": str(self.dir / "home"),
                    "RABBITMQ_CONF_ENV_FILE": str(self.dir / "rabbitmq-env.conf"),
                    "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq.conf"),
                    "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "enabled_plugins"),
                    "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
                    "RABBITMQ_LOG_BASE": str(self.dir / "log"),
                    "RABBITMQ_NODENAME": self.nodename,
                    "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                    "RABBITMQ_NODE_PORT": str(self.port),
                    "RABBITMQ_DIST_PORT": str(dist),  # else AMQP port + 20000, which may exceed 65535
                    "ERL_EPMD_ADDRESS": "127.0.0.1",
                    "PATH": f"{SBIN}:{os.environ.get('PATH', '')}"}
        (self.dir / "rabbitmq-env.conf").write_text("")
        (self.dir / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.port}\n"
            "distribution.listener.interface = 127.0.0.1\n"
            f"distribution.listener.port_range.min = {dist}\ndistribution.listener.port_range.max = {dist}\n"
            "loopback_users.guest = true\nlog.console = false\nlog.file.level = warning\n")
        self.epmd_was_running = self._epmd_pid() is not None
        self._ctl("rabbitmq-plugins", "enable", "--offline", "rabbitmq_amqp1_0")
        self.pidfile = self.dir / "mnesia" / f"{self.nodename}.pid"
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None

    @property
    def url(self) -> str:
        return f"amqp://127.0.0.1:{self.port}"

    @property
    def client_url(self) -> str:
        """For a proton client: with guest's credentials."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}"

    @staticmethod
    def address(queue: str) -> str:
        return f"/amq/queue/{queue}"

    def start(self) -> "RabbitMQ":
        self.pidfile.unlink(missing_ok=True)
        with open(self.dir / "log" / "stdout.log", "ab") as out:   # the child keeps its own copy
            self.proc = subprocess.Popen([str(SBIN / "rabbitmq-server")], cwd=self.dir, env=self.env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._ctl("rabbitmqctl", "-q", "wait", "--timeout", "180", str(self.pidfile))
        except subprocess.SubprocessError:
            os.killpg(self.proc.pid, signal.SIGKILL)  # our own process group (start_new_session)
            self.proc.wait()
            log = "\n".join(p.read_text(errors="replace")[-2000:] for p in (self.dir / "log").glob("*.log"))
            raise RuntimeError(f"rabbitmq did not start:\n{log}") from None
        self.pid = int(self.pidfile.read_text().strip())
        return self

    def declare(self, queue: str, *, durable: bool = True) -> None:
        self._ctl("rabbitmqctl", "-q", "eval",
                  f'rabbit_amqqueue:declare(rabbit_misc:r(<<"/">>, queue, <<"{queue}">>), '
                  f'{"true" if durable else "false"}, false, [], none, <<"lodestone">>).')

    def depth(self, queue: str) -> int:
        """Messages in ``queue`` (ready and unacknowledged)."""
        out = subprocess.run([str(SBIN / "rabbitmqctl"), "-q", "list_queues", "name", "messages"], env=self.env,
                             cwd=self.dir, capture_output=True, text=True, check=True, timeout=120).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == queue:
                return int(parts[1])
        raise KeyError(queue)

    def purge(self, queue: str) -> None:
        self._ctl("rabbitmqctl", "-q", "purge_queue", queue)

    def _ctl(self, *args: str) -> None:
        subprocess.run([str(SBIN / args[0]), *args[1:]], env=self.env, check=True, cwd=self.dir,
                       stdout=subprocess.DEVNULL, timeout=120)

    @staticmethod
    def _epmd_pid() -> int | None:
        out = subprocess.run(["ss", "-ltnpH", "sport = :4369"], capture_output=True, text=True).stdout
        for part in out.split("pid=")[1:]:
            return int(part.split(",")[0])
        return None

    def stop(self, *, epmd: bool = True) -> None:
        """A clean stop (``rabbitmqctl stop``); ``epmd``: also stop the epmd it started."""
        if self.proc is None:
            return
        try:
            self._ctl("rabbitmqctl", "-q", "stop", str(self.pidfile))
        except subprocess.SubprocessError:
            os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None
        if epmd and not self.epmd_was_running:  # we started epmd with this node: stop it, by its pid
            pid = self._epmd_pid()
            if pid is not None and Path(f"/proc/{pid}/comm").read_text().strip() == "epmd":
                os.kill(pid, signal.SIGTERM)

    def restart(self) -> "RabbitMQ":
        """Stop cleanly and start again on the same port, with the same data."""
        self.stop(epmd=False)
        return self.start()
