"""Network namespaces made by a test (tests run as root): multicast on loopback needs a route
and the MULTICAST flag on ``lo``, which the host's own namespace may not have and a test must not
change. A scenario that needs them runs entirely inside a fresh namespace:

    with network_namespace() as ns:
        run_in(ns, [sys.executable, "-m", "tests.integration.discovery_scenarios", "see", str(tmp)])

``ip`` (iproute2) makes them; everything started inside inherits the namespace.

A partition between members, :class:`Network`:

    net = Network(["p1", "p2", "backup"])     # one namespace per member, a link per pair
    net.host("p1")                            # "10.213.K.1": p1's address, reachable from the test
    proc = subprocess.Popen(..., preexec_fn=net.enter("p1"))   # a process inside p1's namespace
    net.cut("p1", "backup")                   # that link drops every packet, both ways
    net.isolate("p1")                         # every link of p1's (the test still reaches it)
    net.heal()                                # every link carries packets again
    net.close()                               # namespaces, links and routes gone

Each member is a namespace whose address (``10.213.K.n/32``, K random per network) sits on its
loopback. Every pair of members has its own point-to-point link: a veth in each namespace, both
joined by a bridge in the test's own namespace; the test reaches every member over one more veth,
never cut. The routes are /32 routes over those links and the neighbour entries are permanent,
so nothing but the link decides. ``cut`` takes the bridge's two ports down: the members' own
interfaces stay up, their routes stay, and what they send is dropped on the wire. Nothing is
reset and no error comes back: a TCP connection over a cut link just stops hearing from the
other side, and a new one gets no answer to its SYN, as across a real partition. That is what
the TCP proxy of ``tests/tcpproxy.py`` cannot show (its cut resets every connection).
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import os
import random
import secrets
import subprocess
from typing import Callable, Iterable, Iterator

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


# -- partitions between members ----------------------------------------------------------------

CLONE_NEWNET = 0x40000000


def available() -> str | None:
    """Why the tests cannot build a network here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        _ipn("netns", "list")
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"`ip netns` does not work here: {exc}"
    return None


def _ipn(*args: str, ns: str | None = None) -> str:
    argv = ["ip", *(("-n", ns) if ns else ()), *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise subprocess.CalledProcessError(r.returncode, argv, r.stdout, r.stderr)
    return r.stdout


class Network:
    def __init__(self, members: Iterable[str]) -> None:
        self.members = list(members)
        assert len(self.members) <= 40 and len(set(self.members)) == len(self.members)
        self.tag = secrets.token_hex(2)                 # interface names: at most 15 characters
        self.k = random.randrange(1, 250)
        self.root_ip = f"10.213.{self.k}.254"
        self.index = {m: i + 1 for i, m in enumerate(self.members)}
        self.ns = {m: f"lodestone-{self.tag}-{m}" for m in self.members}
        self.links: dict[frozenset, tuple[str, str]] = {}   # {a, b} -> the bridge's two ports
        self.bridges: list[str] = []
        self.root_veths: list[str] = []
        self.root_addr = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- what a test uses ---------------------------------------------------------------------
    def host(self, member: str) -> str:
        return f"10.213.{self.k}.{self.index[member]}"

    def enter(self, member: str) -> Callable[[], None]:
        """A ``preexec_fn`` that moves the child into ``member``'s namespace before it runs."""
        path = f"/run/netns/{self.ns[member]}"

        def preexec() -> None:
            fd = os.open(path, os.O_RDONLY)
            try:
                if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns {path}")
            finally:
                os.close(fd)

        return preexec

    def cut(self, a: str, b: str) -> None:
        for port in self.links[frozenset((a, b))]:
            _ipn("link", "set", port, "down")

    def restore(self, a: str, b: str) -> None:
        for port in self.links[frozenset((a, b))]:
            _ipn("link", "set", port, "up")

    def isolate(self, member: str) -> None:
        for other in self.members:
            if other != member:
                self.cut(member, other)

    def heal(self) -> None:
        for a, b in itertools.combinations(self.members, 2):
            self.restore(a, b)

    def close(self) -> None:
        for name in [*self.bridges, *self.root_veths]:
            subprocess.run(["ip", "link", "del", name], capture_output=True)
        for ns in self.ns.values():     # a namespace's own veth ends go with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if self.root_addr:
            subprocess.run(["ip", "addr", "del", f"{self.root_ip}/32", "dev", "lo"], capture_output=True)
        self.bridges, self.root_veths, self.root_addr = [], [], False

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- building it --------------------------------------------------------------------------
    @staticmethod
    def _mac(dev: str, ns: str | None = None) -> str:
        return json.loads(_ipn("-j", "link", "show", dev, ns=ns))[0]["address"]

    def _build(self) -> None:
        # the test's address, on its own loopback: the source of what it sends to every member
        _ipn("addr", "add", f"{self.root_ip}/32", "dev", "lo")
        self.root_addr = True
        for m in self.members:
            ns = self.ns[m]
            _ipn("netns", "add", ns)
            _ipn("link", "set", "lo", "up", ns=ns)
            _ipn("addr", "add", f"{self.host(m)}/32", "dev", "lo", ns=ns)
            # the test's own way in: never cut
            rv = f"lz{self.tag}r{self.index[m]}"
            _ipn("link", "add", rv, "type", "veth", "peer", "name", "eth-test", "netns", ns)
            self.root_veths.append(rv)
            _ipn("link", "set", rv, "up")
            _ipn("link", "set", "eth-test", "up", ns=ns)
            _ipn("route", "add", f"{self.host(m)}/32", "dev", rv, "src", self.root_ip)
            _ipn("route", "add", f"{self.root_ip}/32", "dev", "eth-test", "src", self.host(m), ns=ns)
            _ipn("neigh", "replace", self.host(m), "lladdr", self._mac("eth-test", ns), "dev", rv, "nud", "permanent")
            _ipn("neigh", "replace", self.root_ip, "lladdr", self._mac(rv), "dev", "eth-test", "nud", "permanent",
                ns=ns)
        for a, b in itertools.combinations(self.members, 2):
            ia, ib = self.index[a], self.index[b]
            br = f"lz{self.tag}b{ia}x{ib}"
            _ipn("link", "add", br, "type", "bridge")
            self.bridges.append(br)
            ports = []
            for me, other in ((a, b), (b, a)):
                port = f"lz{self.tag}p{self.index[me]}x{self.index[other]}"
                inner = f"eth{self.index[other]}"
                _ipn("link", "add", port, "type", "veth", "peer", "name", inner, "netns", self.ns[me])
                self.root_veths.append(port)
                _ipn("link", "set", port, "master", br)
                _ipn("link", "set", port, "up")
                _ipn("link", "set", inner, "up", ns=self.ns[me])
                _ipn("route", "add", f"{self.host(other)}/32", "dev", inner, "src", self.host(me), ns=self.ns[me])
                ports.append(port)
            _ipn("link", "set", br, "up")
            for me, other in ((a, b), (b, a)):
                mac = self._mac(f"eth{self.index[me]}", self.ns[other])
                _ipn("neigh", "replace", self.host(other), "lladdr", mac, "dev", f"eth{self.index[other]}", "nud",
                    "permanent", ns=self.ns[me])
            self.links[frozenset((a, b))] = (ports[0], ports[1])
