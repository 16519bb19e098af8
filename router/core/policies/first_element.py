"""FIRST_ELEMENT: the first ready target in pool order (priority fail-over; Artemis §2.2)."""

from __future__ import annotations

from typing import Sequence

from .base import Policy, Target


class FirstElementPolicy(Policy):
    """Always the first ready target, so pool order is a priority list."""

    name = "FIRST_ELEMENT"
    follows_pool_order = True
    key_deterministic = True  # the target depends only on the ready targets (dry runs, replay)

    def select_target(self, targets: Sequence[Target], key: str) -> Target | None:
        return targets[0] if targets else None
