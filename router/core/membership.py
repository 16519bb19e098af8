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
* a member that left stays out while views keep listing it as not alive (``left``): it joins
  again only when a view shows it alive (it came back). Otherwise the next view, still listing
  the dead node, would make it join again as if first seen, and it would leave and rejoin every
  ``leave_after_s`` for ever. A left member no view has listed for ``leave_after_s`` is
  forgotten (it joins as a new node if it is ever listed again);
* a member whose management URL or TLS changed is **updated** (replaced in the pool: it is
  probed again before it gets connections); a node id listed at a new connector (restarted
  elsewhere, or a backup) is a new member of that node id's pair, and the old address leaves by
  the rule above;
* a member whose role changed keeps its place and state (``MembershipChange.updated``);
* membership changes only when a view was read: if no node answers, the pool keeps what it had.

``candidates(seeds)`` is the order in which the shell asks: the node that answered last, the
other known nodes (by management URL), then the configured seeds, without duplicates.

``source = "discovery"`` has no view to read: the brokers' broadcast groups announce them and the
router's own :class:`broker.wire.discovery.DiscoveryGroup` keeps the entries it hears.
``DiscoveryMembership`` maps each change of that table to a ``MembershipChange`` and remembers
which slots each node id holds. An announced node joins (``announced_target``: named by its node
id, the first connector's address, the announced management URL for probes) with one more
member per HA backup it announces (``announced_targets``: the same ``pair``, ``backup`` set,
named ``<node id>@<host>:<port>``, probed through the backup's management URL), so a discovery
pool forms HA pairs like a cluster pool. An announcement that changed makes the node id's slots
exactly what it names — slots it no longer names leave, new ones join, a moved one leaves and
joins again; a member at an address it already held keeps its slot and state, its role updated
(the backup that took the node id over announces it from the backup's address) — and an entry
not refreshed within the refresh timeout takes all its node id's slots with it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable
from urllib.parse import urlsplit

from broker.wire.discovery import Announcement
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
        return host_port(self.host, self.port)

    def to_target(self, name: str | None = None) -> Target:
        """The pool target (``name``: its slot, default the node id); ``pair`` is the node id,
        so members that share it form a pair."""
        return Target(self.node_id, self.host, self.port, self.tls, self.management_url,
                      name or self.node_id, self.node_id, self.backup)


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (slot names ``<node id>@<host:port>``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
    #: members that left, (node id, connector address) → when a view last listed one (not alive)
    left: dict[tuple[str, str], float] = field(default_factory=dict)

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
                gone = (m.node_id, m.address)
                if gone in self.left:
                    if not m.alive:  # still listed as down: it stays out
                        self.left[gone] = now
                        continue
                    del self.left[gone]  # it came back
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
                self.left[(k.member.node_id, k.member.address)] = now
        for gone, listed in list(self.left.items()):
            if now - listed > self.leave_after_s:
                del self.left[gone]
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
#: how long a pool keeps an HA pair member that no longer serves — the slot of a member whose node
#: id is now served from another address (a backup took it over), while the new member is probed;
#: a router inside a broker also holds a down member with a backup in sync that long (a cluster
#: pool's leave-after-ms default)
PAIR_HOLD_S = 30.0

def announced_target(a: Announcement) -> Target:
    """The target of the announcing node itself: named by its node id (name, node id and
    ``pair``, so its announced backups pair with it), the first connector's host/port/TLS,
    probes through the announced management URL (None if empty). Raises ValueError if the first
    connector has no host:port."""
    host, port, tls = parse_connector(a.connectors[0])
    return Target(a.node_id, host, port, tls, a.management_url.rstrip("/") or None, a.node_id,
                  a.node_id)


def announced_targets(a: Announcement,
                      known: Iterable[Target] = ()) -> tuple[tuple[Target, ...], str | None]:
    """Every target an announcement names, and why part of it cannot be one (None if all can):
    the node's own (:func:`announced_target`), then one per announced backup — the node id's
    pair, ``backup`` set, its own connector, probed through its own management URL (None if it
    announced none).

    Names: a target at an address (host:port) of ``known`` — the node id's targets in the pool
    now — keeps that slot's name, so a member whose role changed (the backup that took the node
    id over now announces it) keeps its place and state. A new address is named by the node id
    for the node itself (unless a kept member holds that name), ``<node id>@<host>:<port>``
    otherwise. An unusable first connector yields no target at all; an unusable backup, or one
    at an address already named in the announcement, is left out (and said)."""
    try:
        own = announced_target(a)
    except ValueError as exc:
        return (), f"{a.node_id}: {exc}"
    members = [own]
    problems: list[str] = []
    seen = {(own.host, own.port)}
    for i, (connector, mgmt, _in_sync) in enumerate(a.backups):
        try:
            host, port, tls = parse_connector(connector)
        except ValueError as exc:
            problems.append(f"{a.node_id} backup {i}: {exc}")
            continue
        if (host, port) in seen:
            problems.append(f"{a.node_id} backup {i}: {host_port(host, port)} is announced twice")
            continue
        seen.add((host, port))
        members.append(Target(a.node_id, host, port, tls, mgmt.rstrip("/") or None, "", a.node_id,
                              True))
    kept = {(t.host, t.port): t.slot for t in known}
    names = {kept[(t.host, t.port)] for t in members if (t.host, t.port) in kept}
    out = []
    for t in members:
        name = kept.get((t.host, t.port))
        if name is None:
            name = (a.node_id if not t.backup and a.node_id not in names
                    else f"{a.node_id}@{host_port(t.host, t.port)}")
            names.add(name)
        out.append(dataclasses.replace(t, name=name))
    return tuple(out), "; ".join(problems) or None


def _diff(old: Iterable[Target], new: Iterable[Target]) -> MembershipChange:
    """``old`` slots → ``new`` ones: a slot gone or moved (address, TLS, probe URL) is removed
    (and added again if it moved), one whose pair or role alone changed is updated, an
    unchanged one is left alone (it keeps its readiness)."""
    before = {t.slot: t for t in old}
    new = tuple(new)
    now = {t.slot for t in new}
    added: list[Target] = []
    removed = [slot for slot in before if slot not in now]
    updated: list[Target] = []
    for t in new:
        o = before.get(t.slot)
        if o is None:
            added.append(t)
        elif o == t:
            continue
        elif dataclasses.replace(o, pair=t.pair, backup=t.backup) == t:
            updated.append(t)
        else:
            removed.append(t.slot)
            added.append(t)
    return MembershipChange(tuple(added), tuple(removed), tuple(updated))


@dataclass
class DiscoveryMembership:
    """The targets a discovery pool holds for each announced node id (pure state): what a
    changed announcement replaces and an expired one removes. ``known``: node id → its targets
    (the node's own first, then its backups), as the last change left them. ``held``: slots
    kept after a takeover (slot → node id, since; see ``observe``), removed by ``expire``."""

    known: dict[str, tuple[Target, ...]] = field(default_factory=dict)
    held: dict[str, tuple[str, float]] = field(default_factory=dict)

    def observe(self, kind: str, a: Announcement, now: float = 0.0) -> tuple[MembershipChange, str | None]:
        """One change of the discovery group's table (``added``, ``changed``, ``removed``: an
        entry not refreshed within the refresh timeout) → the pool change, and why (part of)
        the announcement cannot be a target (None if all of it can). ``removed`` removes every
        slot of the node id; ``added``/``changed`` make its slots exactly what the announcement
        names (:func:`announced_targets`): slots no longer named leave, new ones join (not
        ready: probed before they get connections), moved ones leave and join again, a role
        change keeps its slot (``updated``).

        A takeover — the node id now served from another address (its backup announces it), the
        member that served it no longer named — keeps that member's slot, not ready, for
        :data:`PAIR_HOLD_S` (``expire``): the pair stays a pair, failing over, until the new
        member's probe says active, instead of shrinking to one unready member whose keys would
        be re-placed."""
        old = self.known.get(a.node_id, ())
        held_here = [slot for slot, (node, _since) in self.held.items() if node == a.node_id]
        if kind == "removed":
            self.known.pop(a.node_id, None)
            for slot in held_here:
                del self.held[slot]
            return MembershipChange(removed=tuple(t.slot for t in old) + tuple(held_here)), None
        if kind not in ("added", "changed"):
            raise ValueError(f"unknown discovery change {kind!r}")
        targets, why = announced_targets(a, old)
        if targets:
            self.known[a.node_id] = targets
        else:
            self.known.pop(a.node_id, None)
        change = _diff(old, targets)
        names = {t.slot for t in targets}
        removed = list(change.removed)
        for slot in held_here:
            if slot in names:   # named again (its _diff add follows this removal): no longer held
                del self.held[slot]
                removed.append(slot)
        serving = {(t.host, t.port) for t in targets if not t.backup}
        for t in old:
            if (serving and not t.backup and t.slot not in names and (t.host, t.port) not in serving
                    and t.slot in removed):
                removed.remove(t.slot)
                self.held[t.slot] = (a.node_id, now)
        return MembershipChange(change.added, tuple(dict.fromkeys(removed)), change.updated), why

    def expire(self, now: float) -> MembershipChange:
        """The held slots whose time is up leave."""
        gone = tuple(slot for slot, (_node, since) in self.held.items() if now - since >= PAIR_HOLD_S)
        for slot in gone:
            del self.held[slot]
        return MembershipChange(removed=gone)

    def slots(self) -> dict[str, list[str]]:
        """Node id → the slots it holds in the pool (held ones last)."""
        out = {node_id: [t.slot for t in ts] for node_id, ts in self.known.items()}
        for slot, (node_id, _since) in self.held.items():
            out.setdefault(node_id, []).append(slot)
        return out


def discovery_change(kind: str, a: Announcement,
                     known: Iterable[Target] = ()) -> tuple[MembershipChange, str | None]:
    """:meth:`DiscoveryMembership.observe` for a node id whose targets in the pool are
    ``known`` (none: it has no slot yet)."""
    known = tuple(known)
    return DiscoveryMembership({a.node_id: known} if known else {}).observe(kind, a)
