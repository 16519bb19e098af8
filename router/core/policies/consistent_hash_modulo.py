"""CONSISTENT_HASH_MODULO: turn the key into ``(hash(key) & 0x7fffffff) % MODULO`` (Artemis §2.5).

The transformed key is a decimal string in ``0..MODULO-1`` (sign bit cleared, not abs);
``MODULO <= 0`` leaves the key unchanged. The policy itself hashes any string, ``NULL`` included
(as Artemis's does); the *router* never passes it the ``NULL`` key, so ``NULL`` stays ``NULL``. ``select_target`` always refuses, as in
Artemis: this policy is for sharding with ``local-target-filter`` (e.g. ``NULL|0``), not for a pool.
"""

from __future__ import annotations

from typing import Sequence

from .base import Policy, Target
from .hashing import HASHES


class ConsistentHashModuloPolicy(Policy):
    """Key → str(hash & 0x7fffffff % MODULO); never selects a target."""

    name = "CONSISTENT_HASH_MODULO"
    PROPERTIES = frozenset({"MODULO", "HASH"})
    key_deterministic = True

    def __init__(self, properties=None, rng=None) -> None:
        super().__init__(properties, rng)
        self.modulo = self.int_property("MODULO")
        self.hash_name = self.choice_property("HASH", tuple(HASHES), "MURMUR3")
        self.hash = HASHES[self.hash_name]

    def transform_key(self, key: str) -> str:
        if self.modulo > 0:
            return str((self.hash(key) & 0x7FFFFFFF) % self.modulo)
        return key

    def select_target(self, targets: Sequence[Target], key: str) -> Target | None:
        return None
