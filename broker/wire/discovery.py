"""Discovery: the UDP announcement packet and a discovery group's table of what it heard (sans-IO).

Theory of operation
-------------------
Artemis finds cluster members by UDP multicast: a node's *broadcast group* sends, every
``broadcast-period``, a packet naming the node and its connectors; a *discovery group* listening on
the same group address keeps the entries it hears, ignores the node's own, and drops an entry that
has not been refreshed within ``refresh-timeout``. This module is that format and that table, with
no sockets and no clock (the shells in :mod:`broker.wire.io.udp` — and the router, which imports
this module for its discovery pools — own both). It is shared by the broker and the router.

The packet (big-endian; at most :data:`MAX_PACKET` bytes)::

    magic    4 bytes  b"LDSc"
    version  u8       1
    flags    u8       bit 0: an HMAC-SHA256 trailer follows (the cluster key)
                      bit 1: a backups section follows the connectors
    sequence u64      the sender's broadcast counter, starting from its start time in ms × 65536
                      so that it grows across restarts (an older one is ignored)
    node id, cluster name, management URL          each u16 length + UTF-8
    connectors: u8 count, then each u16 length + UTF-8 (amqp://host:port or amqps://host:port)
    [backups: u8 count (1..4), then each
        connector        u16 length + UTF-8 (amqp:// or amqps://)
        management URL   u16 length + UTF-8 (http:// or https://; empty: unknown)
        in sync          u8 (0 or 1)]
    [hmac    32 bytes HMAC-SHA256(key, everything before it)]

The backups are the node's HA backups (a replication backup connected to it, a shared-store
backup waiting on its files), as Artemis's broadcast packets carry (live, backup) connector
pairs: a router's discovery pool makes each an HA pair member of the node id. Bit 1 is set only
when there are backups, so an announcement without any is byte for byte what nodes that predate
the section send — and those nodes drop a packet with bit 1 as garbage (unknown flags): a
cluster with such nodes must not announce backups until every node understands them.

With a cluster ``key`` the broadcaster signs its packets and a discovery group drops packets that
are unsigned or wrongly signed (forged); without one anybody on the group address can announce a
member — as in Artemis — and the cluster's credential still guards its links. Anything that is not
the format is :class:`DiscoveryError`: counted and dropped by the group, never fatal. The table
is bounded (:data:`MAX_ENTRIES`): while it is full a node id it does not know is refused (counted),
so a flood of made-up members cannot push out the real ones, which keep refreshing their entries.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass, field

__all__ = ["Announcement", "DiscoveryError", "DiscoveryGroup", "Entry", "encode_announcement",
           "decode_announcement", "MAX_PACKET", "MAX_ENTRIES", "MAX_BACKUPS"]

MAGIC = b"LDSc"
VERSION = 1
FLAG_SIGNED = 0x01
FLAG_BACKUPS = 0x02
MAX_PACKET = 1400          # one Ethernet-sized datagram
MAX_ENTRIES = 1024         # members one discovery group keeps
MAX_CONNECTORS = 8
MAX_BACKUPS = 4
_HEAD = struct.Struct(">4sBBQ")
_U16 = struct.Struct(">H")
_MAC = 32


class DiscoveryError(Exception):
    """A packet that is not an announcement (or whose signature does not check)."""


@dataclass(frozen=True)
class Announcement:
    """What one broadcast says. ``backups``: the node's HA backups as ``(connector, management
    URL or "", in sync)``."""

    node_id: str
    cluster: str
    management_url: str
    connectors: tuple[str, ...]
    sequence: int = 0
    backups: tuple[tuple[str, str, bool], ...] = ()


def _amqp_url(text: str) -> bool:
    return text.startswith(("amqp://", "amqps://"))


def _http_url(text: str) -> bool:
    """A management URL: http(s)://, or empty (unknown)."""
    return not text or text.startswith(("http://", "https://"))


def _put(out: list, text: str) -> None:
    raw = text.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError("string too long for an announcement")
    out.append(_U16.pack(len(raw)))
    out.append(raw)


def encode_announcement(a: Announcement, key: str | None = None) -> bytes:
    """The packet for ``a`` (signed with ``key`` when given); ValueError if it does not fit."""
    if not 1 <= len(a.connectors) <= MAX_CONNECTORS:
        raise ValueError(f"an announcement carries 1..{MAX_CONNECTORS} connectors")
    if len(a.backups) > MAX_BACKUPS:
        raise ValueError(f"an announcement carries at most {MAX_BACKUPS} backups")
    flags = (FLAG_SIGNED if key else 0) | (FLAG_BACKUPS if a.backups else 0)
    out = [_HEAD.pack(MAGIC, VERSION, flags, a.sequence)]
    for text in (a.node_id, a.cluster, a.management_url):
        _put(out, text)
    out.append(bytes((len(a.connectors),)))
    for c in a.connectors:
        _put(out, c)
    if a.backups:  # only then: without backups the packet is what older nodes send and read
        out.append(bytes((len(a.backups),)))
        for connector, mgmt, in_sync in a.backups:
            # what every listener would refuse (and drop the whole packet, the node with it)
            if not _amqp_url(connector):
                raise ValueError(f"backup connector {connector[:100]!r} is not an amqp:// or amqps:// URL")
            if not _http_url(mgmt):
                raise ValueError(f"backup management URL {mgmt[:100]!r} is not http(s)://")
            _put(out, connector)
            _put(out, mgmt)
            out.append(b"\x01" if in_sync else b"\x00")
    data = b"".join(out)
    if key:
        data += hmac.new(key.encode(), data, hashlib.sha256).digest()
    if len(data) > MAX_PACKET:
        raise ValueError(f"announcement of {len(data)} bytes is over {MAX_PACKET}")
    return data


def decode_announcement(data: bytes, key: str | None = None) -> Announcement:
    """Decode and check one packet; :class:`DiscoveryError` says what is wrong. With ``key``, only
    a packet signed with it is accepted."""
    if len(data) > MAX_PACKET:
        raise DiscoveryError(f"packet of {len(data)} bytes is over {MAX_PACKET}")
    if len(data) < _HEAD.size:
        raise DiscoveryError("packet too short")
    magic, version, flags, seq = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise DiscoveryError("not a Lodestone announcement (magic)")
    if version != VERSION:
        raise DiscoveryError(f"unknown announcement version {version}")
    if flags & ~(FLAG_SIGNED | FLAG_BACKUPS):
        raise DiscoveryError(f"unknown flags {flags:#x}")
    end = len(data)
    if flags & FLAG_SIGNED:
        end -= _MAC
        if end < _HEAD.size:
            raise DiscoveryError("packet too short for its signature")
    if key is not None:
        if not flags & FLAG_SIGNED:
            raise DiscoveryError("unsigned announcement (this cluster has a key)")
        mac = hmac.new(key.encode(), data[:end], hashlib.sha256).digest()
        if not hmac.compare_digest(mac, data[end:]):
            raise DiscoveryError("announcement signature does not match (forged, or another key)")
    pos = _HEAD.size

    def text(pos: int, what: str, *, empty: bool = False) -> tuple[str, int]:
        if pos + 2 > end:
            raise DiscoveryError(f"{what}: truncated")
        (n,) = _U16.unpack_from(data, pos)
        pos += 2
        if pos + n > end:
            raise DiscoveryError(f"{what}: truncated")
        try:
            s = data[pos:pos + n].decode("utf-8")
        except UnicodeDecodeError:
            raise DiscoveryError(f"{what}: not UTF-8") from None
        if not s and not empty:
            raise DiscoveryError(f"{what}: empty")
        return s, pos + n

    node_id, pos = text(pos, "node id")
    cluster, pos = text(pos, "cluster name")
    mgmt, pos = text(pos, "management URL", empty=True)
    if pos >= end:
        raise DiscoveryError("connectors: truncated")
    n = data[pos]
    pos += 1
    if not 1 <= n <= MAX_CONNECTORS:
        raise DiscoveryError(f"{n} connectors (1..{MAX_CONNECTORS})")
    connectors = []
    for i in range(n):
        c, pos = text(pos, f"connector {i}")
        if not _amqp_url(c):
            raise DiscoveryError(f"connector {i} is not an amqp:// or amqps:// URL")
        connectors.append(c)
    backups = []
    if flags & FLAG_BACKUPS:
        if pos >= end:
            raise DiscoveryError("backups: truncated")
        n = data[pos]
        pos += 1
        if not 1 <= n <= MAX_BACKUPS:
            raise DiscoveryError(f"{n} backups (1..{MAX_BACKUPS} when the backups flag is set)")
        for i in range(n):
            c, pos = text(pos, f"backup {i} connector")
            if not _amqp_url(c):
                raise DiscoveryError(f"backup {i} connector is not an amqp:// or amqps:// URL")
            bm, pos = text(pos, f"backup {i} management URL", empty=True)
            if not _http_url(bm):
                raise DiscoveryError(f"backup {i} management URL is not http(s)://")
            if pos >= end:
                raise DiscoveryError(f"backup {i} in-sync flag: truncated")
            if data[pos] > 1:
                raise DiscoveryError(f"backup {i} in-sync flag is {data[pos]} (0 or 1)")
            backups.append((c, bm, data[pos] == 1))
            pos += 1
    if pos != end:
        raise DiscoveryError(f"{end - pos} trailing bytes")
    if not _http_url(mgmt):
        raise DiscoveryError("management URL is not http(s)://")
    return Announcement(node_id, cluster, mgmt, tuple(connectors), seq, tuple(backups))


@dataclass
class Entry:
    """What a discovery group knows of one member."""

    announcement: Announcement
    first_seen: float
    last_seen: float

    @property
    def node_id(self) -> str:
        return self.announcement.node_id


@dataclass
class DiscoveryGroup:
    """The entries one discovery group heard (Artemis ``DiscoveryGroup``), pure.

    ``receive(data, now)`` applies one packet and returns ``("added" | "changed" | "refreshed",
    entry)`` (``changed``: its connectors, management URL or backups differ from the entry's) or
    None (own node, other cluster, older sequence, garbage — counted in ``dropped``);
    ``expire(now)`` removes and returns the entries not refreshed within ``refresh_timeout_s``.
    """

    own_node_id: str | None
    refresh_timeout_s: float = 10.0
    cluster: str | None = None        # only this cluster's announcements (None: any)
    key: str | None = None            # the cluster key: only signed announcements
    max_entries: int = MAX_ENTRIES
    entries: dict[str, Entry] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=lambda: {
        "received": 0, "garbage": 0, "own": 0, "other_cluster": 0, "stale": 0, "full": 0})
    last_error: str | None = None

    def receive(self, data: bytes, now: float):
        c = self.counters
        c["received"] += 1
        try:
            a = decode_announcement(data, self.key)
        except DiscoveryError as exc:
            c["garbage"] += 1
            self.last_error = str(exc)
            return None
        if a.node_id == self.own_node_id:
            c["own"] += 1
            return None
        if self.cluster is not None and a.cluster != self.cluster:
            c["other_cluster"] += 1
            return None
        e = self.entries.get(a.node_id)
        if e is None:
            if len(self.entries) >= self.max_entries:
                c["full"] += 1
                return None
            e = self.entries[a.node_id] = Entry(a, now, now)
            return ("added", e)
        if a.sequence < e.announcement.sequence:  # a replay, or a late datagram
            c["stale"] += 1
            return None
        old = e.announcement
        e.announcement = a
        e.last_seen = now
        if (old.connectors, old.management_url, old.backups) != (a.connectors, a.management_url,
                                                                 a.backups):
            return ("changed", e)
        return ("refreshed", e)

    def expire(self, now: float) -> list[Entry]:
        gone = [e for e in self.entries.values() if now - e.last_seen > self.refresh_timeout_s]
        for e in gone:
            del self.entries[e.node_id]
        return gone

    def next_expiry(self, now: float) -> float | None:
        """Seconds until the next entry would expire (None: no entries)."""
        if not self.entries:
            return None
        return max(0.0, min(e.last_seen for e in self.entries.values()) + self.refresh_timeout_s - now)
