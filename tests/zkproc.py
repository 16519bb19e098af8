"""Real Apache ZooKeeper servers for tests: Debian's ``zookeeper`` package (etc/run-tests.sh
installs it; Java is there for Spark), standalone or as an ensemble on loopback.

    from tests.zkproc import start_ensemble

    zk = start_ensemble(tmp_path, 1, tick_ms=250)     # a standalone server
    zk.connect_string                                 # "127.0.0.1:P"
    zks = start_ensemble(tmp_path, 3)                 # three servers, one quorum
    zks.servers[0].kill()

Each server has its own data directory and ports chosen free up front; ``net``/``hosts`` put
them in network namespaces (tests/netns.py). A server counts as started once it answers the
``srvr`` four-letter word with its mode (standalone, leader or follower).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from pathlib import Path

from tests.serverproc import free_ports
from tests.waiting import wait_for

JAR_DIR = Path("/usr/share/java")
MAIN = "org.apache.zookeeper.server.quorum.QuorumPeerMain"


def available() -> str | None:
    """Why no ZooKeeper server can run here, or None."""
    if not (JAR_DIR / "zookeeper.jar").exists():
        return "Debian's zookeeper package is not installed (etc/run-tests.sh installs it)"
    if shutil.which("java") is None:
        return "no java"
    return None


def classpath() -> str:
    # zookeeper.jar's manifest names its dependencies; slf4j-simple makes its log readable
    jars = ["zookeeper.jar", "zookeeper-jute.jar", "slf4j-api.jar", "slf4j-simple.jar"]
    return ":".join(str(JAR_DIR / j) for j in jars if (JAR_DIR / j).exists())


def srvr(host: str, port: int, timeout_s: float = 1.0) -> str | None:
    """The server's ``srvr`` answer, None if it does not answer."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(b"srvr")
            s.settimeout(timeout_s)
            chunks = []
            while True:
                b = s.recv(4096)
                if not b:
                    break
                chunks.append(b)
        return b"".join(chunks).decode("utf-8", "replace")
    except OSError:
        return None


def mode(host: str, port: int) -> str | None:
    text = srvr(host, port)
    if not text:
        return None
    for line in text.splitlines():
        if line.startswith("Mode:"):
            return line.split(":", 1)[1].strip()
    return None


class ZooKeeperServer:
    def __init__(self, workdir: Path, myid: int, host: str, client_port: int, peer_port: int,
                 election_port: int, preexec=None) -> None:
        self.workdir = workdir
        self.myid = myid
        self.host = host
        self.port = client_port
        self.peer_port = peer_port
        self.election_port = election_port
        self.preexec = preexec
        self.proc: subprocess.Popen | None = None
        self.log_path = workdir / "zookeeper.log"

    def start(self) -> "ZooKeeperServer":
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(["java", "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1",
                                      "-Dzookeeper.4lw.commands.whitelist=srvr,ruok",
                                      "-Dzookeeper.admin.enableServer=false", "-cp", classpath(), MAIN,
                                      str(self.workdir / "zoo.cfg")],
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     preexec_fn=self.preexec)
        log.close()
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def mode(self) -> str | None:
        return mode(self.host, self.port)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class Ensemble:
    def __init__(self, servers: list[ZooKeeperServer]) -> None:
        self.servers = servers

    @property
    def connect_string(self) -> str:
        return ",".join(f"{s.host}:{s.port}" for s in self.servers)

    def wait_serving(self, timeout_s: float = 60.0, *, count: int | None = None) -> None:
        """Until ``count`` (default all) running servers answer with a mode."""
        want = len(self.servers) if count is None else count

        def ready() -> bool:
            return sum(1 for s in self.servers if s.proc is not None and s.proc.poll() is None
                       and s.mode() is not None) >= want
        if not wait_for(ready, timeout_s, interval_s=0.2, raise_on_timeout=False):
            raise AssertionError(f"{want} ZooKeeper server(s) did not serve within {timeout_s:g} s:\n"
                                 + "\n".join(s.log_text()[-1500:] for s in self.servers))

    def stop(self) -> None:
        for s in self.servers:
            s.kill()


def start_ensemble(tmp_path: Path, n: int = 1, *, tick_ms: int = 250, hosts: list[str] | None = None,
                   prexecs: list | None = None, wait: bool = True) -> Ensemble:
    """``n`` ZooKeeper servers (standalone when ``n`` = 1) with ``tickTime`` = ``tick_ms``
    (ZooKeeper's sessions last 2 to 20 ticks); ``hosts``/``prexecs``: each server's address and
    the ``preexec_fn`` that puts it in its namespace."""
    hosts = hosts or ["127.0.0.1"] * n
    ports = free_ports(3 * n)
    servers = []
    for i in range(n):
        workdir = Path(tmp_path) / f"zk{i + 1}"
        (workdir / "data").mkdir(parents=True, exist_ok=True)
        servers.append(ZooKeeperServer(workdir, i + 1, hosts[i], ports[3 * i], ports[3 * i + 1], ports[3 * i + 2],
                                       preexec=(prexecs or [None] * n)[i]))
    for s in servers:
        lines = [f"tickTime={tick_ms}", f"dataDir={s.workdir / 'data'}", f"clientPort={s.port}",
                 f"clientPortAddress={s.host}", "initLimit=20", "syncLimit=10", f"minSessionTimeout={2 * tick_ms}",
                 f"maxSessionTimeout={20 * tick_ms}", "admin.enableServer=false", "autopurge.purgeInterval=0"]
        if n > 1:
            (s.workdir / "data" / "myid").write_text(f"{s.myid}\n")
            for o in servers:
                lines.append(f"server.{o.myid}={o.host}:{o.peer_port}:{o.election_port}")
        (s.workdir / "zoo.cfg").write_text("\n".join(lines) + "\n")
    ens = Ensemble(servers)
    for s in servers:
        s.start()
    if wait:
        ens.wait_serving()
    return ens
