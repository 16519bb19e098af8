"""CONSISTENT_HASH: a hash ring over the ready targets' identities (node ids).

Theory of operation
-------------------
Each ready target puts ``VIRTUAL_NODES`` points on a signed 32-bit ring; a key goes to the owner
of the greatest point ``<=`` hash(key) (the *floor*). Points are rebuilt only when the ready set
changes (a sorted int list + owner list, looked up with ``bisect``), so a decision is one hash
and one bisect.

* ``VIRTUAL_NODES = 1`` is Artemis's algorithm (spec §2.4): one point per target at
  hash(node id), built in list order so that on equal hashes the *later* target wins, floor
  lookup, and a key below every point goes to the **smallest** point (not a true ring). With
  ``HASH = FNV1A`` it is bit-for-bit Artemis.
* ``VIRTUAL_NODES > 1`` (default 128): points at hash(f"{id}-{i}"), floor lookup wrapping to the
  largest point — a true ring, so the load evens out and a removed target only moves its own keys.
* ``LOAD_FACTOR = c`` (optional, >= 1.0): consistent hashing with bounded loads (Mirrokni,
  Thorup, Zadimoghaddam 2018). No target takes more than ``ceil(c * (assigned + 1) / n)`` of the
  keys this policy has assigned and that are still live (computed exactly); a full target passes
  the key on along the ring, and a target with no ring point of its own (equal hashes) is still
  used below the cap. The choice then depends on history, so stickiness comes from the sticky
  cache. ``select_target`` counts the assignment; the router ``release``s it when it ends (the
  key's cache entry expires, is evicted or re-pointed; without a cache, the connection closes).
  ``choose_target`` (management lookups) picks the same way without counting.
* More than one target and no hashing is needed for exactly one target (Artemis returns it).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from fractions import Fraction
from typing import Sequence

from router.errors import PolicyError

from .base import Policy, Target
from .hashing import HASHES


class ConsistentHashPolicy(Policy):
    """Hash ring over target identities; ``HASH``, ``VIRTUAL_NODES``, ``LOAD_FACTOR``."""

    name = "CONSISTENT_HASH"
    PROPERTIES = frozenset({"HASH", "VIRTUAL_NODES", "LOAD_FACTOR"})

    def __init__(self, properties=None, rng=None) -> None:
        super().__init__(properties, rng)
        self.hash_name = self.choice_property("HASH", tuple(HASHES), "MURMUR3")
        self.hash = HASHES[self.hash_name]
        self.virtual_nodes = self.int_property("VIRTUAL_NODES", 128, min=1)
        self.load_factor = self.float_property("LOAD_FACTOR", None, min=1.0)
        if self.load_factor is not None:
            if not math.isfinite(self.load_factor):
                raise PolicyError(f"{self.name}: property LOAD_FACTOR="
                                  f"{self.properties['LOAD_FACTOR']!r} must be finite")
            # The cap is computed in integers from the exact decimal (1.1 is 11/10): in floats
            # 1.1 * 100 / 5 = 22.000000000000004 would round the cap up to 23.
            exact = Fraction(self.properties["LOAD_FACTOR"].strip())
            self._lf_num, self._lf_den = exact.numerator, exact.denominator
        self.key_deterministic = self.load_factor is None
        self.tracks_assignments = self.load_factor is not None
        self.artemis_ring = self.virtual_nodes == 1
        self.loads: dict[str, int] = {}
        self._seen: object = None
        self._sig: tuple[str, ...] | None = None
        self._points: list[int] = []
        self._owners: list[int] = []

    # -- ring ---------------------------------------------------------------------------------
    def _build(self, targets: Sequence[Target]) -> None:
        h = self.hash
        owner_of: dict[int, int] = {}
        for i, t in enumerate(targets):  # list order: a later target overwrites an equal hash
            ident = t.identity
            if self.artemis_ring:
                owner_of[h(ident)] = i
            else:
                for v in range(self.virtual_nodes):
                    owner_of[h(f"{ident}-{v}")] = i
        self._points = sorted(owner_of)
        self._owners = [owner_of[p] for p in self._points]

    def _sync(self, targets: Sequence[Target]) -> None:
        if targets is self._seen:
            return
        sig = tuple(t.identity for t in targets)
        if sig != self._sig:
            self._build(targets)
            self._sig = sig
        self._seen = targets

    def ring_index(self, targets: Sequence[Target], key: str) -> int:
        """Position on the ring (index into the sorted points) that owns ``key``."""
        self._sync(targets)
        i = bisect_right(self._points, self.hash(key)) - 1
        if i < 0:
            # Artemis falls back to the smallest point (firstEntry); a true ring wraps to the largest.
            i = 0 if self.artemis_ring else len(self._points) - 1
        return i

    # -- policy -------------------------------------------------------------------------------
    def select_target(self, targets: Sequence[Target], key: str) -> Target | None:
        """Pick a target; with LOAD_FACTOR the pick counts as one live assignment."""
        t = self.choose_target(targets, key)
        if t is not None and self.load_factor is not None:
            self.acquire(t.slot)
        return t

    def choose_target(self, targets: Sequence[Target], key: str) -> Target | None:
        """The pick, not counted (management lookups)."""
        n = len(targets)
        if n <= 1:
            return targets[0] if n else None
        i = self.ring_index(targets, key)
        if self.load_factor is None:
            return targets[self._owners[i]]
        return self._bounded(targets, i)

    def acquire(self, slot: str) -> None:
        if self.load_factor is not None:
            self.loads[slot] = self.loads.get(slot, 0) + 1

    def _bounded(self, targets: Sequence[Target], i: int) -> Target:
        loads = self.loads
        total = 0
        for t in targets:
            total += loads.get(t.slot, 0)
        cap = -(-self._lf_num * (total + 1) // (self._lf_den * len(targets)))  # exact ceil
        owners = self._owners
        m = len(owners)
        tried: set[int] = set()
        for step in range(m):  # walk the ring downwards (floor direction), wrapping
            o = owners[(i - step) % m]
            if o in tried:
                continue
            t = targets[o]
            if loads.get(t.slot, 0) < cap:
                return t
            tried.add(o)
            if len(tried) == len(targets):
                break
        # A target whose every point was taken by an equal hash (VIRTUAL_NODES = 1, Artemis: the
        # later target wins) is not on the ring; it may be the one below the cap.
        for o, t in enumerate(targets):
            if o not in tried and loads.get(t.slot, 0) < cap:
                return t
        # Unreachable for c >= 1 (some target is below the mean); keep the ring owner anyway.
        return targets[owners[i]]

    def release(self, slot: str) -> None:
        """Bounded load: one live assignment to the target in ``slot`` ended."""
        n = self.loads.get(slot, 0)
        if n > 1:
            self.loads[slot] = n - 1
        elif n == 1:
            del self.loads[slot]

    def describe(self):
        d = super().describe()
        d.update(hash=self.hash_name, virtual_nodes=self.virtual_nodes,
                 load_factor=self.load_factor)
        if self.load_factor is not None:
            d["live_assignments"] = dict(sorted(self.loads.items()))
        return d
