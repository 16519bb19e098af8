"""ROUND_ROBIN: one shared counter starting at a random offset (Artemis §2.3).

``pos`` starts at ``rng.randrange(2**31 - 1)`` (Java ``nextInt(Integer.MAX_VALUE)``); each call
takes ``targets[pos % len]`` and advances. The counter is shared by all keys; a changed list
length just re-applies the modulo.
"""

from __future__ import annotations

from typing import Sequence

from .base import Policy, Target


class RoundRobinPolicy(Policy):
    """Rotate over the ready targets, starting at a random position."""

    name = "ROUND_ROBIN"

    def __init__(self, properties=None, rng=None) -> None:
        super().__init__(properties, rng)
        self.pos = self.rng.randrange(2**31 - 1)

    def select_target(self, targets: Sequence[Target], key: str) -> Target | None:
        n = len(targets)
        if not n:
            return None
        pos = self.pos % n
        self.pos = pos + 1
        return targets[pos]
