"""LEAST_CONNECTIONS: the ready target with the fewest connections (Artemis §2.6).

Counts come from the health probes (``observe``), so they are as fresh as ``check-period``.
As in Artemis (``LeastConnectionsPolicy``'s ``UPDATE_CONNECTION_COUNT_PROBE``, which fails when
``broker.ConnectionCount`` cannot be read), a probe that gives no count makes the target not
ready (``Pool.require_connection_count``, set by the router for this policy).
A count below ``CONNECTION_COUNT_THRESHOLD`` counts as 0 (so small differences do not matter);
a target never counted ranks last; ties go round-robin over the tied targets, sharing one counter.
"""

from __future__ import annotations

from typing import Sequence

from .base import Target
from .round_robin import RoundRobinPolicy

_UNKNOWN = 2**31 - 1  # Java Integer.MAX_VALUE


class LeastConnectionsPolicy(RoundRobinPolicy):
    """Fewest live connections; ties round-robin; unknown counts rank last."""

    name = "LEAST_CONNECTIONS"
    PROPERTIES = frozenset({"CONNECTION_COUNT_THRESHOLD"})
    needs_connection_count = True

    def __init__(self, properties=None, rng=None) -> None:
        super().__init__(properties, rng)
        self.threshold = self.int_property("CONNECTION_COUNT_THRESHOLD", 0)
        self.counts: dict[str, int] = {}

    def observe(self, target: Target, connection_count: int | None) -> None:
        if connection_count is None:
            self.counts.pop(target.slot, None)
        else:
            self.counts[target.slot] = 0 if connection_count < self.threshold else connection_count

    def set_count(self, target: Target, connection_count: int | None) -> None:
        """Set a count directly (tests, or a shell that tracks proxied connections)."""
        self.observe(target, connection_count)

    def select_target(self, targets: Sequence[Target], key: str) -> Target | None:
        n = len(targets)
        if n <= 1:
            return targets[0] if n else None
        counts = self.counts
        best = _UNKNOWN + 1
        tied: list[Target] = []
        for t in targets:
            c = counts.get(t.slot, _UNKNOWN)
            if c < best:
                best = c
                tied = [t]
            elif c == best:
                tied.append(t)
        if len(tied) == 1:
            return tied[0]
        return super().select_target(tied, key)
