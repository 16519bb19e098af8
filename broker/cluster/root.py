"""OpenAMQ's root election over the cluster links: the shell around :mod:`broker.cluster.election`.

Theory of operation
-------------------
A cluster whose ``[cluster]`` names ``primaries`` (the defined primary brokers' connectors) runs
OpenAMQ's model (seed 003, "The Primary Partition" to "Failover and Recovery"; docs/cluster.md
"Primaries, secondaries and the root"). Each node — primary or secondary — tells the nodes that
dial it its part in the election as an ``election`` notification
(:class:`~broker.wire.cluster.ElectionNote`: partition, state, start time, vote, root) in the
snapshot after every (re)connection and whenever one of them changes. A node learns the others'
parts from the notifications on its own bridges, so what it knows of a member is what that
member said on a connection that is up now: a bridge that goes down forgets it (the member is
*broken*: an abstention).

**Starting.** A primary is *starting* until every other defined primary has either been heard
from (its ``election`` notification arrived) or failed a connection attempt, or until
``call-timeout-ms`` has passed; while starting it votes no. So a cluster started together
elects once every primary has heard from every other, and a primary started alone becomes active
as soon as its dials are refused.

**Each round** (:meth:`RootElection.evaluate`, on every change — a bridge up or down, a
notification — and every :data:`TICK_S`): the view is the defined primaries whose bridge is up
and which said they are primaries; :func:`broker.cluster.election.decide` says whom this primary
votes for and whether it is root. A change of vote or of root is logged and told to everyone.
Secondaries never vote and are never root: they run the same loop only to know the root.

**The root as a node knows it**: itself when it is root, else the connected primary that says
it is root (the most senior if, during a change-over, two say so). ``GET /api/v1/cluster`` shows
it with the electorate and the votes; ``/metrics`` has ``lodestone_broker_cluster_root`` and
friends.

**Detection** of a dead member is the bridge's: at once for a process that dies (its socket is
closed by its kernel), after ``connection-ttl-ms`` of silence for a member cut off by the
network. A root cut off from the majority resigns when its own links time out, at most
``connection-ttl-ms`` after the cut. The others notice the cut no earlier than half that (the
idle time-out's heartbeats come every half), and a primary that lost the root *by time-out*
elects no new root for another ``connection-ttl-ms`` (:meth:`RootElection.forget`): so the old
root has resigned before a new one is elected. A root whose socket closed is gone at once
(SIGKILL, a clean stop): no wait.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING

import trio

from broker.cluster.election import ACTIVE, STARTING, Decision, Primary, decide, seniority
from broker.cluster.settings import same_endpoint
from broker.wire.cluster import ElectionNote
from broker.wire.io.trioutil import Wakeup

if TYPE_CHECKING:  # pragma: no cover
    from broker.cluster.bridge import ClusterNode

log = logging.getLogger("lodestone.broker.cluster")

__all__ = ["RootElection", "TICK_S"]

TICK_S = 0.5   # a round at least this often (the view's changes run one at once)


class RootElection:
    """This node's part in the root election (see the module doc)."""

    def __init__(self, cluster: "ClusterNode"):
        self.cluster = cluster
        cfg = cluster.cfg
        self.partition = cfg.partition
        self.primaries: tuple[str, ...] = cfg.primaries
        self.me = cluster.node.node_id
        self.started_ms = cluster.started_ms
        self.startup_s = max(cfg.call_timeout_ms, 1) / 1000.0
        self.ttl_s = cfg.connection_ttl_ms / 1000.0
        self.hold_until = 0.0          # no election before this (monotonic): a root was lost silently
        self.held_for: str | None = None
        self._began = time.monotonic()
        self.heard: dict[str, ElectionNote] = {}   # node id -> its latest note on the bridge that is up
        self.state = STARTING
        self.is_root = False
        self.vote: str | None = None
        self.decision: Decision | None = None
        self.root: str | None = None               # the root as this node knows it
        self.root_since: float | None = None
        self.became_active_at: float | None = None
        self.counters: collections.Counter = collections.Counter()
        self._told: ElectionNote | None = None
        self._wake = Wakeup()
        self._undefined_logged: set[str] = set()

    # -- inputs ---------------------------------------------------------------------------------
    def heard_note(self, via: str, note: ElectionNote) -> None:
        self.heard[via] = note
        self.changed()

    def forget(self, node_id: str, *, silently: bool = False) -> None:
        """The bridge to ``node_id`` went down. A root lost by our idle time-out (not by its
        socket closing) may live on, cut off: no primary here elects itself for
        ``connection-ttl-ms`` after that, by which time the cut-off root has resigned (its own
        links to the majority time out too)."""
        note = self.heard.pop(node_id, None)
        if note is None:
            return
        if note.root and silently and self.ttl_s > 0:
            self.hold_until = max(self.hold_until, time.monotonic() + self.ttl_s)
            self.held_for = node_id
            self.counters["root_lost_silently"] += 1
            log.warning("root election: lost the root %s by time-out; no new root here for connection-ttl-ms",
                        node_id, extra={"fields": {"root": node_id, "hold_s": self.ttl_s}})
        self.changed()

    def changed(self) -> None:
        self._wake.set()

    def is_primary_url(self, url: str) -> bool:
        return any(same_endpoint(url, p) for p in self.primaries)

    def defined(self, node_id: str) -> bool:
        """Is ``node_id`` one of the defined primaries (its connector or our bridge's URL is in
        ``primaries``)?"""
        c = self.cluster
        m = c.members.get(node_id)
        if m is not None and m.connector and self.is_primary_url(m.connector):
            return True
        b = c.by_node.get(node_id)
        return b is not None and self.is_primary_url(b.url)

    # -- the loop -------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            self.evaluate()
            with trio.move_on_after(TICK_S):
                await self._wake.wait()

    def _start_done(self, now: float) -> bool:
        if now - self._began >= self.startup_s:
            return True
        c = self.cluster
        for p in self.primaries:
            if same_endpoint(p, c.connector):
                continue
            b = next((b for b in c.bridges.values() if same_endpoint(b.url, p) and not b.stopped), None)
            if b is None:
                b = next((b for n, b in c.by_node.items()
                          if c.members.get(n) is not None and same_endpoint(c.members[n].connector, p)), None)
            if b is None:
                return False
            if b.failures:
                continue
            if not (b.connected and b.node_id is not None and b.node_id in self.heard):
                return False
        return True

    def _view(self) -> list[Primary]:
        c = self.cluster
        out = []
        for node_id, n in self.heard.items():
            b = c.by_node.get(node_id)
            if b is None or not b.connected or n.partition != "primary":
                continue
            if not self.defined(node_id):
                self.counters["undefined_primary"] += 1
                if node_id not in self._undefined_logged:
                    self._undefined_logged.add(node_id)
                    log.warning("cluster member says it is a primary but its connector is not in primaries; "
                                "it does not vote here", extra={"fields": {
                                    "node_id": node_id, "connector": c.members[node_id].connector
                                    if node_id in c.members else b.url}})
                continue
            out.append(Primary(node_id, n.state, n.started_ms, n.vote))
        return out

    def evaluate(self) -> None:
        """One round (see the module doc)."""
        now = time.monotonic()
        if self.state == STARTING and self._start_done(now):
            self.state = ACTIVE
            self.became_active_at = time.time()
            log.info("root election: this %s is active (heard from or tried every defined primary)", self.partition,
                     extra={"fields": {"after_s": round(now - self._began, 3)}})
        if self.partition == "primary":
            me = Primary(self.me, self.state, self.started_ms)
            d = decide(me, self._view(), len(self.primaries), is_root=self.is_root)
            if d.root and not self.is_root and now < self.hold_until:
                d = Decision(False, d.electorate, d.defined, d.votes,
                             f"would be elected, but the root {self.held_for} was lost by time-out "
                             f"{self.ttl_s - (self.hold_until - now):.1f} s ago: waiting connection-ttl-ms "
                             "for it to resign")
            self.decision = d
            vote = d.votes.get(self.me)
            if vote != self.vote:
                self.vote = vote
                self.counters["votes"] += 1
                log.info("root election: this primary votes for %s", vote or "nobody (no vote)",
                         extra={"fields": {"vote": vote, "electorate": d.electorate, "defined": d.defined}})
            if d.root != self.is_root:
                self.is_root = d.root
                self.counters["elected" if d.root else "resigned"] += 1
                if d.root:
                    log.warning("root election: this primary is now the root (%s)", d.why,
                                extra={"fields": {"votes": d.votes}})
                else:
                    log.warning("root election: this primary is no longer the root (%s)", d.why,
                                extra={"fields": {"votes": d.votes}})
        self._set_root(self._known_root())
        note = self.note()
        if note != self._told:
            self._told = note
            self.cluster._broadcast(note)

    def _known_root(self) -> str | None:
        if self.is_root:
            return self.me
        c = self.cluster
        claims = [Primary(n, m.state, m.started_ms, m.vote) for n, m in self.heard.items()
                  if m.root and m.partition == "primary" and self.defined(n)
                  and (b := c.by_node.get(n)) is not None and b.connected]
        if not claims:
            return None
        return min(claims, key=seniority).node_id

    def _set_root(self, root: str | None) -> None:
        if root == self.root:
            return
        old, self.root = self.root, root
        self.root_since = time.time()
        self.counters["root_changes"] += 1
        if root is None:
            log.warning("cluster has no root now (was %s)", old, extra={"fields": {"was": old}})
        else:
            log.info("cluster root is now %s%s", root, " (this node)" if root == self.me else "",
                     extra={"fields": {"root": root, "was": old}})
        self.cluster.root_changed(old, root)

    # -- outputs --------------------------------------------------------------------------------
    def note(self) -> ElectionNote:
        return ElectionNote(self.me, self.partition, self.state, self.started_ms,
                            self.vote if self.partition == "primary" else None, self.is_root)

    def describe(self) -> dict:
        c = self.cluster
        d = self.decision
        primaries = []
        for p in self.primaries:
            if same_endpoint(p, c.connector):
                primaries.append({"connector": p, "node_id": self.me, "this_node": True, "connected": True,
                                  "state": self.state, "started_ms": self.started_ms, "vote": self.vote,
                                  "root": self.is_root})
                continue
            node_id = next((n for n, m in c.members.items() if m.connector and same_endpoint(m.connector, p)), None)
            if node_id is None:
                node_id = next((b.node_id for b in c.bridges.values() if same_endpoint(b.url, p) and b.node_id), None)
            b = c.by_node.get(node_id) if node_id else None
            up = bool(b is not None and b.connected)
            n = self.heard.get(node_id) if node_id and up else None
            primaries.append({"connector": p, "node_id": node_id, "this_node": False, "connected": up,
                              "state": n.state if n else "broken", "started_ms": n.started_ms if n else None,
                              "vote": n.vote if n else None, "root": bool(n and n.root)})
        secondaries = sorted(({"node_id": n, "connected": True, "state": m.state, "started_ms": m.started_ms}
                              for n, m in self.heard.items() if m.partition == "secondary"
                              and (b := c.by_node.get(n)) is not None and b.connected), key=lambda x: x["node_id"])
        return {"partition": self.partition, "state": self.state, "started_ms": self.started_ms,
                "is_root": self.is_root, "root": self.root, "root_since": self.root_since,
                "vote": self.vote if self.partition == "primary" else None,
                "electorate": d.electorate if d is not None else None, "defined_primaries": len(self.primaries),
                "votes": dict(d.votes) if d is not None else {},
                "why": d.why if d is not None else "a secondary never votes and is never root",
                "primaries": primaries, "secondaries": secondaries, "counters": dict(self.counters)}
