"""`lodestone-local`: run a local deployment — three broker nodes and the router — in the foreground.

It starts ``python -m broker run etc/broker-{1,2,3}.toml`` and then ``python -m router run
etc/router.toml`` as child processes, waits for every ``listening ...`` line, prints where to
connect, and stays up until Ctrl-C or SIGTERM, which it forwards to every child (router first,
so it drains, then the brokers). If any child dies, the others are stopped and the exit status
is non-zero. Children's logs go to ``var/local/logs/<name>.log`` (``--logs``).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

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

    def start(self, env: dict[str, str]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=log, env=env,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            parts = line.split()
            if len(parts) == 3 and parts[0] == "listening":
                self.listening[parts[1]] = parts[2]
            elif line == "ready" or line.startswith("ready "):
                self.ready.set()
        self.ready.set()  # EOF: the child is gone; the waiter checks poll()

    def wait_listening(self, names: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                return False
            if len(self.listening) >= names:
                return True
            time.sleep(0.05)
        return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass


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
    args = parser.parse_args(argv)

    etc = Path(args.etc)
    logs = Path(args.logs)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    brokers = [Child(f"broker-{i}", [sys.executable, "-m", "broker", "run", str(etc / f"broker-{i}.toml")],
                     logs / f"broker-{i}.log") for i in range(1, args.brokers + 1)]
    router = Child("router", [sys.executable, "-m", "router", "run", str(etc / "router.toml")],
                   logs / "router.log")
    children = brokers + [router]

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
        if not b.wait_listening(2, args.start_timeout):
            print(f"lodestone-local: {b.name} did not start; see {b.log_path}", file=sys.stderr)
            return shutdown(1)
    router.start(env)
    if not router.wait_listening(len(_ROUTER_PORTS) + 1, args.start_timeout):
        print(f"lodestone-local: the router did not start; see {router.log_path}", file=sys.stderr)
        return shutdown(1)

    print("Lodestone local deployment is up.")
    for b in brokers:
        print(f"  {b.name:9} amqp {b.listening.get('amqp', '?'):28} management {b.listening.get('management', '?')}")
    for what, url in router.listening.items():
        print(f"  router    {what:10} {url:28} {_ROUTER_PORTS.get(what, '')}".rstrip())
    print("  users: admin/admin (every role), app/app (send, consume) - loopback only")
    print(f"  logs: {logs}/   (routing log: see etc/router.toml [routing-log])")
    print("Ctrl-C stops everything.", flush=True)

    while not stopping.is_set():
        for child in children:
            if child.proc is not None and child.proc.poll() is not None:
                print(f"lodestone-local: {child.name} exited with status {child.proc.returncode}; "
                      f"see {child.log_path}", file=sys.stderr)
                return shutdown(1)
        stopping.wait(0.5)
    print("stopping...", flush=True)
    return shutdown(0)


if __name__ == "__main__":
    sys.exit(main())
