"""Cluster membership for ``source = "cluster"`` pools: the broker cluster's view → pool targets.

Theory of operation
-------------------
A broker with a ``[cluster]`` table answers ``GET /api/v1/cluster`` with itself (``node_id``,
``connector``) and the *other* nodes it knows (``members: [{node_id, connector, management_url,
connected}]``). ``parse_cluster_view`` turns one answer into ``ViewMember``s: the answering node
(its management URL is the URL that was asked, and it is alive: it answered) and each member
(alive iff its bridge is ``connected``). A connector ``amqp://host:port`` (``amqps://`` = TLS)
gives the target's host and port; the target's name is the node id.

**HA pairs.** A primary and its backups serve one node id, each at its own address. The view
lists a backup as a member with ``"role": "backup"`` and its own ``connector`` and
``management_url`` (the answering node may itself say ``"role": "backup"``); within one view a
node id appears once without that role and any number of times as a backup, at other
connectors (anything else is skipped). The membership keys a node by **node id and connector
address**, so members with one node id form a *pair* in the pool (``Target.pair`` = the node
id) instead of replacing each other: the router hashes the node id once and sends its
connections to whichever member is active (``router.core.pool``). The first member known for a
node id is named by the node id, the others ``<node id>@<host>:<port>``. A member's role may
change (a backup listed later as the primary) without it leaving the pool.

``ClusterMembership`` is the plain state the shell advances with every view it reads
(``observe(view, now)`` → ``MembershipChange``):

* a node seen in a view for the first time **joins** (alive or not: health probes gate it);
* a node's *last alive* time is the last view that showed it alive (it answered, or a node had a
  connected bridge to it); a node seen by no view as alive for ``leave_after_s`` **leaves** —
  listed with ``connected = false``, or no longer listed at all. A broker's view keeps a killed
  member listed (disconnected) for ever, so "left the cluster" has to be a time-out; until then
  the health probe already keeps it out of new connections;
* a member whose management URL or TLS changed is **updated** (replaced in the pool: it is
  probed again before it gets connections); a node id listed at a new connector (restarted
  elsewhere, or a backup) is a new member of that node id's pair, and the old address leaves by
  the rule above;
* a member whose role changed keeps its place and state (``MembershipChange.updated``);
* membership changes only when a view was read: if no node answers, the pool keeps what it had.

``candidates(seeds)`` is the order in which the shell asks: the node that answered last, the
other known nodes (by management URL), then the configured seeds, without duplicates.

``source = "discovery"`` has no view to read: the brokers' broadcast groups announce them and the
router's own :class:`broker.cluster.discovery.DiscoveryGroup` keeps the entries it hears.
``discovery_change`` maps each change of that table to a ``MembershipChange``: an announced node
joins (``announced_target``: named by its node id, the first connector's address, the announced
management URL for probes), one whose announcement changed is replaced, and one whose entry was
not refreshed within the refresh timeout leaves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable
from urllib.parse import urlsplit

from broker.cluster.discovery import Announcement
from router.core.policies.base import Target
from router.errors import ClusterViewError

AMQP_SCHEMES = {"amqp": False, "tcp": False, "amqps": True, "ssl": True}


@dataclass(frozen=True, slots=True)
class ViewMember:
    """One node of a cluster view."""

    node_id: str
    host: str
    port: int
    tls: bool
    management_url: str | None
    alive: bool
    backup: bool = False

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def to_target(self, name: str | None = None) -> Target:
        """The pool target (``name``: its slot, default the node id); ``pair`` is the node id,
        so members that share it form a pair."""
        return Target(self.node_id, self.host, self.port, self.tls, self.management_url,
                      name or self.node_id, self.node_id, self.backup)


def parse_connector(url: str) -> tuple[str, int, bool]:
    """``amqp[s]://host:port`` → (host, port, tls). Raises ValueError."""
    if not isinstance(url, str):
        raise ValueError(f"connector {url!r} is not a string")
    parts = urlsplit(url)
    if parts.scheme not in AMQP_SCHEMES:
        raise ValueError(f"connector {url!r}: scheme must be amqp:// or amqps://")
    host, port = parts.hostname, parts.port
    if not host or not port:
        raise ValueError(f"connector {url!r} has no host:port")
    return host, port, AMQP_SCHEMES[parts.scheme]


def parse_cluster_view(body: Any, answered_url: str) -> list[ViewMember]:
    """One ``GET /api/v1/cluster`` body from ``answered_url`` → the nodes it names, the answering
    node first. Raises ClusterViewError if the body is not a cluster view; a member with a
    bad entry is skipped (the others still count)."""
    if not isinstance(body, dict):
        raise ClusterViewError("cluster view is not a JSON object")
    node_id = body.get("node_id")
    if not isinstance(node_id, str) or not node_id:
        raise ClusterViewError("cluster view has no node_id")
    try:
        host, port, tls = parse_connector(body.get("connector"))
    except ValueError as exc:
        raise ClusterViewError(f"cluster view of {node_id}: {exc}") from None
    me = ViewMember(node_id, host, port, tls, answered_url.rstrip("/"), True,
                    body.get("role") == "backup")
    out = [me]
    members = body.get("members")
    if not isinstance(members, list):
        raise ClusterViewError(f"cluster view of {node_id} has no members list")
    primaries = set() if me.backup else {node_id}   # node ids listed without the backup role
    addresses = {(node_id, me.address)}             # a member is a node id at a connector
    for m in members:
        if not isinstance(m, dict):
            continue
        mid = m.get("node_id")
        if not isinstance(mid, str) or not mid:
            continue
        backup = m.get("role") == "backup"
        if not backup and mid in primaries:
            continue
        try:
            host, port, tls = parse_connector(m.get("connector"))
        except ValueError:
            continue
        mgmt = m.get("management_url")
        mgmt = mgmt.rstrip("/") if isinstance(mgmt, str) and mgmt else None
        vm = ViewMember(mid, host, port, tls, mgmt, m.get("connected") is True, backup)
        if (mid, vm.address) in addresses:
            continue
        addresses.add((mid, vm.address))
        if not backup:
            primaries.add(mid)
        out.append(vm)
    return out


@dataclass(frozen=True, slots=True)
class MembershipChange:
    """What one view changed: targets to add, slots to remove (an update of where a member is
    or how it is probed is both), targets whose role changed (``updated``: same slot, address
    and probe URL; the pool keeps their state)."""

    added: tuple[Target, ...] = ()
    removed: tuple[str, ...] = ()
    updated: tuple[Target, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.updated)


@dataclass(slots=True)
class _Known:
    member: ViewMember
    last_alive: float
    name: str


@dataclass
class ClusterMembership:
    """The nodes a cluster pool holds, advanced by the views the shell reads (pure state).
    ``known`` maps each member's pool name (slot) to it; a member is a node id at a connector
    address."""

    leave_after_s: float
    known: dict[str, _Known] = field(default_factory=dict)
    answered_by: str | None = None  # management URL of the node that answered last

    def _find(self, m: ViewMember) -> _Known | None:
        for k in self.known.values():
            if k.member.node_id == m.node_id and k.member.address == m.address:
                return k
        return None

    def _name(self, m: ViewMember) -> str:
        """The node id for the first member of a node id, ``<node id>@<host>:<port>`` after."""
        if m.node_id not in self.known:
            return m.node_id
        return f"{m.node_id}@{m.address}"

    def observe(self, view: Iterable[ViewMember], now: float) -> MembershipChange:
        added: list[Target] = []
        removed: list[str] = []
        updated: list[Target] = []
        for m in view:
            k = self._find(m)
            if k is None:
                name = self._name(m)
                self.known[name] = _Known(m, now, name)
                added.append(m.to_target(name))
                continue
            old = k.member
            if m.alive:
                k.last_alive = now
            if not (m.alive or not old.alive):
                continue  # a stale view of a member known alive changes nothing about it
            if m.management_url is None:
                m = ViewMember(m.node_id, m.host, m.port, m.tls, old.management_url, m.alive,
                               m.backup)
            # how it is probed: trust what an alive view says (the node itself, or a bridge)
            if m.tls != old.tls or m.management_url != old.management_url:
                k.member = m
                removed.append(k.name)
                added.append(m.to_target(k.name))
            elif m.backup != old.backup:
                k.member = m
                updated.append(m.to_target(k.name))
        for name, k in list(self.known.items()):
            if now - k.last_alive > self.leave_after_s:
                del self.known[name]
                removed.append(name)
        names = set(self.known)
        added = [t for t in added if t.name in names]
        updated = [t for t in updated if t.name in names and t not in added]
        return MembershipChange(tuple(added), tuple(dict.fromkeys(removed)), tuple(updated))

    def answered(self, url: str) -> None:
        self.answered_by = url.rstrip("/")

    def candidates(self, seeds: Iterable[str]) -> list[str]:
        """Management URLs to ask, in order: last answering node, other known nodes, seeds."""
        urls: list[str] = []
        if self.answered_by:
            urls.append(self.answered_by)
        urls += [k.member.management_url for k in self.known.values() if k.member.management_url]
        urls += [s.rstrip("/") for s in seeds]
        return list(dict.fromkeys(urls))

    def targets(self) -> list[Target]:
        return [k.member.to_target(k.name) for k in self.known.values()]


# -- source = "discovery": what a discovery group heard → pool targets ------------------------
def announced_target(a: Announcement) -> Target:
    """The target a broker's announcement names: the node id (name and node id), the first
    connector's host/port/TLS, probes through the announced management URL (None if empty).
    Raises ValueError if the first connector has no host:port."""
    host, port, tls = parse_connector(a.connectors[0])
    return Target(a.node_id, host, port, tls, a.management_url.rstrip("/") or None, a.node_id)


def discovery_change(kind: str, a: Announcement) -> tuple[MembershipChange, str | None]:
    """One change of a discovery group's table (``added``, ``changed``, ``removed``: an entry
    not refreshed within the refresh timeout) → the pool change, and why the announced node
    cannot be a target (None if it can). An entry that changed leaves and joins again (probed
    again before it gets connections); one whose connector is unusable does not join."""
    if kind == "removed":
        return MembershipChange(removed=(a.node_id,)), None
    if kind not in ("added", "changed"):
        raise ValueError(f"unknown discovery change {kind!r}")
    removed = (a.node_id,) if kind == "changed" else ()
    try:
        target = announced_target(a)
    except ValueError as exc:
        return MembershipChange(removed=removed), f"{a.node_id}: {exc}"
    return MembershipChange((target,), removed), None
