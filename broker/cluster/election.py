"""The root election of OpenAMQ's cluster model (seed 003, "The Primary Partition" to "Failover
and Recovery"), as pure logic: who votes for whom, and whether a primary is root.

Theory of operation
-------------------
The **primary partition** is a list of defined primary brokers; **secondaries** never vote and
are never root. Each primary runs the election continuously, over what it sees of the other
primaries (:class:`Primary`: its state and **seniority** — the start time of its process, not
persisted, so a restarted broker is the youngest; ties are broken by node id):

* **a vote** (:func:`vote_of`): an active primary votes for the most senior active primary it
  sees, itself included; a primary still starting votes no (``None``); a broken one (gone,
  not connected) abstains — it is simply not in the view;
* **the electorate** is the active primaries, this one included;
* **elected** (:func:`decide`): a primary that is not root becomes root when it is the most
  senior active primary, every other active primary votes for it (unanimous), none is still
  starting (a starting primary counts as a no), and the electorate is **more than** 50 % of the
  defined primaries;
* **resigning**: a root stays root while the electorate is at least 50 % of the defined
  primaries and no active primary votes for another; it resigns when the electorate is
  **strictly less** than 50 % (the seed), or when the other primaries vote for a more senior one
  (a partition healed: two sides must never both keep a root).

Two primaries cannot both be root at once from consistent views: electing needs more than half
of the defined primaries, keeping needs at least half and the votes of everyone it sees. At
exactly half (two defined primaries, one gone) a sitting root stays and none is elected: the
seed's case for manual intervention.

Nothing here touches a socket: the cluster feeds it views and acts on :class:`Decision`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["Primary", "Decision", "seniority", "vote_of", "decide", "STARTING", "ACTIVE"]

STARTING, ACTIVE = "starting", "active"


@dataclass(frozen=True)
class Primary:
    """A primary as one broker sees it (itself included)."""

    node_id: str
    state: str                  # "starting" | "active" (a broken primary is not in the view)
    started_at: float           # its process's start time: the smaller, the more senior
    vote: str | None = None     # the node id it votes for as root; None: no (still starting) or not known yet


@dataclass(frozen=True)
class Decision:
    root: bool
    electorate: int             # active primaries, this one included
    defined: int
    votes: dict                 # node id → the node id it votes for (None: no)
    why: str


def seniority(p: Primary) -> tuple[float, str]:
    """The sort key: the oldest process first, then the smaller node id."""
    return (p.started_at, p.node_id)


def vote_of(me: Primary, others: Iterable[Primary]) -> str | None:
    """Whom ``me`` votes for: the most senior active primary it sees (itself included);
    None while ``me`` is still starting."""
    if me.state != ACTIVE:
        return None
    active = [p for p in others if p.state == ACTIVE] + [me]
    return min(active, key=seniority).node_id


def decide(me: Primary, others: Iterable[Primary], defined: int, *, is_root: bool) -> Decision:
    """Is ``me`` root after this round? ``others``: the other primaries it is connected to (a
    broken one is absent), each with its latest vote; ``defined``: the number of defined
    primaries (``me`` included); ``is_root``: whether ``me`` is root now."""
    others = [p for p in others if p.node_id != me.node_id]
    active = [p for p in others if p.state == ACTIVE]
    starting = [p for p in others if p.state == STARTING]
    votes = {p.node_id: p.vote if p.state == ACTIVE else None for p in others}
    votes[me.node_id] = vote_of(me, others)
    electorate = len(active) + (1 if me.state == ACTIVE else 0)

    def result(root: bool, why: str) -> Decision:
        return Decision(root, electorate, defined, votes, why)

    if me.state != ACTIVE:
        return result(False, "this primary is still starting")
    against = sorted(p.node_id for p in active if p.vote != me.node_id)
    if is_root:
        if 2 * electorate < defined:
            return result(False, f"resigned: the electorate ({electorate} of {defined} defined primaries) is "
                                 "below half")
        rivals = sorted(p.node_id for p in active if p.vote is not None and p.vote != me.node_id)
        if rivals:
            return result(False, f"resigned: {', '.join(rivals)} vote(s) for another root")
        return result(True, f"root: electorate {electorate} of {defined}")
    if votes[me.node_id] != me.node_id:
        return result(False, f"not the most senior active primary (votes for {votes[me.node_id]})")
    if starting:
        return result(False, f"{', '.join(sorted(p.node_id for p in starting))} still starting: a no vote")
    if against:
        return result(False, f"not unanimous: {', '.join(against)} vote(s) otherwise or not yet")
    if 2 * electorate <= defined:
        return result(False, f"the electorate ({electorate} of {defined} defined primaries) is not more than half")
    return result(True, f"elected: unanimous, electorate {electorate} of {defined}")
