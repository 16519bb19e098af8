"""Where each key should live: a balanced assignment of keys to brokers with few cross-broker bytes.

Theory of operation
-------------------
This module is the job's pure core: plain Python over small tables the Spark job collected
(one row per key and address), no Spark, no clock, no I/O.

**Cost model** (docs/gravity.md, "Cross-broker bytes"). The local deployment's cluster balances
messages ``ON_DEMAND``: a message produced on broker *n* for an anycast address goes round-robin
to the brokers whose queue of that address has a consumer (docs/cluster.md). For an address *a*
under an assignment, let ``P[a][n]`` be the bytes produced on *n* by the keys placed there and
``S(a)`` the brokers with a consuming key, ``C[a][n]`` the bytes those keys consume there. Round-
robin forwards, and each consuming broker receives ``R = sum_n P[a][n] / |S(a)|``; where its
consumers take less than that, the rest follows the consumers that take more by redistribution
(as far as they take it: a backlog nobody asks for stays). The bytes that cross are::

    fwd(a)   = sum_n P[a][n] * (1 - [n in S(a)] / |S(a)|)
    redist(a) = min(sum_{n in S} max(0, R - C[a][n]), sum_{n in S} max(0, C[a][n] - R))
    cross(a) = fwd(a) + redist(a)                                (0 when S(a) is empty)

and ``cross = sum_a cross(a)``. It is 0 when every key of an address is on one broker; with
consumers that take what reaches them (``C = R``) it is the forwarded part alone.

**Balance.** ``skew(load) = max_n load[n] / mean_n load[n] - 1`` for connections and for bytes
(produce + consume). The totals do not depend on the assignment, so ``skew <= s`` is a capacity
per broker: ``cap = (1 + s) * total / B``. The *violation* of an assignment is the sum over
brokers of the overshoot above each capacity, relative to the capacity; 0 means within bound.

**Heuristic.** Exact balanced partitioning is NP-hard; we search in three steps and keep the best
(violation first, then cross bytes, then fewest keys moved):

1. *Groups first.* Keys that share an address (transitively) form a group — an application.
   Groups are placed whole, largest first, on a broker where they fit, preferring the broker
   that already holds most of the group's bytes; a group that fits nowhere is split key by key,
   each key going where it adds the fewest cross bytes among brokers with room.
2. *Local search* (Kernighan–Lin / Fiduccia–Mattheyses style): move single keys; where the
   bound blocks a move that would cut cross bytes, swap the key with a key or a whole group of
   similar size on the other broker; move whole groups and swap groups; as long as the violation
   or, at the same violation, the cross bytes go down.
3. *Several starts:* groups ordered by bytes, by connections, the current placement and, for
   small inputs (at most ``RESTART_KEYS`` keys), ``RESTARTS`` seeded random placements; each
   goes through step 2.

``exhaustive`` tries every assignment (B^K), for tests on small inputs.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

__all__ = ["KeyLoad", "Placement", "recommend", "exhaustive", "evaluate", "skew", "address_cross"]

EPS = 1e-9
RESTART_KEYS = 200   # inputs this small also get random starts
RESTARTS = 32


@dataclass(frozen=True)
class KeyLoad:
    """One routing key: its connections, its bytes per address and where it is routed today.

    ``usage`` maps address → (bytes produced, bytes consumed). ``movable=False`` is traffic no
    pin can move (no key, or not routed by this router): it stays on ``current``.
    """

    key: str
    connections: int
    usage: Mapping[str, tuple[int, int]]
    current: str | None = None
    movable: bool = True

    @property
    def bytes(self) -> int:
        return sum(p + c for p, c in self.usage.values())


@dataclass(frozen=True)
class Placement:
    """An assignment (key → node id) and what the model predicts for it."""

    assignment: Mapping[str, str]
    cross_bytes: float
    connections: Mapping[str, int]
    bytes: Mapping[str, int]
    skew_connections: float
    skew_bytes: float
    violation: float
    moved: tuple[str, ...] = ()
    method: str = ""

    @property
    def within_bound(self) -> bool:
        return self.violation <= EPS


def skew(loads: Iterable[float]) -> float:
    """max / mean - 1 (0 for no load or no broker)."""
    loads = list(loads)
    total = sum(loads)
    if not loads or total <= 0:
        return 0.0
    return max(loads) / (total / len(loads)) - 1.0


def address_cross(produced: Sequence[float], consumed: Sequence[float]) -> float:
    """Bytes of one address that cross brokers under ON_DEMAND round-robin, forwarded and then
    redistributed to where the consumers take more than reaches them (module docstring)."""
    s = [n for n, c in enumerate(consumed) if c > 0]
    if not s:
        return 0.0
    total = float(sum(produced))
    share = total / len(s)
    forwarded = total - sum(produced[n] for n in s) / len(s)
    surplus = sum(share - consumed[n] for n in s if consumed[n] < share)
    deficit = sum(consumed[n] - share for n in s if consumed[n] > share)
    return forwarded + min(surplus, deficit)


class _State:
    """An assignment with per-address and per-broker totals, updated move by move."""

    def __init__(self, prob: "_Problem", where: list[int]):
        self.p = prob
        self.where = list(where)
        nb = len(prob.brokers)
        self.P = [[0] * nb for _ in prob.addresses]
        self.C = [[0] * nb for _ in prob.addresses]
        self.conn = [0] * nb
        self.byt = [0] * nb
        for k, n in enumerate(self.where):
            if n >= 0:
                self._add(k, n, +1)
        self.acost = [address_cross(self.P[a], self.C[a]) for a in range(len(prob.addresses))]
        self.total = math.fsum(self.acost)

    def _add(self, k: int, n: int, sign: int) -> None:
        for a, pb, cb in self.p.usage[k]:
            self.P[a][n] += sign * pb
            self.C[a][n] += sign * cb
        self.conn[n] += sign * self.p.conns[k]
        self.byt[n] += sign * self.p.kbytes[k]

    def move(self, k: int, n: int) -> None:
        old = self.where[k]
        if old == n:
            return
        if old >= 0:
            self._add(k, old, -1)
        if n >= 0:
            self._add(k, n, +1)
        self.where[k] = n
        for a, _, _ in self.p.usage[k]:
            new = address_cross(self.P[a], self.C[a])
            self.total += new - self.acost[a]
            self.acost[a] = new

    def cost(self) -> float:
        """Total cross bytes (kept up to date move by move; ``exact_cost`` sums afresh)."""
        return self.total

    def exact_cost(self) -> float:
        return math.fsum(self.acost)

    def violation(self) -> float:
        p = self.p
        v = 0.0
        for n in range(len(p.brokers)):
            if p.cap_c > 0 and self.conn[n] > p.cap_c + EPS:
                v += (self.conn[n] - p.cap_c) / p.cap_c
            if p.cap_b > 0 and self.byt[n] > p.cap_b + EPS:
                v += (self.byt[n] - p.cap_b) / p.cap_b
        return v

    def score(self) -> tuple[float, float]:
        return (round(self.violation(), 12), self.cost())


@dataclass
class _Problem:
    brokers: list[str]
    keys: list[KeyLoad]
    max_skew: float
    addresses: list[str] = field(default_factory=list)
    usage: list[list[tuple[int, int, int]]] = field(default_factory=list)
    conns: list[int] = field(default_factory=list)
    kbytes: list[int] = field(default_factory=list)
    cap_c: float = 0.0
    cap_b: float = 0.0

    def __post_init__(self) -> None:
        index: dict[str, int] = {}
        for k in self.keys:
            for a in sorted(k.usage):
                index.setdefault(a, len(index))
        self.addresses = list(index)
        self.usage = [[(index[a], int(pb), int(cb)) for a, (pb, cb) in sorted(k.usage.items())]
                      for k in self.keys]
        self.conns = [int(k.connections) for k in self.keys]
        self.kbytes = [k.bytes for k in self.keys]
        nb = len(self.brokers)
        self.cap_c = (1 + self.max_skew) * sum(self.conns) / nb if nb else 0.0
        self.cap_b = (1 + self.max_skew) * sum(self.kbytes) / nb if nb else 0.0
        self.bindex = {b: i for i, b in enumerate(self.brokers)}
        self.current = [self.bindex.get(k.current, -1) if k.current is not None else -1 for k in self.keys]
        self.movable = [k.movable and len(self.brokers) > 0 for k in self.keys]
        for i, k in enumerate(self.keys):
            if not k.movable and self.current[i] < 0:
                raise ValueError(f"key {k.key!r} is not movable and has no known current broker")

    def groups(self) -> list[list[int]]:
        """Movable keys joined by the addresses they share (union-find), each group sorted."""
        parent = list(range(len(self.keys)))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x
        first: dict[int, int] = {}
        for k, us in enumerate(self.usage):
            if not self.movable[k]:
                continue
            for a, _, _ in us:
                if a in first:
                    ra, rb = find(first[a]), find(k)
                    if ra != rb:
                        parent[max(ra, rb)] = min(ra, rb)
                else:
                    first[a] = k
        out: dict[int, list[int]] = {}
        for k in range(len(self.keys)):
            if self.movable[k]:
                out.setdefault(find(k), []).append(k)
        return list(out.values())


def _fits(st: _State, n: int, conns: int, nbytes: int) -> bool:
    p = st.p
    return st.conn[n] + conns <= p.cap_c + EPS and st.byt[n] + nbytes <= p.cap_b + EPS


def _greedy(p: _Problem, order: str) -> _State:
    st = _State(p, [p.current[k] if not p.movable[k] else -1 for k in range(len(p.keys))])
    groups = p.groups()
    if order == "connections":
        groups.sort(key=lambda g: (-sum(p.conns[k] for k in g), -sum(p.kbytes[k] for k in g), g[0]))
    else:
        groups.sort(key=lambda g: (-sum(p.kbytes[k] for k in g), -sum(p.conns[k] for k in g), g[0]))
    nb = len(p.brokers)
    for g in groups:
        gc, gb = sum(p.conns[k] for k in g), sum(p.kbytes[k] for k in g)
        fits = [n for n in range(nb) if _fits(st, n, gc, gb)]
        if fits:
            def whole(n: int) -> tuple:
                before = st.cost()
                for k in g:
                    st.move(k, n)
                added = st.cost() - before
                for k in g:
                    st.move(k, -1)
                here = sum(p.kbytes[k] for k in g if p.current[k] == n)
                load = (st.byt[n] / p.cap_b if p.cap_b else 0) + (st.conn[n] / p.cap_c if p.cap_c else 0)
                return (round(added, 6), -here, load, n)
            best = min(fits, key=whole)
            for k in g:
                st.move(k, best)
            continue
        for k in sorted(g, key=lambda k: (-p.kbytes[k], -p.conns[k], k)):
            cands = [n for n in range(nb) if _fits(st, n, p.conns[k], p.kbytes[k])] or list(range(nb))

            def single(n: int) -> tuple:
                v0, c0 = st.violation(), st.cost()
                st.move(k, n)
                dv, dc = st.violation() - v0, st.cost() - c0
                st.move(k, -1)
                mates = sum(p.kbytes[j] for j in g if st.where[j] == n)
                load = (st.byt[n] / p.cap_b if p.cap_b else 0) + (st.conn[n] / p.cap_c if p.cap_c else 0)
                return (round(dv, 12), round(dc, 6), -mates, load, n)
            st.move(k, min(cands, key=single))
    return st


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Score ``a`` is strictly better than ``b`` (violation first, then cross bytes)."""
    if a[0] < b[0] - EPS:
        return True
    return a[0] <= b[0] + EPS and a[1] < b[1] - max(EPS, 1e-12 * abs(b[1]))


def _local_search(p: _Problem, st: _State, *, max_passes: int = 30, partners: int = 24) -> _State:
    nb = len(p.brokers)
    movable = [k for k in range(len(p.keys)) if p.movable[k]]
    groups = p.groups()
    for _ in range(max_passes):
        if st.score() == (0.0, 0.0):
            break  # nothing crosses and within bound: no move can do better
        improved = False
        # single moves
        for k in movable:
            cur = st.where[k]
            best, best_n = st.score(), cur
            for n in range(nb):
                if n == cur:
                    continue
                st.move(k, n)
                s = st.score()
                if _better(s, best):
                    best, best_n = s, n
                st.move(k, cur)
            if best_n != cur:
                st.move(k, best_n)
                improved = True
        whole = [g for g in groups if len({st.where[k] for k in g}) == 1]
        # swaps for moves the bound blocks (a key with a key or a whole group of similar size)
        if _swap_pass(p, st, movable, whole, partners):
            improved = True
            whole = [g for g in groups if len({st.where[k] for k in g}) == 1]
        # whole groups: move one, or swap two (these change the balance only)
        for g in whole:
            cur = st.where[g[0]]
            if any(st.where[k] != cur for k in g):
                continue
            base = st.score()
            for n in range(nb):
                if n == cur:
                    continue
                for k in g:
                    st.move(k, n)
                if _better(st.score(), base):
                    improved = True
                    break
                for k in g:
                    st.move(k, cur)
        if _group_swap_pass(p, st, whole, partners):
            improved = True
        if not improved:
            break
    return st


def _swap_pass(p: _Problem, st: _State, movable: list[int], whole: list[list[int]], partners: int) -> bool:
    """Swaps for moves the balance bound blocks: a key whose move to broker n would cut cross
    bytes but overload n is swapped with a key of similar size on n, or with a whole group on n
    (which goes to the key's broker). Keys of groups that are whole never gain from moving alone,
    so in practice only the keys of split groups are tried; on small inputs every key is."""
    nb = len(p.brokers)

    def lists():
        keys_on: list[list[tuple[int, int]]] = [[] for _ in range(nb)]
        for k in movable:
            keys_on[st.where[k]].append((p.kbytes[k], k))
        groups_on: list[list[tuple[int, int, list[int]]]] = [[] for _ in range(nb)]
        for g in whole:
            n = st.where[g[0]]
            if all(st.where[k] == n for k in g):
                groups_on[n].append((sum(p.kbytes[k] for k in g), g[0], g))
        for lst in keys_on + groups_on:
            lst.sort()
        return keys_on, groups_on

    def nearest(lst: list, size: int) -> list:
        i = bisect.bisect_left(lst, (size, -1))
        return lst[max(0, i - partners // 2): i + partners // 2]

    keys_on, groups_on = lists()
    small = len(movable) <= RESTART_KEYS  # small inputs: every key tries its swaps
    improved = False
    for k in movable:
        base = st.score()
        cur = st.where[k]
        done = False
        for n in range(nb):
            if n == cur or done:
                continue
            st.move(k, n)
            alone = st.score()
            st.move(k, cur)
            if not small and (not alone[1] < base[1] - EPS or _better(alone, base)):
                continue  # no cross bytes to gain, or the single-move step takes it
            for _, j in nearest(keys_on[n], p.kbytes[k]):
                if st.where[j] != n or j == k:
                    continue
                st.move(k, n)
                st.move(j, cur)
                if _better(st.score(), base):
                    done = True
                    break
                st.move(j, n)
                st.move(k, cur)
            if done:
                break
            for _, _, h in nearest(groups_on[n], p.kbytes[k]):
                if k in h or any(st.where[j] != n for j in h):
                    continue
                st.move(k, n)
                for j in h:
                    st.move(j, cur)
                if _better(st.score(), base):
                    done = True
                    break
                for j in h:
                    st.move(j, n)
                st.move(k, cur)
        if done:
            improved = True
            keys_on, groups_on = lists()
    return improved


def _group_swap_pass(p: _Problem, st: _State, whole: list[list[int]], partners: int) -> bool:
    """Swap two whole groups on different brokers, partners of similar size."""
    sized = sorted((sum(p.kbytes[k] for k in g), g[0], g) for g in whole)
    improved = False
    for i, (_, _, g) in enumerate(sized):
        cur = st.where[g[0]]
        if any(st.where[k] != cur for k in g):
            continue
        base = st.score()
        for _, _, h in sized[max(0, i - partners // 2): i + partners // 2 + 1]:
            hn = st.where[h[0]]
            if h is g or hn == cur or any(st.where[k] != hn for k in h):
                continue
            for k in g:
                st.move(k, hn)
            for k in h:
                st.move(k, cur)
            if _better(st.score(), base):
                improved = True
                break
            for k in h:
                st.move(k, hn)
            for k in g:
                st.move(k, cur)
    return improved


def _placement(p: _Problem, where: Sequence[int], method: str) -> Placement:
    st = _State(p, list(where))
    assignment = {k.key: p.brokers[where[i]] for i, k in enumerate(p.keys) if k.movable}
    moved = tuple(k.key for i, k in enumerate(p.keys) if k.movable and p.current[i] != where[i])
    return Placement(assignment, st.exact_cost(), dict(zip(p.brokers, st.conn)), dict(zip(p.brokers, st.byt)),
                     skew(st.conn), skew(st.byt), st.violation(), moved, method)


def evaluate(brokers: Sequence[str], keys: Sequence[KeyLoad], assignment: Mapping[str, str],
             max_skew: float = 0.10) -> Placement:
    """The model's figures for a given assignment (immovable keys stay on ``current``)."""
    p = _Problem(list(brokers), list(keys), max_skew)
    where = [p.bindex[assignment[k.key]] if k.movable else p.current[i] for i, k in enumerate(p.keys)]
    return _placement(p, where, "given")


def recommend(brokers: Sequence[str], keys: Sequence[KeyLoad], max_skew: float = 0.10) -> Placement:
    """The heuristic's assignment of the movable keys to ``brokers`` (module docstring)."""
    if max_skew < 0:
        raise ValueError("max_skew must be >= 0")
    p = _Problem(sorted(brokers), sorted(keys, key=lambda k: k.key), max_skew)
    if not p.brokers:
        return Placement({}, 0.0, {}, {}, 0.0, 0.0, 0.0, (), "no brokers")
    starts: list[tuple[str, _State]] = [("groups by bytes", _greedy(p, "bytes")),
                                        ("groups by connections", _greedy(p, "connections"))]
    if any(p.movable[k] and p.current[k] >= 0 for k in range(len(p.keys))):
        seed = _greedy(p, "bytes")  # keys without a current broker take the greedy's choice
        cur = _State(p, [p.current[k] if p.current[k] >= 0 else seed.where[k] for k in range(len(p.keys))])
        starts.append(("current placement", cur))
    if len(p.keys) <= RESTART_KEYS:  # small inputs: a few seeded random starts as well
        rng = random.Random(0)
        for i in range(RESTARTS):
            starts.append((f"random start {i + 1}", _State(p, [rng.randrange(len(p.brokers)) if p.movable[k]
                                                               else p.current[k] for k in range(len(p.keys))])))
    best: tuple | None = None
    for name, st in starts:
        st = _local_search(p, st)
        moved = sum(1 for k in range(len(p.keys)) if p.movable[k] and st.where[k] != p.current[k])
        v, c = st.score()
        rank = (v, c, moved)
        if best is None or _better((v, c), best[0][:2]) or (
                not _better(best[0][:2], (v, c)) and moved < best[0][2]):
            best = (rank, name, list(st.where))
    assert best is not None
    return _placement(p, best[2], best[1])


def exhaustive(brokers: Sequence[str], keys: Sequence[KeyLoad], max_skew: float = 0.10,
               max_assignments: int = 2_000_000) -> Placement:
    """The best assignment by trying them all: least violation, then least cross bytes."""
    p = _Problem(sorted(brokers), sorted(keys, key=lambda k: k.key), max_skew)
    movable = [k for k in range(len(p.keys)) if p.movable[k]]
    nb = len(p.brokers)
    if nb ** len(movable) > max_assignments:
        raise ValueError(f"{nb}^{len(movable)} assignments is too many for an exhaustive search")
    st = _State(p, [p.current[k] if not p.movable[k] else 0 for k in range(len(p.keys))])
    best: tuple | None = None
    for combo in itertools.product(range(nb), repeat=len(movable)):
        for k, n in zip(movable, combo):
            st.move(k, n)
        s = st.score()
        moved = sum(1 for k in movable if st.where[k] != p.current[k])
        if best is None or _better(s, best[0]) or (not _better(best[0], s) and moved < best[1]):
            best = (s, moved, list(st.where))
    assert best is not None
    return _placement(p, best[2], "exhaustive")
