"""``udp://group:port`` starting points for :class:`router.client.ClusterConnector`: the client
listens to the brokers' broadcast groups, as Artemis clients do with a discovery group URL.

    ClusterConnector("udp://231.7.7.7:9876?refresh-timeout=10000&initial-wait-timeout=10000",
                     user="app", password="app")

A daemon thread joins the group (a plain blocking UDP socket) and feeds every datagram to the
broker's own sans-IO table (:class:`broker.wire.discovery.DiscoveryGroup`: garbage counted and
dropped, entries expire after ``refresh-timeout`` ms). The connector's first ``connect`` waits up to
``initial-wait-timeout`` ms for a first broker; every ``connect`` then starts from the brokers heard
(one connector each, the first announced), and the members an Open lists come on top, as with a URL
starting point. Query options: ``refresh-timeout``, ``initial-wait-timeout`` (ms, default 10000
each), ``local-bind-address`` (the interface to join on), ``cluster`` (only that cluster's
announcements), ``key`` (only announcements signed with the cluster key). IPv4.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from broker.wire.discovery import MAX_PACKET, DiscoveryGroup
from router.client.topology import Member, UrlListError

__all__ = ["DiscoverySpec", "Discoverer", "parse_discovery_url"]

_OPTIONS = ("refresh-timeout", "initial-wait-timeout", "local-bind-address", "cluster", "key")


@dataclass(frozen=True)
class DiscoverySpec:
    group_address: str
    group_port: int
    refresh_timeout_s: float = 10.0
    initial_wait_timeout_s: float = 10.0
    local_bind_address: str = "0.0.0.0"
    cluster: str | None = None
    key: str | None = None


def parse_discovery_url(url: str) -> DiscoverySpec:
    """``udp://group:port[?options]``; :class:`UrlListError` says what is wrong."""
    parts = urlsplit(url.strip())
    try:
        port = parts.port
        group = socket.inet_aton(parts.hostname or "")
    except (ValueError, OSError):
        raise UrlListError(f"{url!r}: expected udp://<IPv4 multicast group>:<port>") from None
    if parts.scheme != "udp" or port is None or not 224 <= group[0] <= 239:
        raise UrlListError(f"{url!r}: expected udp://<IPv4 multicast group>:<port>")
    opts = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = sorted(set(opts) - set(_OPTIONS))
    if unknown:
        raise UrlListError(f"{url!r}: unknown option {unknown[0]!r} (known: {', '.join(_OPTIONS)})")

    def ms(name: str) -> float:
        text = opts.get(name, "10000")
        if not text.isdigit() or int(text) < 1 and name == "refresh-timeout":
            raise UrlListError(f"{url!r}: {name}={text!r} must be a whole number of milliseconds")
        return int(text) / 1000.0

    bind = opts.get("local-bind-address", "0.0.0.0")
    try:
        socket.inet_aton(bind)
    except OSError:
        raise UrlListError(f"{url!r}: local-bind-address={bind!r} is not an IPv4 address") from None
    return DiscoverySpec(parts.hostname, port, ms("refresh-timeout"), ms("initial-wait-timeout"), bind,
                         opts.get("cluster") or None, opts.get("key") or None)


class Discoverer:
    """The listening thread and the table it keeps (see the module doc)."""

    def __init__(self, spec: DiscoverySpec):
        self.spec = spec
        self.group = DiscoveryGroup(None, spec.refresh_timeout_s, cluster=spec.cluster, key=spec.key)
        self._lock = threading.Lock()
        self._heard = threading.Event()
        self._stop = threading.Event()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            mreq = struct.pack("4s4s", socket.inet_aton(spec.group_address), socket.inet_aton(spec.local_bind_address))
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
            self.sock.bind((spec.group_address, spec.group_port))
            self.sock.settimeout(0.25)
        except OSError:
            self.sock.close()
            raise
        self._thread = threading.Thread(target=self._run, name="lodestone-discovery", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                data, _ = self.sock.recvfrom(MAX_PACKET + 1)
            except socket.timeout:
                data = None
            except OSError:
                return
            with self._lock:
                if data is not None:
                    self.group.receive(data, time.monotonic())
                self.group.expire(time.monotonic())
                if self.group.entries:
                    self._heard.set()

    def members(self, *, wait: bool) -> list[Member]:
        """The brokers heard (one connector each); with ``wait``, up to the initial wait for one."""
        if wait:
            self._heard.wait(self.spec.initial_wait_timeout_s)
        with self._lock:
            self.group.expire(time.monotonic())
            return [Member(e.announcement.connectors[0], e.node_id)
                    for e in sorted(self.group.entries.values(), key=lambda e: e.node_id)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.sock.close()
