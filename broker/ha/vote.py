"""The quorum vote (seed 001 "Quorum voting"; Artemis ``QuorumVoteServerConnect``): may a backup
that lost its primary activate, and may a primary that lost its backup keep serving?

Theory of operation
-------------------
The arithmetic is Artemis's, over ``n``, the number of primaries in the cluster (the lost
primary included): ``n // 2`` votes are needed when ``n <= 2``, ``n // 2 + 1`` above
(:func:`votes_needed`). ``n`` is ``[ha] quorum-size`` when set, else (``-1``, as Artemis) the
largest cluster size this node has seen.

Voters are the cluster's other primaries, asked over their management API with the cluster
credential (``GET /api/v1/cluster``, which the cluster user may read):

* a backup asks "is the primary gone for you too?": a voter votes yes when its view lists the
  primary's node id as not connected (or not at all); a voter that does not answer votes no;
* a primary asks "can you still see me?": yes when the voter answers and lists this node as
  connected.

With ``n = 1`` (a lone pair) no vote is needed: the backup activates as soon as it loses its
primary — on a network partition both may serve. With ``n = 2`` the one other primary decides.
With three or more a majority must agree, so at most one side of a partition serves a node id.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Iterable

import trio

from broker.wire.io.http import get_json_url

log = logging.getLogger("lodestone.broker.ha")

#: the largest cluster view read from a peer (the router's health probes use the same limit)
VIEW_MAX_BYTES = 1 << 20

__all__ = ["votes_needed", "VoteResult", "ask_backup_vote", "ask_primary_vote", "vote_with_retries"]


def votes_needed(n: int) -> int:
    """Artemis's quorum over ``n`` primaries: ``n // 2`` when ``n <= 2``, ``n // 2 + 1`` above."""
    if n < 1:
        return 0
    return n // 2 if n <= 2 else n // 2 + 1


@dataclass(frozen=True)
class VoteResult:
    won: bool
    votes: int
    needed: int
    asked: int
    detail: tuple[str, ...] = ()


async def _view(url: str, credentials: tuple[str, str], timeout_s: float) -> dict | None:
    try:
        with trio.fail_after(timeout_s):
            status, body = await get_json_url(url.rstrip("/") + "/api/v1/cluster", auth=credentials,
                                              timeout_s=timeout_s, max_body_bytes=VIEW_MAX_BYTES)
    except (OSError, trio.TooSlowError, Exception):   # unreachable: no vote
        return None
    if status != 200:
        return None
    try:
        view = json.loads(body)
    except ValueError:
        return None
    return view if isinstance(view, dict) else None


def _sees(view: dict, node_id: str) -> bool:
    for m in view.get("members") or ():   # the node itself, not a backup listed for its node id
        if isinstance(m, dict) and m.get("node_id") == node_id and m.get("role") != "backup":
            return bool(m.get("connected"))
    return False


async def _ask(voters: Iterable[tuple[str, str]], credentials, timeout_s: float, decide) -> tuple[int, int, list]:
    voters = list(voters)
    answers: list = [None] * len(voters)

    async def one(i: int, url: str) -> None:
        answers[i] = await _view(url, credentials, timeout_s)

    async with trio.open_nursery() as n:
        for i, (_node, url) in enumerate(voters):
            n.start_soon(one, i, url)
    yes, detail = 0, []
    for (node, _url), view in zip(voters, answers):
        vote = view is not None and decide(view)
        yes += vote
        detail.append(f"{node[:8]}:{'yes' if vote else ('no' if view is not None else 'no answer')}")
    return yes, len(voters), detail


async def ask_backup_vote(primary_id: str, voters, n: int, credentials, timeout_s: float = 2.0) -> VoteResult:
    """A backup's vote: do enough of the other primaries also see ``primary_id`` gone?"""
    needed = votes_needed(n)
    yes, asked, detail = await _ask(voters, credentials, timeout_s, lambda v: not _sees(v, primary_id))
    return VoteResult(yes >= needed, yes, needed, asked, tuple(detail))


async def ask_primary_vote(self_id: str, voters, n: int, credentials, timeout_s: float = 2.0) -> VoteResult:
    """A primary's vote (``vote-on-replication-failure``): do enough primaries still see us?"""
    # this primary counts as its own vote, as Artemis's live does
    needed = max(0, votes_needed(n) - 1)
    yes, asked, detail = await _ask(voters, credentials, timeout_s, lambda v: _sees(v, self_id))
    return VoteResult(yes >= needed, yes, needed, asked, tuple(detail))


async def vote_with_retries(ask, retries: int, wait_s: float, total_s: float) -> VoteResult:
    """Ask (``await ask()``) until won, at most ``retries`` more times ``wait_s`` apart and
    within ``total_s`` (Artemis's vote-retries, vote-retry-wait, quorum-vote-wait)."""
    deadline = trio.current_time() + total_s
    result = await ask()
    tries = 0
    while not result.won and tries < retries and trio.current_time() + wait_s <= deadline:
        await trio.sleep(wait_s)
        tries += 1
        result = await ask()
    return result
