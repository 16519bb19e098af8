"""Pool of targets: readiness fed by probes, quorum gate, pluggable membership (spec §4).

Theory of operation
-------------------
A ``Pool`` is plain state advanced by the shell: the health checker calls ``report_probe`` after
each probe (ready or not, learned node id, live connection count, error text), a membership
source calls ``add_target`` / ``remove_target``. The pool keeps members in pool order (the local
target first when ``local_target_enabled``) and rebuilds an immutable tuple of ready targets on
every change, so the hot path reads one attribute. ``version`` increments on every change and
``listeners`` are called, which is how the shell wakes connections waiting for quorum.

* ``targets()`` — the ready targets if at least ``quorum_size`` are ready, else ``()``
  (Artemis ``AbstractPool.getTargets``; the shell does the waiting, never the core).
* ``ready_target(identity)`` — a cache hit's target if it is ready, **regardless of quorum**
  (Artemis ``getReadyTarget``).
* Every probe result is also passed to the policy's ``observe`` (LEAST_CONNECTIONS counts).

Pairs (HA)
----------
Members whose ``Target.pair`` is the same form one *pair*: a primary and its backups serving one
node id, whichever of them is active (a passive backup's probe says ``active = false``, so it
is not ready). Policies see **one target per group** (a pair, or a target on its own), in the
order of each group's first member, so a pair is hashed, counted and ranked once — placement is
the same as for the pool without its backups:

* the group's target is its *serving* member: the ready one; when several are ready at once
  (split brain) the first non-backup member in pool order, else the first backup — a function of
  which members are ready, so every process of the router picks the same one and the choice
  never alternates while the state holds (``split_brain`` lists such pairs);
* ``ready_target(identity)`` maps the node id, name and slot of every member of a served pair
  to its serving member, so a key cached on the pair's node id follows it across a failover;
* ``failing_over(identity)`` names a pair with no member ready (it is failing over): the router
  lets such a key wait (``router.core.decide``) instead of re-placing it;
* quorum and ``ready_count`` / ``total_count`` count groups, not members;
* ``first_failing_over(now, limit_s)`` names the first group in pool order, when it is a pair
  that lost its last active member less than ``limit_s`` ago (served before; held groups and
  lone targets that are not ready are passed over): a policy that follows pool order
  (FIRST_ELEMENT) lets a new connection wait for it, as a cached key waits for its pair,
  instead of sending it to the next group for the second or so a failover takes.

No automatic failback (``allow_failback = False``)
-------------------------------------------------
For two sites (site 1 mirrors to site 2; docs/site-failover.md) a group that comes back must not
take new clients while the clients that failed over stay where they went. With
``allow_failback = False`` a group (a pair, or a target on its own) that *went down* — a probe or
an upstream connect found no member ready — and *had connections diverted* — while it was down
the router sent at least one connection to another group (``note_routed``) — is **held** when it
comes back: probed as usual, but offered to no policy, no cache hit and no quorum, until an
operator ``readmit``s it. A group that comes back without diversions (a probe blip nobody
connected through) is admitted again: no client went elsewhere, so none is split off. A group
that never went down (its first probe passed) is admitted, whatever else is ready. The rule
never leaves the pool without a target: when no admitted group is ready and every group has
been probed, the first ready held group (pool order) is released — it now serves, and the group
that went down holds in its turn when it returns. ``hold`` holds a ready group by hand (a
planned switchover); it is refused when no other group is ready. ``held`` maps each held group
to why; the prober's process decides and pushes ``held`` to followers (``set_holds``), which
never decide themselves, so every worker holds the same groups; a follower reports its first
diversion from each down group (``on_diverted``), which the prober records (``note_diverted``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

from router.errors import MembershipSourceError

from .membership import host_port
from .policies.base import Target


@dataclass(slots=True)
class TargetState:
    """Mutable health state of one target slot (the pool's own record, not shared outside)."""

    target: Target
    local: bool = False
    ready: bool = False
    connection_count: int | None = None
    last_error: str | None = None
    last_probe_at: float | None = None
    probes: int = 0
    #: no automatic failback: why the pool holds this target's group out (None: not held)
    held: str | None = None
    #: an operator drains this target's group: no new connection goes to it (``Pool.drain``)
    draining: bool = False

    def to_dict(self) -> dict:
        """JSON-friendly view for the management API."""
        t = self.target
        return {"name": t.name, "node_id": t.node_id, "host": t.host, "port": t.port,
                "tls": t.tls, "management_url": t.management_url, "local": self.local,
                "pair": t.pair, "backup": t.backup,
                "ready": self.ready, "held": self.held, "draining": self.draining,
                "connection_count": self.connection_count,
                "last_error": self.last_error, "last_probe_at": self.last_probe_at,
                "probes": self.probes}


class Pool:
    """Targets with readiness and a quorum gate. All methods are synchronous and pure-state."""

    def __init__(self, targets: Iterable[Target] = (), *, quorum_size: int = 1,
                 local_target: Target | None = None, local_target_enabled: bool = False,
                 allow_failback: bool = True) -> None:
        self.quorum_size = quorum_size
        #: the node id of the cluster's root (OpenAMQ's model; a cluster pool's source sets it from
        #: the brokers' view, None: no root known) — where ``root-target-filter`` keys go
        self.root: str | None = None
        #: the latest time a probe result brought (``report_probe``'s ``now``)
        self._now: float | None = None
        #: pairs that have had an active member since the start
        self._served: set[str] = set()
        #: pair → when it lost its last active member (while it has none)
        self._pair_down_at: dict[str, float] = {}
        #: the first group in pool order when it is a pair without an active member, served before
        self._first_pair_down: str | None = None
        #: False: a group that went down and comes back is held until readmitted (docstring)
        self.allow_failback = allow_failback
        #: groups held out of routing → why (``allow_failback = False``, or ``hold``)
        self.held: dict[str, str] = {}
        #: groups that went down since they last served (a probe found no member ready)
        self._went_down: set[str] = set()
        #: a follower (a worker of a multi-worker router) takes ``held`` from its prober
        self.follow_holds = False
        #: groups an operator drains (``drain``): out of routing while another group is ready;
        #: if none is, they serve rather than nothing (``drain_fallback``)
        self.draining: set[str] = set()
        self.drain_fallback = False
        #: groups down right now (no member ready, at least one probed): what ``note_routed``
        #: checks on the hot path (empty almost always)
        self._down_groups: frozenset[str] = frozenset()
        #: down groups that had a connection routed elsewhere meanwhile
        self._diverted: set[str] = set()
        #: a follower: called with a group at its first diversion (the worker tells its prober)
        self.on_diverted: Callable[[str], None] | None = None
        self.local_target_enabled = local_target_enabled
        self.local: TargetState | None = (TargetState(local_target, local=True)
                                          if local_target is not None else None)
        self.members: list[TargetState] = []
        if self.local is not None and local_target_enabled:
            self.members.append(self.local)
        self.version = 0
        #: LEAST_CONNECTIONS: a probe that gives no connection count fails (Artemis's
        #: UPDATE_CONNECTION_COUNT_PROBE throws on a missing ConnectionCount → not ready)
        self.require_connection_count = False
        self.listeners: list[Callable[["Pool"], None]] = []
        self.observers: list[Callable[[Target, int | None], None]] = []
        self._ready: tuple[Target, ...] = ()
        self._by_identity: dict[str, Target] = {}
        #: names (node ids, member names, pair name) of pairs with members but none ready → pair
        self._failing_over: dict[str, str] = {}
        #: pairs with more than one member ready at once → their ready slots, pool order
        self.split_brain: dict[str, tuple[str, ...]] = {}
        self._group_count = 0
        #: groups of more than one member (HA pairs)
        self.pair_count = 0
        for t in targets:
            self.add_target(t, _notify=False)
        self._rebuild()

    # -- membership ---------------------------------------------------------------------------
    def _find(self, slot: str) -> TargetState | None:
        for st in self.members:
            if st.target.slot == slot:
                return st
        if self.local is not None and self.local.target.slot == slot:
            return self.local
        return None

    def add_target(self, target: Target, *, _notify: bool = True) -> bool:
        """Append a target (not ready until a probe says so). A duplicate slot is ignored."""
        if any(st.target.slot == target.slot for st in self.members):
            return False
        self.members.append(TargetState(target))
        if _notify:
            self._changed()
        return True

    def configure(self, *, quorum_size: int, local_target_enabled: bool, allow_failback: bool) -> None:
        """A reloaded configuration's pool settings (targets: :meth:`sync_members`)."""
        self.quorum_size = quorum_size
        self.allow_failback = allow_failback
        if self.local is not None and local_target_enabled != self.local_target_enabled:
            if local_target_enabled:
                self.members.insert(0, self.local)
            else:
                self.members.remove(self.local)
        self.local_target_enabled = local_target_enabled
        self._changed()

    def remove_target(self, slot: str) -> bool:
        """Remove the target with this name (or host:port); False if absent."""
        for i, st in enumerate(self.members):
            if st.target.slot == slot and not st.local:
                del self.members[i]
                self._changed()
                return True
        return False

    def sync_members(self, targets: Iterable[Target]) -> bool:
        """Make the members (the local target aside) exactly ``targets``, in that order: how a
        worker follows its supervisor's dynamic membership. A member whose name, address, TLS
        and management URL are unchanged keeps its state (a changed pair or role is updated in
        place). True if anything changed."""
        def key(t: Target) -> tuple:
            return (t.slot, t.host, t.port, t.tls, t.management_url)

        want = list(targets)
        want_keys = [key(t) for t in want]
        wanted = set(want_keys)
        changed = False
        for st in [st for st in self.members if not st.local and key(st.target) not in wanted]:
            self.members.remove(st)
            changed = True
        have = [st for st in self.members if not st.local]
        i = 0
        while i < len(have) and i < len(want) and key(have[i].target) == want_keys[i]:
            i += 1
        kept = {key(st.target): st for st in have[i:]}
        for st in have[i:]:  # out of order (a target inserted or moved): rebuild the tail in the
            self.members.remove(st)  # wanted order, each member that stays keeping its state
        for t in want[i:]:
            self.members.append(kept.pop(key(t), None) or TargetState(t))
            changed = True
        for st, t in zip([st for st in self.members if not st.local], want):
            if (st.target.pair, st.target.backup) != (t.pair, t.backup):  # a role changed
                st.target = dataclasses.replace(st.target, pair=t.pair, backup=t.backup)
                changed = True
        if changed:
            self._changed()
        return changed

    def update_target(self, target: Target) -> bool:
        """A member's pair or role changed (a backup now listed as the primary): the member in
        ``target.slot`` keeps its state (readiness, learned node id). False if absent."""
        st = self._find(target.slot)
        if st is None or st.local:
            return False
        if (st.target.pair, st.target.backup) == (target.pair, target.backup):
            return False
        st.target = dataclasses.replace(st.target, pair=target.pair, backup=target.backup)
        self._changed()
        return True

    def all_states(self) -> list[TargetState]:
        """Every tracked target: pool members in order, then the local target if not a member."""
        out = list(self.members)
        if self.local is not None and self.local not in out:
            out.append(self.local)
        return out

    # -- probes -------------------------------------------------------------------------------
    def report_probe(self, target_name: str, ok: bool, node_id: str | None = None,
                     connection_count: int | None = None, now: float | None = None,
                     error: str | None = None, *, check_count: bool = True) -> None:
        """Record one probe result for the target slot ``target_name`` (name or host:port).

        A failed probe makes the target not ready at once and keeps ``error`` for the management
        API; a successful one makes it ready, learns ``node_id`` and the connection count.
        """
        st = self._find(target_name)
        if st is None:
            return
        st.probes += 1
        st.last_probe_at = now
        if now is not None:
            self._now = now
        changed = False
        # (a pool member only: Artemis adds the policy's probe to the pool, so a local target
        # outside it — local-target-filter only — does not need a count)
        if ok and connection_count is None and self.require_connection_count and check_count \
                and (not st.local or self.local_target_enabled):
            ok, error = False, "probe gave no connection count (LEAST_CONNECTIONS needs one)"
        if ok:
            if node_id and node_id != st.target.node_id:
                st.target = dataclasses.replace(st.target, node_id=node_id)
                changed = True
            st.connection_count = connection_count
            st.last_error = None
        else:
            st.connection_count = None
            st.last_error = error or "probe failed"
            if node_id and node_id != st.target.node_id and st.target.pair is not None:
                # a passive backup names the node id it will serve: the pair's id is known even
                # while no member is active (a key cached on it waits for the failover)
                st.target = dataclasses.replace(st.target, node_id=node_id)
                changed = True
        if st.ready != ok:
            st.ready = ok
            changed = True
        if not ok:
            self._note_down(st.target.group)
            if st.probes == 1 and not self.allow_failback:
                changed = True  # a first answer: the group is down (and a held one may be alone)
        for obs in self.observers:
            obs(st.target, connection_count if ok else None)
        if changed:
            self._changed()

    def mark_not_ready(self, target_name: str, error: str) -> bool:
        """A connection to the target failed (the proxy's upstream connect): not ready at once,
        until its next probe says otherwise (the shell probes it again at once). Not counted
        as a probe. True if it was ready."""
        st = self._find(target_name)
        if st is None or not st.ready:
            return False
        st.ready = False
        st.last_error = error
        st.connection_count = None
        self._note_down(st.target.group)
        self._changed()
        return True

    def set_ready(self, target_name: str, ready: bool, node_id: str | None = None) -> None:
        """Shortcut for tests and embedders: mark a target ready/not ready."""
        self.report_probe(target_name, ready, node_id=node_id,
                          error=None if ready else "marked not ready", check_count=False)

    # -- no automatic failback ------------------------------------------------------------------
    def _note_down(self, group: str) -> None:
        if self.allow_failback or self.follow_holds:
            return
        if not any(st.ready for st in self.members if st.target.group == group):
            self._went_down.add(group)

    def note_routed(self, target: Target) -> None:
        """A connection was routed to ``target``: every other group that is down now had a
        connection diverted from it (held when it returns, with ``allow_failback = False``)."""
        down = self._down_groups
        if not down or self.allow_failback:
            return
        g = target.group
        for d in down:
            if d != g and d not in self._diverted:
                self._diverted.add(d)
                if self.on_diverted is not None:
                    self.on_diverted(d)

    def note_diverted(self, group: str) -> None:
        """A follower routed a connection elsewhere while ``group`` was down (the prober)."""
        if group in self._went_down:
            self._diverted.add(group)

    def group_of(self, name: str) -> str | None:
        """The group of the member named ``name`` (slot, node id, the group's own name, or the
        member's ``host:port``: a cluster pool's members are named by node id)."""
        for st in self.members:
            t = st.target
            if name in (t.slot, t.group) or (t.node_id is not None and name == t.node_id):
                return t.group
        for st in self.members:
            t = st.target
            if name == host_port(t.host, t.port):
                return t.group
        return None

    def hold(self, name: str, reason: str = "held by an operator") -> str:
        """Hold the group of member ``name`` out of routing (a planned switchover). Returns the
        group; ValueError if there is no such member, or no other group is ready to serve."""
        group = self.group_of(name)
        if group is None:
            raise ValueError(f"no target named {name!r} in the pool")
        if group not in self.held:
            others = [t for t in self._ready if t.group != group]
            if not others:
                raise ValueError(f"{group} cannot be held: no other target of the pool is ready")
            self.held[group] = reason
            self._changed()
        return group

    def readmit(self, name: str) -> tuple[str, bool]:
        """Let the group of member ``name`` take connections again (the operator's failback).
        Returns ``(group, was_held)``; ValueError if there is no such member."""
        group = self.group_of(name)
        if group is None:
            raise ValueError(f"no target named {name!r} in the pool")
        was = self.held.pop(group, None) is not None
        self._went_down.discard(group)
        self._diverted.discard(group)
        if was:
            self._changed()
        return group, was

    def drain(self, name: str) -> str:
        """Take the group of member ``name`` out of routing for new connections (its clients
        are moved off by the shell, ``router.drain``). Returns the group; ValueError if there is
        no such member, or the other ready groups are none or fewer than the quorum. If that
        happens later, the drained groups serve again (``drain_fallback``)."""
        group = self.group_of(name)
        if group is None:
            raise ValueError(f"no target named {name!r} in the pool")
        if group not in self.draining:
            others = {t.group for t in self._ready if t.group != group and t.group not in self.draining}
            if not others:
                raise ValueError(f"{group} cannot be drained: no other target of the pool is ready")
            if len(others) < self.quorum_size:
                raise ValueError(f"{group} cannot be drained: {len(others)} other target(s) ready, below the "
                                 f"quorum of {self.quorum_size}")
            self.draining.add(group)
            self._changed()
        return group

    def undrain(self, name: str) -> tuple[str, bool]:
        """Let the group of member ``name`` take new connections again. Returns ``(group,
        was_draining)``; ValueError if there is no such member."""
        group = self.group_of(name)
        if group is None:
            raise ValueError(f"no target named {name!r} in the pool")
        was = group in self.draining
        if was:
            self.draining.discard(group)
            self._changed()
        return group, was

    def forget_drains(self) -> list[str]:
        """Drop the drains of groups no longer in the pool (a reload removed them); returns them."""
        groups = {st.target.group for st in self.members}
        gone = sorted(g for g in self.draining if g not in groups)
        if gone:
            self.draining -= set(gone)
            self._changed()
        return gone

    def set_draining(self, groups) -> None:
        """A follower takes its prober's drains."""
        groups = set(groups)
        if groups != self.draining:
            self.draining = groups
            self._changed()

    def set_holds(self, held: dict[str, str]) -> None:
        """A follower takes its prober's holds."""
        if held != self.held:
            self.held = dict(held)
            self._changed()

    def _apply_holds(self, groups: dict[str, list[TargetState]]) -> None:
        """``allow_failback = False`` in the prober's process: hold the groups that came back
        while another serves, release one when none serves (class docstring)."""
        for g in [g for g in self.held if g not in groups]:
            del self.held[g]
        self._went_down &= set(groups)
        live = [g for g, sts in groups.items() if any(st.ready for st in sts)]
        serving = [g for g in live if g not in self.held and g not in self._went_down]
        for g in live:
            if g in self._went_down and g not in self.held:
                self._went_down.discard(g)
                diverted = g in self._diverted
                self._diverted.discard(g)
                if serving and diverted:
                    self.held[g] = (f"came back after going down, with connections routed to "
                                    f"{serving[0]} meanwhile (allow-failback = false): readmit "
                                    f"it to fail back")
                else:
                    serving.append(g)  # nobody went elsewhere: nobody is split off
        if not serving and self.held:
            probed = all(any(st.probes or st.last_error for st in sts) for sts in groups.values())
            if probed:
                for g in live:
                    if g in self.held:  # no group serves: the first ready held one does
                        del self.held[g]
                        self._went_down.discard(g)
                        self._diverted.discard(g)
                        break

    # -- reads (hot path) ---------------------------------------------------------------------
    def _changed(self) -> None:
        self._rebuild()
        self.version += 1
        for cb in list(self.listeners):
            cb(self)

    def _groups(self) -> dict[str, list[TargetState]]:
        groups: dict[str, list[TargetState]] = {}
        for st in self.members:
            groups.setdefault(st.target.group, []).append(st)
        return groups

    @staticmethod
    def _serving(live: list[TargetState]) -> TargetState:
        """The member of a pair that connections go to, among its ready ones: the first
        non-backup in pool order, else the first backup (deterministic; see the docstring)."""
        for st in live:
            if not st.target.backup:
                return st
        return live[0]

    def _rebuild(self) -> None:
        groups = self._groups()
        if not self.follow_holds and (self.held or not self.allow_failback):
            self._apply_holds(groups)  # (a hold by hand is released as well, if it must be)
        held = self.held
        draining = self.draining
        for st in self.members:
            st.held = held.get(st.target.group) if held else None
            st.draining = st.target.group in draining if draining else False
        if draining:   # out of routing like a held group, unless nothing else is ready
            held = {**held, **dict.fromkeys(draining, "draining")}
            others = [g for g, sts in groups.items() if g not in held and any(st.ready for st in sts)]
            self.drain_fallback = not others or len(others) < self.quorum_size
            if self.drain_fallback:
                held = self.held
        else:
            self.drain_fallback = False
        if not self.allow_failback:
            self._down_groups = frozenset(
                g for g, sts in groups.items()
                if not any(st.ready for st in sts) and any(st.probes or st.last_error for st in sts))
            if self.follow_holds:
                self._diverted &= self._down_groups  # reported once per time down
        ready: list[Target] = []
        served: list[tuple[str, list[TargetState], Target]] = []
        failing: dict[str, str] = {}
        split: dict[str, tuple[str, ...]] = {}
        for g, sts in groups.items():
            if len(sts) == 1:
                if sts[0].ready and not (held and g in held):
                    ready.append(sts[0].target)
                continue
            live = [st for st in sts if st.ready]
            if held and g in held:
                continue  # held out: neither served nor failing over
            if not live:
                for name in (g, *(n for st in sts for n in (st.target.identity, st.target.slot))):
                    failing.setdefault(name, g)
                continue
            if len(live) > 1:
                split[g] = tuple(st.target.slot for st in live)
            t = self._serving(live).target
            ready.append(t)
            served.append((g, sts, t))
        by_id: dict[str, Target] = {}
        for t in ready:
            by_id.setdefault(t.identity, t)
            by_id.setdefault(t.slot, t)
        for g, sts, t in served:  # every name of a served pair leads to its serving member
            by_id.setdefault(g, t)
            for st in sts:
                by_id.setdefault(st.target.identity, t)
                by_id.setdefault(st.target.slot, t)
        first: str | None = None
        looking = True
        for g, sts in groups.items():        # pool order
            if len(sts) == 1:
                if looking and sts[0].ready and not (held and g in held):
                    looking = False
                continue
            if any(st.ready for st in sts):
                self._served.add(g)
                self._pair_down_at.pop(g, None)
                if not (held and g in held):
                    looking = False
            elif g in self._served:
                if g not in self._pair_down_at and self._now is not None:
                    self._pair_down_at[g] = self._now   # else: the first decision's ``now``
                if looking and not (held and g in held):
                    first, looking = g, False
        self._first_pair_down = first
        self._ready = tuple(ready)
        self._by_identity = by_id
        self._failing_over = {n: g for n, g in failing.items() if n not in by_id}
        self.split_brain = split
        self._group_count = len(groups)
        self.pair_count = sum(1 for sts in groups.values() if len(sts) > 1)

    @property
    def ready_count(self) -> int:
        return len(self._ready)

    @property
    def total_count(self) -> int:
        """Routing identities: a pair counts once."""
        return self._group_count

    @property
    def quorum_met(self) -> bool:
        return len(self._ready) >= self.quorum_size

    def ready_targets(self) -> tuple[Target, ...]:
        """Ready targets in pool order, ignoring the quorum."""
        return self._ready

    def targets(self) -> tuple[Target, ...]:
        """What a policy may choose from: the ready targets, or ``()`` below quorum."""
        ready = self._ready
        return ready if len(ready) >= self.quorum_size else ()

    def ready_target(self, identity: str) -> Target | None:
        """The ready target whose node id (or name) is ``identity``; ignores the quorum."""
        return self._by_identity.get(identity)

    def failing_over(self, identity: str) -> str | None:
        """The pair ``identity`` (a member's node id or name, or the pair's name) belongs to when
        that pair has members but none is ready — it is failing over —, else None."""
        return self._failing_over.get(identity) if self._failing_over else None

    def first_failing_over(self, now: float, limit_s: float) -> str | None:
        """The first group in pool order if it is a pair failing over for less than ``limit_s``
        (see the module docstring), else None."""
        g = self._first_pair_down
        if g is None:
            return None
        since = self._pair_down_at.setdefault(g, now)
        return g if now - since < limit_s else None

    def failing_over_slots(self) -> set[str]:
        """Slots of the members of every pair that is failing over (the shell probes them more
        often until one is ready)."""
        if not self._failing_over:
            return set()
        pairs = set(self._failing_over.values())
        return {st.target.slot for st in self.members if st.target.group in pairs}

    def pairs(self) -> list[dict]:
        """Every pair (a group of more than one member), for the management API: ``{name,
        node_id, members, serving, state, node_ids}``; ``state`` is ``serving``,
        ``failing_over`` (no member ready) or ``split_brain`` (several ready at once;
        ``serving`` is the one connections go to)."""
        out = []
        for g, sts in self._groups().items():
            if len(sts) == 1:
                continue
            live = [st for st in sts if st.ready]
            serving = self._serving(live).target if live else None
            ids = list(dict.fromkeys(st.target.node_id for st in sts if st.target.node_id))
            state = ("failing_over" if not live else
                     "split_brain" if len(live) > 1 else "serving")
            out.append({"name": g, "node_id": serving.node_id if serving else
                        (ids[0] if ids else None),
                        "members": [st.target.slot for st in sts],
                        "backups": [st.target.slot for st in sts if st.target.backup],
                        "serving": serving.slot if serving else None,
                        "active": [st.target.slot for st in live], "state": state,
                        "node_ids": ids})
        return out

    @property
    def local_ready(self) -> bool:
        return self.local is not None and self.local.ready

    def snapshot(self) -> dict:
        """JSON-friendly pool state for the management API."""
        snap = {"quorum_size": self.quorum_size, "quorum_met": self.quorum_met,
                "ready": self.ready_count, "total": self.total_count,
                "targets": [st.to_dict() for st in self.all_states()]}
        if self.root is not None:   # OpenAMQ's model: the cluster's root, as the source last saw it
            snap["root"] = self.root
            for t in snap["targets"]:
                if t["node_id"] == self.root:
                    t["root"] = True
        pairs = self.pairs()
        if pairs:
            snap["pairs"] = pairs
        if not self.allow_failback or self.held:
            snap["allow_failback"] = self.allow_failback
            snap["held"] = dict(self.held)
        if self.draining:
            snap["draining"] = sorted(self.draining)
            snap["drain_fallback"] = self.drain_fallback
        return snap


# -- membership sources ---------------------------------------------------------------------
@dataclass(frozen=True)
class FollowContext:
    """What the shell gives a dynamic source's ``follow``: its period, the pool's management
    credentials, the clock (monotonic seconds), and ``on_change`` to call after it changed the
    pool (the supervisor of a multi-worker router then pushes the membership to its workers)."""

    check_period_ms: int
    username: str | None = None
    password: str | None = None
    clock: Callable[[], float] | None = None
    on_change: Callable[[], None] | None = None


class MembershipSource(Protocol):
    """Feeds a pool's membership, with a lifetime:

    * ``start(pool)`` (sync, at construction) adds the members known up front;
    * ``async follow(pool, context, task_status)`` (dynamic sources: ``dynamic = True``) runs
      in the shell for the router's lifetime, reports ``task_status.started()`` after its first
      attempt, and keeps calling ``add_target``/``remove_target``; it is cancelled at shutdown;
    * ``close()`` releases what the source holds (idempotent).

    Only the process that probes follows (with ``workers > 1`` the supervisor); workers get the
    membership with the probe results (``RouterService.apply_pool_states``).
    """

    dynamic: bool

    def start(self, pool: Pool) -> None: ...

    def close(self) -> None: ...


class StaticSource:
    """The configured target list, in config order."""

    dynamic = False

    def __init__(self, targets: Iterable[Target], options: dict | None = None) -> None:
        self.targets = list(targets)
        if options:
            raise MembershipSourceError(f"static source takes no options (got {sorted(options)})")

    def start(self, pool: Pool) -> None:
        for t in self.targets:
            pool.add_target(t)

    def close(self) -> None:
        pass


MembershipFactory = Callable[[list[Target], dict], MembershipSource]
_SOURCES: dict[str, MembershipFactory] = {"static": StaticSource}


def register_membership_source(name: str, factory: MembershipFactory) -> None:
    """Register a membership source (``factory(targets, options) -> source``)."""
    _SOURCES[name] = factory


def membership_source_names() -> list[str]:
    return list(_SOURCES)


def create_membership_source(name: str, targets: list[Target],
                             options: dict | None = None) -> MembershipSource:
    """Build the named source; unknown names raise MembershipSourceError listing the known ones."""
    factory = _SOURCES.get(name)
    if factory is None:
        raise MembershipSourceError(
            f"membership source {name!r} is not available (known: {', '.join(_SOURCES)})")
    return factory(targets, dict(options or {}))
