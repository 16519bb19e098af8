"""``source = "discovery"``: a pool whose members are the brokers heard on a UDP discovery group
(the shell).

Theory of operation
-------------------
Lodestone brokers with a broadcast group (``[broadcast-groups.*]``, ``docs/cluster.md``
"Discovery") announce their node id, cluster name, management URL and connectors over UDP
multicast. The router listens on the same group address with its own
:class:`broker.wire.discovery.DiscoveryGroup` (own node id None: every node is another one)
and the broker's listener :func:`broker.wire.io.udp.listen`; both are imported, not copied.
Each change of the group's table becomes a pool change (``router.core.membership
.DiscoveryMembership``, which remembers the slots each node id holds): a node heard for the
first time joins (not ready: the health probe, through the announced management URL, and the
quorum gate it exactly as a static target), and with it each HA backup it announces, as a
backup member of its pair (``docs/router.md`` "HA pairs"); a node whose announcement changed
gets exactly the slots it now names (a member whose address is unchanged keeps its slot and
state, its role updated); a node whose entry was not refreshed within ``refresh-timeout-ms``
leaves with all its slots. With ``cluster`` only that cluster's announcements count; with
``key`` only packets signed with that cluster key.

``follow`` reports started once a first member was heard or ``initial-wait-timeout-ms`` passed
(logged), so a router started next to live brokers knows them before it listens. If the group
cannot be joined (no multicast route, a bind address not this host's) the error is kept
(``status()``) and the listener is tried again every check-period; the pool keeps what it had.

Only the process that probes follows (``workers > 1``: the supervisor, which pushes the
membership to its workers), so one socket listens whatever the number of workers.
"""

from __future__ import annotations

import ipaddress
import logging
import time
from typing import Any

import trio

from broker.wire.discovery import DiscoveryGroup
from broker.wire.io.udp import listen
from router.core.membership import DiscoveryMembership
from router.core.policies.base import Target
from router.core.pool import FollowContext, Pool, register_membership_source
from router.errors import MembershipSourceError

log = logging.getLogger("lodestone.router.discovery")

DEFAULTS: dict[str, Any] = {"local-bind-address": "0.0.0.0", "refresh-timeout-ms": 10_000,
                            "initial-wait-timeout-ms": 10_000, "cluster": None, "key": None}
OPTIONS = ("group-address", "group-port", *DEFAULTS)


def check_options(raw: dict[str, Any]) -> dict[str, Any]:
    """Validate a discovery pool's options (the keys of a broker's ``[discovery-groups.*]`` plus
    ``cluster`` and ``key``) → the complete, typed options. Raises ``MembershipSourceError`` with
    ``.key`` naming the offending option. Integers may come as strings (the broker.xml import)."""

    def bad(key: str, msg: str) -> MembershipSourceError:
        exc = MembershipSourceError(f"discovery-group.{key}: {msg}")
        exc.key, exc.detail = key, msg
        return exc

    unknown = sorted(set(raw) - set(OPTIONS))
    if unknown:
        raise bad(unknown[0], "unknown option (known: " + ", ".join(OPTIONS) + ")")
    out = {**DEFAULTS, **raw}
    for key in ("group-address", "group-port"):
        if out.get(key) in (None, ""):
            raise bad(key, "missing")

    def ipv4(key: str) -> ipaddress.IPv4Address:
        try:
            return ipaddress.IPv4Address(out[key])
        except ValueError:
            raise bad(key, f"{out[key]!r} is not an IPv4 address") from None

    if not ipv4("group-address").is_multicast:
        raise bad("group-address", f"{out['group-address']!r} is not a multicast address (224.0.0.0/4)")
    ipv4("local-bind-address")
    for key, lo, hi in (("group-port", 1, 65535), ("refresh-timeout-ms", 1, None),
                        ("initial-wait-timeout-ms", 0, None)):
        v = out[key]
        try:
            if isinstance(v, bool):
                raise ValueError
            v = int(v)
        except (TypeError, ValueError):
            raise bad(key, f"{out[key]!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise bad(key, f"{v} must be {'> 0' if lo == 1 else '>= 0'}" + (f" and <= {hi}" if hi else ""))
        out[key] = v
    for key in ("cluster", "key"):
        if out[key] is not None and (not isinstance(out[key], str) or not out[key]):
            raise bad(key, f"{out[key]!r} must be a non-empty string")
    return out


class DiscoverySource:
    """Membership heard on a UDP discovery group (brokers' broadcast groups)."""

    dynamic = True

    def __init__(self, targets: list[Target], options: dict[str, Any]) -> None:
        if targets:
            raise MembershipSourceError("a discovery pool takes no targets (the brokers announce "
                                        "themselves)")
        self.options = check_options(options)
        o = self.options
        self.group = DiscoveryGroup(None, o["refresh-timeout-ms"] / 1000.0, cluster=o["cluster"],
                                    key=o["key"])
        self.membership = DiscoveryMembership()  # node id → its slots in the pool
        self.last_error: str | None = None      # joining the group failed
        self.unusable: dict[str, str] = {}      # node id → what of its announcement is no target
        self.joined = 0
        self.left = 0
        self._heard = trio.Event()               # a first member, or a first failure

    def start(self, pool: Pool) -> None:
        """Nothing is known before a broker is heard."""

    def close(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        o = self.options
        return {"source": "discovery", "group_address": o["group-address"],
                "group_port": o["group-port"], "local_bind_address": o["local-bind-address"],
                "refresh_timeout_ms": o["refresh-timeout-ms"], "cluster": o["cluster"],
                "signed_only": o["key"] is not None,
                "members": sorted(self.group.entries), "unusable": dict(self.unusable),
                "backups": {node_id: [{"connector": c, "management_url": m or None, "in_sync": s}
                                      for c, m, s in e.announcement.backups]
                            for node_id, e in sorted(self.group.entries.items())
                            if e.announcement.backups},
                "slots": self.membership.slots(),
                "joined": self.joined, "left": self.left, "last_error": self.last_error,
                "counters": dict(self.group.counters)}

    def apply(self, pool: Pool, kind: str, entry) -> bool:
        """One change of the group's table → the pool. True if the pool changed."""
        a = entry.announcement
        held_before = set(self.membership.held)
        change, why = self.membership.observe(kind, a, time.monotonic())
        changed = False
        for slot in set(self.membership.held) - held_before:
            # its node id is announced from another address now: it does not serve it (a probe
            # that says otherwise makes it ready again: split brain, docs/router.md "HA pairs")
            changed |= pool.mark_not_ready(slot, "its node id is now served from another address")
        if why is not None:
            if self.unusable.get(a.node_id) != why:
                log.warning("discovery pool: left out of the pool from %s's announcement: %s",
                            a.node_id, why)
            self.unusable[a.node_id] = why
        else:
            self.unusable.pop(a.node_id, None)
        if kind == "removed":
            self.unusable.pop(a.node_id, None)
        for slot in change.removed:  # first: a moved slot is added again under its name
            if pool.remove_target(slot):
                changed = True
                if kind == "removed":
                    self.left += 1
                    log.info("discovery pool: %s left (not heard for %d ms)", slot,
                             self.options["refresh-timeout-ms"])
                else:
                    log.info("discovery pool: %s left (no longer announced where it was)", slot)
        for t in change.added:
            if pool.add_target(t):
                changed = True
                self.joined += 1
                log.info("discovery pool: %s joined (amqp %s:%d, management %s%s)", t.name,
                         t.host, t.port, t.management_url,
                         f"; backup of node {t.node_id}" if t.backup else "")
        for t in change.updated:
            if pool.update_target(t):
                changed = True
                role = f"a backup of node {t.node_id}" if t.backup else f"node {t.node_id} itself"
                log.info("discovery pool: %s is now announced as %s", t.name, role)
        return changed

    async def follow(self, pool: Pool, ctx: FollowContext,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; started after the first member or the initial wait."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._listen, pool, ctx)
            nursery.start_soon(self._expire_held, pool, ctx)
            with trio.move_on_after(self.options["initial-wait-timeout-ms"] / 1000.0):
                await self._heard.wait()
            if not self.group.entries and self.last_error is None:
                log.warning("discovery pool: no broker heard on %s:%d within %d ms (still "
                            "listening)", self.options["group-address"],
                            self.options["group-port"], self.options["initial-wait-timeout-ms"])
            task_status.started()

    async def _expire_held(self, pool: Pool, ctx: FollowContext) -> None:
        """Every check-period: slots held after a takeover whose time is up leave the pool."""
        while True:
            await trio.sleep(max(ctx.check_period_ms, 100) / 1000.0)
            change = self.membership.expire(time.monotonic())
            changed = False
            for slot in change.removed:
                if pool.remove_target(slot):
                    changed = True
                    log.info("discovery pool: %s left (its node id is served elsewhere)", slot)
            if changed and ctx.on_change is not None:
                ctx.on_change()

    def _listening(self, _sockname) -> None:
        if self.last_error is not None:
            log.warning("discovery pool: listening on %s:%d again", self.options["group-address"],
                        self.options["group-port"])
        self.last_error = None

    async def _listen(self, pool: Pool, ctx: FollowContext) -> None:
        o = self.options

        def on_change(kind: str, entry) -> None:
            if self.apply(pool, kind, entry) and ctx.on_change is not None:
                ctx.on_change()
            if self.group.entries:
                self._heard.set()

        while True:
            try:
                await listen(o["group-address"], o["group-port"], self.group, on_change,
                             bind_address=o["local-bind-address"],
                             task_status=_Listening(self._listening))
            except OSError as exc:
                if self.last_error is None:
                    log.error("discovery pool: cannot listen on %s:%d (bind %s): %s; retrying every "
                              "check-period", o["group-address"], o["group-port"],
                              o["local-bind-address"], exc)
                self.last_error = str(exc) or type(exc).__name__
                self._heard.set()
                await trio.sleep(ctx.check_period_ms / 1000.0)


class _Listening:
    """The ``task_status`` given to ``listen``: its socket joined the group (no nursery, so an
    OSError reaches ``_listen`` as itself)."""

    def __init__(self, callback) -> None:
        self.started = callback


register_membership_source("discovery", DiscoverySource)
