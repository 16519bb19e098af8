"""Network namespaces made by a test (tests run as root): multicast on loopback needs a route
and the MULTICAST flag on ``lo``, which the host's own namespace may not have and a test must not
change. A scenario that needs them runs entirely inside a fresh namespace:

    with network_namespace() as ns:
        run_in(ns, [sys.executable, "-m", "tests.integration.discovery_scenarios", "see", str(tmp)])

``ip`` (iproute2) makes them; everything started inside inherits the namespace.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
from typing import Iterator

_names = itertools.count(1)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@contextlib.contextmanager
def network_namespace() -> Iterator[str]:
    """A fresh namespace with ``lo`` up, multicast on, and 224.0.0.0/4 routed to it."""
    name = f"lodestone-{os.getpid()}-{next(_names)}"
    _ip("netns", "add", name)
    try:
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "multicast", "on")
        _ip("netns", "exec", name, "ip", "route", "add", "224.0.0.0/4", "dev", "lo")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


def run_in(ns: str, argv: list[str], *, timeout_s: float = 180.0, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``argv`` inside namespace ``ns``; its output is captured (text)."""
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=timeout_s,
                          cwd=cwd)
