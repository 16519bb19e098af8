"""The root election's rules (broker.cluster.election), each as a row: what a primary sees, and
whether it is root after the round. The rules are seed 003's ("Election Process", "Failover and
Recovery"); the answers were worked out by hand from them."""

from __future__ import annotations

import pytest

from broker.cluster.election import ACTIVE, STARTING, Primary, decide, vote_of


def P(node: str, started: float, state: str = ACTIVE, vote: str | None = "auto") -> Primary:
    return Primary(node, state, started, vote)


def view(me: Primary, others: list[Primary]) -> list[Primary]:
    """Fill each other's vote as it would cast it, seeing ``me`` and the rest."""
    everyone = [me] + others
    out = []
    for p in others:
        if p.vote == "auto":
            p = Primary(p.node_id, p.state, p.started_at, vote_of(p, [q for q in everyone if q is not p]))
        out.append(p)
    return out


A, B, C, D, E = "a", "b", "c", "d", "e"


@pytest.mark.parametrize("case,me,others,defined,is_root,expect,why", [
    # -- electing ---------------------------------------------------------------------------
    ("three start, the oldest is elected", P(A, 1), [P(B, 2), P(C, 3)], 3, False, True, "elected"),
    ("a younger one is not", P(B, 2), [P(A, 1), P(C, 3)], 3, False, False, "most senior"),
    ("a tie in start time goes to the smaller node id", P(A, 5), [P(B, 5), P(C, 5)], 3, False, True, "elected"),
    ("the tie's loser", P(B, 5), [P(A, 5), P(C, 5)], 3, False, False, "most senior"),
    ("one still starting is a no: nobody is elected", P(A, 1), [P(B, 2), P(C, 3, STARTING)], 3, False, False,
     "still starting"),
    ("a primary still starting is never root", P(A, 1, STARTING), [P(B, 2), P(C, 3)], 3, False, False, "starting"),
    ("a broken one abstains: 2 of 3 is a quorum", P(A, 1), [P(B, 2)], 3, False, True, "electorate 2 of 3"),
    ("alone of 3 is no quorum", P(A, 1), [], 3, False, False, "not more than half"),
    ("2 of 4 is not more than half", P(A, 1), [P(B, 2)], 4, False, False, "not more than half"),
    ("3 of 5 is", P(A, 1), [P(B, 2), P(C, 3)], 5, False, True, "elected"),
    ("a vote not yet known is not unanimous", P(A, 1), [P(B, 2, vote=None), P(C, 3)], 3, False, False,
     "not unanimous"),
    ("one voting for someone it alone sees is not unanimous", P(A, 2), [P(B, 3, vote=E), P(C, 4)], 3, False, False,
     "not unanimous"),
    ("a single defined primary elects itself", P(A, 1), [], 1, False, True, "elected"),
    ("two defined, both up: the older", P(A, 1), [P(B, 2)], 2, False, True, "elected"),
    ("two defined, one gone: 50 % elects nobody (manual intervention)", P(B, 2), [], 2, False, False,
     "not more than half"),
    # -- keeping and resigning --------------------------------------------------------------
    ("a root that lost one of three stays", P(A, 1), [P(B, 2)], 3, True, True, "root"),
    ("a root alone of three resigns (33 % < 50 %)", P(A, 1), [], 3, True, False, "below half"),
    ("a root at exactly 50 % stays", P(A, 1), [], 2, True, True, "root"),
    ("a root at exactly 50 % of four stays", P(A, 1), [P(B, 2)], 4, True, True, "root"),
    ("a root below 50 % of four resigns", P(A, 1), [], 4, True, False, "below half"),
    ("a restarted old root (now the youngest, starting) does not unseat the root", P(B, 2),
     [P(A, 9, STARTING), P(C, 3)], 3, True, True, "root"),
    ("the restarted old root, active again, votes for the sitting root", P(B, 2), [P(A, 9), P(C, 3)], 3, True, True,
     "root"),
    ("...and is not elected itself", P(A, 9), [P(B, 2), P(C, 3)], 3, False, False, "most senior"),
    ("a healed partition: the others vote for a more senior primary, the root resigns", P(C, 3),
     [P(A, 1), P(B, 2)], 3, True, False, "another root"),
])
def test_the_election(case, me, others, defined, is_root, expect, why):
    d = decide(me, view(me, others), defined, is_root=is_root)
    assert d.root is expect, (case, d)
    assert why in d.why, (case, d.why)


def test_the_votes_and_the_electorate_are_reported():
    me = P(A, 1)
    d = decide(me, view(me, [P(B, 2), P(C, 3, STARTING)]), 5, is_root=False)
    assert d.electorate == 2 and d.defined == 5
    assert d.votes == {A: A, B: A, C: None}


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_one_root_at_a_time_across_every_split(n):
    """Split ``n`` primaries into two sides every way (each side sees only itself, every member
    active, the sitting root on either side or none): at most one side has a root after a round."""
    import itertools

    nodes = [P(name, i) for i, name in enumerate("abcde"[:n])]
    for k in range(0, n + 1):
        for side in itertools.combinations(nodes, k):
            other = [p for p in nodes if p not in side]
            for root_holder in [None, *nodes]:
                roots = 0
                for group in (list(side), other):
                    for me in group:
                        rest = view(me, [p for p in group if p is not me])
                        d = decide(me, rest, n, is_root=me is root_holder)
                        roots += d.root
                assert roots <= 1, (side, root_holder)
