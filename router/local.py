"""`lodestone-local`: run a local deployment — three broker nodes, broker-1's replicated backup and the router — in the foreground.

It starts ``python -m broker run etc/broker-{1,2,3}.toml`` (and ``etc/broker-1-backup.toml``,
broker-1's replicated backup, when that file exists; it prints only its management line until it
takes over) and then ``python -m router run etc/router.toml`` as child processes, waits for every ``listening ...`` line, prints where to
connect (with each process's pid), and stays up until Ctrl-C or SIGTERM, which it forwards to
every child (router first, so it drains, then the brokers). Children's logs go to
``var/local/logs/<name>.log`` (``--logs``).

A broker that exits (crash, ``kill -9``) does not stop the deployment: the router keeps serving
with the others (its health probe marks the broker not ready within one check-period), and
``lodestone-local`` prints which broker exited and its exit status, then starts it again on the
same config and data directory after a back-off — 1 s, doubling up to 30 s while restarts keep
failing, back to 1 s once a restarted broker has stayed up for 60 s — and prints
``broker-N is back (pid P)`` once it listens again. ``--no-restart`` leaves it down (restart it
by hand with ``lodestone-broker run etc/broker-N.toml``). If the router exits, everything is
stopped and the exit status is non-zero.

The children's stderr goes to their logs, so the console would otherwise never see why a child
did not start or what it warned about: the banner ends with the configuration warnings the
children logged while starting (sample credentials, the router's open-files budget), each once
with the processes that logged it, and a child that does not start is reported with the error
lines of its log since this start (``data directory … is locked by process N`` when another
deployment runs on the same folder) and those warnings.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from broker.config import load_config

#: what each router port of etc/router.toml does (the banner; README "The local deployment")
_ROUTER_PORTS = {
    "auto": "every client: redirect-following clients redirected, all others proxied",
    "proxy": "every client proxied",
    "redirect": "every client redirected (amqp:connection:redirect)",
}

@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    listening: dict[str, str] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float | None = None   # monotonic time of the next restart, while it is down
    announced: bool = True            # "is back" printed for the current process
    listeners: int = 2                # listening lines that say it is up (a passive backup: 1)
    log_offset: int = 0               # size of the log when the current process started

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.listening = {}
        try:
            self.log_offset = self.log_path.stat().st_size
        except OSError:
            self.log_offset = 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log, env=env,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        self.started_at = time.monotonic()
        proc = self.proc
        threading.Thread(target=self._read_stdout, args=(proc,), daemon=True).start()

    def _read_stdout(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            parts = line.split()
            if len(parts) == 3 and parts[0] == "listening" and proc is self.proc:
                self.listening[parts[1]] = parts[2]
            elif line == "ready" or line.startswith("ready "):
                self.ready.set()
        self.ready.set()  # EOF: the child is gone; the waiter checks poll()
        proc.stdout.close()

    def wait_listening(self, names: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return False
            if len(self.listening) >= names:
                return True
            time.sleep(0.05)
        return False

    def log_lines(self) -> list[str]:
        """What the current process wrote to its log (its stderr) so far."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(self.log_offset)
                return f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return []

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


def multicast_probe(group: str, bind_address: str = "0.0.0.0", timeout_s: float = 1.0) -> str | None:
    """Can this host's brokers find each other over UDP multicast? Joins ``group`` on
    ``bind_address`` as a discovery group does (``broker.wire.io.udp``), sends one datagram to it
    from ``bind_address`` as a broadcast group does, and waits ``timeout_s`` for it to come back.
    None when it did; otherwise why not (one line)."""
    import socket
    import struct

    recv = send = None
    try:
        recv = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        recv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        recv.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                        struct.pack("4s4s", socket.inet_aton(group), socket.inet_aton(bind_address)))
        recv.bind((group, 0))                 # a port of its own: the brokers hear nothing of it
        port = recv.getsockname()[1]
        send = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        send.bind((bind_address, 0))
        if bind_address != "0.0.0.0":
            send.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(bind_address))
        send.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
        token = os.urandom(8)
        send.sendto(token, (group, port))
        recv.settimeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            data, _ = recv.recvfrom(64)
            if data == token:
                return None
        return f"a datagram sent to {group} did not come back within {timeout_s:g} s"
    except socket.timeout:
        return f"a datagram sent to {group} did not come back within {timeout_s:g} s"
    except OSError as exc:
        return f"{group} via {bind_address}: {exc.strerror or exc}"
    finally:
        for sock in (recv, send):
            if sock is not None:
                sock.close()


def cluster_discovery_args(etc: Path, n: int, mode: str) -> tuple[list[str], str]:
    """The extra ``lodestone-broker run`` arguments of the local deployment's brokers, and the
    banner line saying how they find each other: their ``[cluster] discovery-group`` where
    multicast works here (``mode`` ``auto``) or is asked for (``multicast``); otherwise
    ``--static-connectors`` with every node's ``[cluster] connector`` (``static``, or ``auto``
    when the probe fails, saying why)."""

    cfgs = [load_config(etc / f"broker-{i}.toml") for i in range(1, n + 1)]
    if (etc / "broker-1-backup.toml").exists() and n >= 1:
        cfgs.append(load_config(etc / "broker-1-backup.toml"))
    c0 = cfgs[0].cluster
    if c0 is None:
        return [], "cluster: none (no [cluster] in broker-1.toml)"
    dg = next((d for d in cfgs[0].discovery_groups if d.name == c0.discovery_group), None)
    if dg is None:
        return [], f"cluster {c0.name}: static connectors (from the broker configs)"
    static = ["--static-connectors", ",".join(c.cluster.connector for c in cfgs if c.cluster is not None)]
    where = f"UDP multicast {dg.group_address}:{dg.group_port} on {dg.local_bind_address}"
    if mode == "static":
        return static, f"cluster {c0.name}: static connectors (--cluster-discovery static)"
    why = multicast_probe(dg.group_address, dg.local_bind_address) if mode == "auto" else None
    if why is not None:
        return static, (f"cluster {c0.name}: multicast discovery does not work on this machine ({why}); "
                        "the brokers use static connectors instead")
    return [], f"cluster {c0.name}: discovery over {where} (discovery group {dg.name!r})"


#: a log line of broker.logsetup / router.logsetup: time, level, logger, message
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\S+ (DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+) (.*)$")
#: the loggers whose start-up warnings are about the configuration (sample credentials, the
#: cluster's sample password, the router's open-files budget); others (HA and peer progress) are not
_CONFIG_WARNING_LOGGERS = ("lodestone.broker", "router.main", "router.server")


def failure_reason(lines: list[str], n: int = 4) -> list[str]:
    """The last ``n`` lines of a child's log that say why it stopped: lines that are not log
    records (``lodestone-broker: data directory … is locked by process N``, a traceback) and
    ERROR/CRITICAL records; the last ``n`` lines when there is no such line."""
    reasons = [ln for ln in lines if ln.strip() and (not (m := _LOG_LINE.match(ln))
                                                     or m.group(1) in ("ERROR", "CRITICAL"))]
    return (reasons or [ln for ln in lines if ln.strip()])[-n:]


def start_warnings(logs: dict[str, list[str]]) -> list[tuple[str, list[str]]]:
    """The configuration warnings in the children's logs (name → lines), each message once with
    the children that logged it, in the order first seen."""
    seen: dict[str, list[str]] = {}
    for name, lines in logs.items():
        for ln in lines:
            m = _LOG_LINE.match(ln)
            if m and m.group(1) == "WARNING" and m.group(2) in _CONFIG_WARNING_LOGGERS:
                message = m.group(3).removeprefix("security: ")  # the broker's prefix; the router has none
                who = seen.setdefault(message, [])
                if name not in who:
                    who.append(name)
    return list(seen.items())


def _lock_holder(lines: list[str]) -> str | None:
    """``pid N (its command line)`` of the process a ``… is locked by process N`` line names."""
    for ln in lines:
        m = re.search(r"locked by process (\d+)", ln)
        if m:
            try:
                cmd = Path(f"/proc/{m.group(1)}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                cmd = ""
            return f"pid {m.group(1)}" + (f": {cmd}" if cmd else "")
    return None


def print_start_warnings(children: list[Child], indent: str = "  ", file=None) -> None:
    file = file or sys.stdout
    warnings = start_warnings({c.name: c.log_lines() for c in children if c.proc is not None})
    if not warnings:
        return
    print(f"{indent}warnings while starting (from the logs):", file=file)
    for message, who in warnings:
        print(f"{indent}  {message}  [{', '.join(who)}]", file=file)
    file.flush()


def report_not_started(child: Child, children: list[Child]) -> None:
    """Why ``child`` did not start, on stderr: its exit status, the reason lines of its log,
    who holds a locked data directory, and the warnings logged so far."""
    lines = child.log_lines()
    code = child.proc.poll() if child.proc is not None else None
    how = f" (exited with {describe_exit(code)})" if code is not None else " (no listening line in time)"
    print(f"lodestone-local: {child.name} did not start{how}; see {child.log_path}:", file=sys.stderr)
    for ln in failure_reason(lines):
        print(f"  {ln}", file=sys.stderr)
    holder = _lock_holder(lines)
    if holder is not None:
        print(f"  another deployment (or broker) runs on this data directory ({holder}): stop it first, "
              f"or run this one on a copy of etc/ with other ports and data directories", file=sys.stderr)
    print_start_warnings(children, file=sys.stderr)
    sys.stderr.flush()


RESTART_BACKOFF_S = (1.0, 30.0)   # first delay, cap (doubling while restarts keep failing)
STABLE_AFTER_S = 60.0             # a broker up this long starts the back-off afresh
CLIENT_HELP = "docs/clients.md"


def describe_exit(code: int) -> str:
    """``status 3`` / ``signal 9 (SIGKILL)`` for a Popen return code."""
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def _die_with_parent() -> None:
    """In the child: get SIGTERM if the supervisor dies, even by SIGKILL (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass  # not Linux: children are still stopped on a normal exit


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lodestone-local", description=__doc__.splitlines()[0])
    parser.add_argument("--etc", default="etc", help="folder holding broker-{1,2,3}.toml and router.toml")
    parser.add_argument("--brokers", type=int, default=3, help="how many broker nodes (1-3)")
    parser.add_argument("--logs", default="var/local/logs", help="where children's logs go")
    parser.add_argument("--start-timeout", type=float, default=60.0)
    parser.add_argument("--no-restart", action="store_true",
                        help="leave a broker that exits down instead of restarting it")
    parser.add_argument("--cluster-discovery", choices=("auto", "multicast", "static"), default="auto",
                        help="how the brokers find each other: their discovery group where multicast "
                             "works on this machine, else static connectors (auto, the default), "
                             "always the discovery group, or always static connectors")
    args = parser.parse_args(argv)

    etc = Path(args.etc)
    logs = Path(args.logs)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        extra, discovery_line = cluster_discovery_args(etc, args.brokers, args.cluster_discovery)
    except Exception as exc:  # a bad broker config: the broker itself says it best at start
        extra, discovery_line = [], f"cluster: cannot read the broker configs ({exc})"
    print(f"lodestone-local: {discovery_line}", flush=True)
    brokers = [Child(f"broker-{i}", [sys.executable, "-m", "broker", "run", str(etc / f"broker-{i}.toml"), *extra],
                     logs / f"broker-{i}.log") for i in range(1, args.brokers + 1)]
    backup_cfg = etc / "broker-1-backup.toml"
    if backup_cfg.exists() and args.brokers >= 1:   # broker-1's replicated backup (docs/ha.md)
        brokers.append(Child("broker-1-backup", [sys.executable, "-m", "broker", "run", str(backup_cfg), *extra],
                             logs / "broker-1-backup.log", listeners=1))
    router = Child("router", [sys.executable, "-m", "router", "run", str(etc / "router.toml")],
                   logs / "router.log")

    stopping = threading.Event()

    def on_signal(signum, frame):
        stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    def shutdown(code: int) -> int:
        for child in [router] + brokers:  # the router drains first, then the brokers
            child.stop()
            if child.proc is not None:
                try:
                    child.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    child.stop(signal.SIGKILL)
                    child.proc.wait()
        return code

    for b in brokers:
        b.start(env)
    for b in brokers:
        if not b.wait_listening(b.listeners, args.start_timeout):
            report_not_started(b, brokers)
            return shutdown(1)
    router.start(env)
    if not router.wait_listening(len(_ROUTER_PORTS) + 1, args.start_timeout):
        report_not_started(router, brokers + [router])
        return shutdown(1)

    print("Lodestone local deployment is up.")
    for b in brokers:
        if b.listeners == 1:
            print(f"  {b.name:9} passive backup of broker-1 (AMQP once it takes over)   management "
                  f"{b.listening.get('management', '?'):24} pid {b.proc.pid}")
            continue
        print(f"  {b.name:9} amqp {b.listening.get('amqp', '?'):28} management {b.listening.get('management', '?'):24} "
              f"pid {b.proc.pid}")
    for what, url in router.listening.items():
        print(f"  router    {what:10} {url:28} {_ROUTER_PORTS.get(what, '')}".rstrip())
    print(f"  router    pid {router.proc.pid}   (lodestone-local pid {os.getpid()})")
    print(f"  {discovery_line}")
    print("  users: admin/admin (every role), app/app (send, consume) - loopback only")
    print(f"  logs: {logs}/   (routing log: see etc/router.toml [routing-log])")
    print("  clients: the redirect acceptor answers amqp:connection:redirect; follow it with")
    print(f"           router.client.connect_following_redirects (see {CLIENT_HELP})")
    print("  a broker that exits is restarted" + (" - disabled (--no-restart)" if args.no_restart else
                                                  " after a back-off (1 s, doubling to 30 s)"))
    print_start_warnings(brokers + [router])
    print("Ctrl-C stops everything.", flush=True)

    while not stopping.is_set():
        now = time.monotonic()
        if router.proc is not None and router.proc.poll() is not None:
            print(f"lodestone-local: router (pid {router.proc.pid}) exited with "
                  f"{describe_exit(router.proc.returncode)}; stopping; see {router.log_path}",
                  file=sys.stderr, flush=True)
            return shutdown(1)
        for b in brokers:
            if b.restart_at is None and b.proc is not None and b.proc.poll() is not None:
                up_s = now - b.started_at
                b.backoff_s = (RESTART_BACKOFF_S[0] if up_s >= STABLE_AFTER_S or not b.backoff_s
                               else min(b.backoff_s * 2, RESTART_BACKOFF_S[1]))
                what = (f"lodestone-local: {b.name} (pid {b.proc.pid}) exited with "
                        f"{describe_exit(b.proc.returncode)}; see {b.log_path}; ")
                if args.no_restart:
                    print(what + f"not restarting (--no-restart): lodestone-broker run {' '.join(b.argv[4:])}",
                          file=sys.stderr, flush=True)
                    b.restart_at = float("inf")
                else:
                    print(what + f"the router serves with the others; restarting it in {b.backoff_s:g} s",
                          file=sys.stderr, flush=True)
                    b.restart_at = now + b.backoff_s
            elif b.restart_at is not None and now >= b.restart_at:
                b.restart_at = None
                b.restarts += 1
                b.announced = False
                b.start(env)
            elif not b.announced and len(b.listening) >= b.listeners:
                b.announced = True
                print(f"lodestone-local: {b.name} is back (pid {b.proc.pid}, restart {b.restarts})",
                      flush=True)
        stopping.wait(0.2)
    print("stopping...", flush=True)
    return shutdown(0)


if __name__ == "__main__":
    sys.exit(main())
